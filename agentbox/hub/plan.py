"""The planner: which variant of a model runs on this machine, at which tensor-parallel size, and why not the others.

A candidate is accepted when (1) our engine runs its architecture and format, (2) it is not known-bad for
this GPU's compute capability, and (3) it fits: per device, weights / tp + KV cache for context x sessions
/ tp + a reserve must stay within free memory. Every candidate carries that arithmetic and its reasons.
CPU-only machines plan the same way against available RAM. A MoE model that fits no GPU set may still fit
with the routed experts of its first N MoE layers in host RAM (hub/offload.py): then the candidate carries
that split, the RAM it needs and a decode-speed bound from each side's memory bandwidth. A model with a hashed
n-gram table (hub/ngram_table.py) keeps it in host RAM beside all that, or reads what does not fit from disk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentbox.hub.candidate import Candidate, PlanConfig, gib
from agentbox.hub.engine_support import (
    QUANTISED_METHODS,
    engine_rejection,
    gguf_note,
    kernel_caveat,
    moe_kernel_caveat,
    nvfp4_path,
    other_scheme,
)
from agentbox.hub.gguf_moe import cpu_only_types
from agentbox.hub.ngram_table import TablePlacement, place_table
from agentbox.hub.offload import can_split, fewest_layers, sides, split_at
from agentbox.hub.profiles import Profile, Variant
from agentbox.hub.weight_bytes import (
    active_weight_bytes,
    cpu_quantised_experts,
    experts_kept_quantised,
    gguf_experts,
    gguf_gpu_mix,
    mtp_weight_bytes,
    resident_weight_bytes,
)
from agentbox.hw.probe import GIB, Probe
from agentbox.layers.quant.formats import (
    QuantMethod,
    method_of_format,
)


@dataclass
class Plan:
    profile: Profile
    probe: Probe
    context: int
    sessions: int
    candidates: list[Candidate]  # accepted first, best first; then the rejected
    notes: list[str] = field(default_factory=list)

    @property
    def chosen(self) -> Candidate | None:
        return self.candidates[0] if self.candidates and self.candidates[0].ok else None

    @property
    def with_mtp(self) -> bool:
        """Whether the plan's head line counts the MTP head: the chosen variant's files carry it (else: any does)."""
        chosen = self.chosen
        return chosen.variant.carries_mtp if chosen else any(v.carries_mtp for v in self.profile.variants)

    @property
    def accepted(self) -> list[Candidate]:
        return [c for c in self.candidates if c.ok]

    def to_dict(self) -> dict[str, Any]:
        chosen = self.chosen
        return {
            "model": self.profile.name,
            "machine": describe_machine(self.probe),
            "context": self.context,
            "sessions": self.sessions,
            "kv_bytes_per_token": self.profile.kv_bytes_per_token(_kv_dtype_bytes(self.probe), mtp=self.with_mtp),
            "state_bytes_per_session": self.profile.state_bytes_per_session(),
            "params": self.profile.params,
            "active_params": self.profile.active_params,
            "ngram_table_bytes": self.profile.ngram_table_bytes,  # in host RAM, never in a GPU's weights
            "chosen": chosen.variant.name if chosen else None,
            "candidates": [c.to_dict() for c in self.candidates],
            "notes": self.notes,
        }


def plan(profile: Profile, probe: Probe, config: PlanConfig | None = None) -> Plan:
    config = config or PlanConfig()
    notes: list[str] = []
    context = config.context or min(config.default_context, profile.context_length)
    if context > profile.context_length:
        notes.append(
            f"context {context} is past the model's {profile.context_length}; planned at {profile.context_length}"
        )
        context = profile.context_length
    sessions = max(1, config.sessions)
    if profile.mtp_params:
        device = "cpu" if probe.cpu_only else "cuda"
        with_head = [v for v in profile.variants if v.carries_mtp]
        if with_head:
            notes.append(
                f"its MTP head (the draft of --speculative mtp) is counted for {', '.join(v.name for v in with_head)}: "
                f"{gib(mtp_weight_bytes(profile, with_head[0], device))} of weights in the compute dtype, "
                f"{profile.mtp_layers} more attention layer of KV; GGUF files carry no head agentbox loads (they draft "
                f"from the text only)")
    candidates = [_candidate(profile, v, probe, context, sessions, config) for v in profile.variants]
    candidates.sort(key=_rank)
    best = candidates[0] if candidates and candidates[0].ok else None
    if (moved := _moved_by_free_ram(candidates, best, probe)) is not None:
        notes.append(moved)
    if best is not None and best.device == "cuda" and best.tp < len(probe.gpus):
        notes.append(
            f"{best.variant.name} fits at tp={best.tp}, leaving {len(probe.gpus) - best.tp} GPU(s) free; "
            + ("a larger tp splits the weights (every rank keeps the whole latent cache), buying room for more "
               "sessions or context" if profile.kv_replicated else
               "a larger tp splits weights and KV, buying room for more sessions or context")
        )
    return Plan(profile, probe, context, sessions, candidates, notes)


def _candidate(
    profile: Profile, variant: Variant, probe: Probe, context: int, sessions: int, config: PlanConfig
) -> Candidate:
    device = "cpu" if probe.cpu_only else "cuda"
    cpu_kernels = probe.software.cpu_kernels_ok is not False  # a described machine: assumed to build them
    weights = resident_weight_bytes(profile, variant, device, cpu_kernels)
    per_token = profile.kv_bytes_per_token(_kv_dtype_bytes(probe), mtp=variant.carries_mtp)
    kv = (per_token * context + profile.state_bytes_per_session()) * sessions
    reasons: list[str] = []
    notes: list[str] = []
    if (rejected := engine_rejection(profile, variant)) is not None:
        reasons.append(rejected)
    for bad in profile.known_bad:
        if bad.matches(variant.format, probe.min_sm):
            where = f"sm_{probe.min_sm}" if bad.sm else "every GPU"
            if (other := other_scheme(bad, variant)) is not None:
                notes.append(f"known bad on {where} ({bad.kernel}): {bad.reason}; {other}")
            else:
                reasons.append(f"known bad on {where} ({bad.kernel}): {bad.reason}")
    for good in profile.known_good:
        if good.matches(variant.format, probe.min_sm):
            notes.append(f"known good ({good.kernel}): {good.reason}")
    if device == "cpu":
        # Against the machine's RAM, not what is free this minute: the plan (and so what `serve` picks) must
        # not move with the page cache. Free RAM only rejects a variant that cannot load now, saying so.
        cand = Candidate(
            variant, device, 1, weights, kv, int(config.cpu_reserve_gib * GIB), probe.host.ram_total,
            kv_replicated=profile.kv_replicated,
        )
    else:
        cand = _best_tp(profile, probe, variant, weights, kv, config)
        lean = (per_token * context + profile.live_state_bytes()) * sessions
        if not cand.fits and lean < kv and (held := _best_tp(profile, probe, variant, weights, lean, config)).fits:
            cand = held  # the runner keeps snapshots in host memory when the card has no room for them
            notes.append(f"state snapshots in host memory ({gib(kv - lean)}): the card has room for the "
                         "running sessions' state only")
        if not cand.fits and config.experts_in_ram and rejected is None and can_split(profile):
            gpu_only = cand
            cand = _split_candidate(profile, probe, variant, weights, kv, config)
            notes += _split_notes(cand, gpu_only, profile, variant)
    cand.table = _table(profile, cand, probe, config, context)
    if cand.table is not None:
        notes.append(cand.table.arithmetic)
    if cand.split is not None:
        reasons += _split_reasons(cand)
        if cand.fits and cand.split.host_need > probe.host.ram_free:  # as a CPU plan: RAM that is not free now
            reasons.append(f"{SHORT_OF_FREE_RAM}: the experts in RAM need {gib(cand.split.host_need)}, "
                           f"{gib(probe.host.ram_free)} free now")
    elif not cand.fits:
        where = f"per GPU at tp={cand.tp}" if device == "cuda" else "of RAM"
        what = "free" if device == "cuda" else "in all"
        reasons.append(
            f"does not fit: needs {gib(cand.need_per_device)} {where}, {gib(cand.available_bytes)} {what}"
        )
    elif device == "cpu" and cand.need_per_device > probe.host.ram_free:
        reasons.append(f"{SHORT_OF_FREE_RAM}: needs {gib(cand.need_per_device)}, {gib(probe.host.ram_free)} free now")
    method = method_of_format(variant.format)
    weights -= mtp_weight_bytes(profile, variant, device)  # the notes below describe the model's own weights
    if device == "cpu" and (experts := cpu_quantised_experts(profile, variant)) is not None:
        notes.append(
            f"{variant.format} on CPU: the experts stay quantised, the other {(profile.params - experts) / 1e9:.1f}B "
            f"params are dequantised to fp32 at load: {gib(variant.size)} on disk, {gib(weights)} resident"
        )
    elif (gexp := gguf_experts(profile, variant, device)) is not None and (cpu_only := cpu_only_types(variant.name)):
        host = gguf_experts(profile, variant, "cpu")
        assert host is not None  # the same mix
        notes.append(
            f"{variant.format} {variant.name.upper()} MoE: {' / '.join(cpu_only)} experts stay quantised in host RAM "
            f"only (the CPU kernel, {gib(host.resident)} for all of them there; {gib(gexp.file)} of the file); on the "
            f"GPU they are dequantised to bf16 ({gib(gexp.resident)} if all were there)"
        )
    elif gexp is not None:
        notes.append(
            f"{variant.format} {variant.name.upper()} MoE: the experts stay quantised ({gib(gexp.file)} of the file, "
            f"{gib(gexp.resident)} resident); {gib(variant.size)} on disk, {gib(weights)} resident"
        )
    elif (mix := gguf_gpu_mix(profile, variant, device, cpu_kernels)) is not None:
        notes.append(gguf_note(variant, mix, weights, device))
    elif method is not None and method in QUANTISED_METHODS and weights > variant.size * 1.1:
        notes.append(f"{variant.format} is dequantised at load: {gib(variant.size)} on disk, {gib(weights)} resident")
    if (caveat := kernel_caveat(variant, device)) is not None:
        notes.append(caveat)
    if method is QuantMethod.NVFP4 and device == "cuda":
        notes.append(nvfp4_path(variant, probe.min_sm, weights, active_weight_bytes(profile, variant, device, cpu_kernels),
                                cand.split is not None, probe.software.flashinfer_ok))
    if profile.moe and (caveat := moe_kernel_caveat(variant, device)) is not None:
        notes.append(caveat)
    if profile.moe:
        # Every expert is resident (memory above); a decoded token reads only the active share (speed).
        where = " (on the GPU and in host RAM)" if cand.split is not None else ""
        notes.append(
            f"MoE: all experts resident{where}; a token reads {profile.active_params / 1e9:.1f}B of "
            f"{profile.params / 1e9:.1f}B params ({gib(active_weight_bytes(profile, variant, device, cpu_kernels))} per decode step)"
        )
    if (not cand.gpu_fits and (longest := fitting_context(cand, profile, probe, sessions)) >= MIN_USEFUL_CONTEXT
            and (cand.split is None or cand.split.host_fits)):
        notes.append(f"fits at tp={cand.tp} up to {longest:,} tokens of context (--context {longest})")
    cand.reasons, cand.notes = reasons, notes
    cand.decode_weight_bytes = (cand.split.ram_step_bytes + cand.split.gpu_step_bytes if cand.split
                                else active_weight_bytes(profile, variant, device, cpu_kernels))
    return cand


def _table(profile: Profile, cand: Candidate, probe: Probe, config: PlanConfig, context: int) -> TablePlacement | None:
    """The n-gram table beside what else the candidate keeps in host RAM: a CPU plan's everything, a split's
    experts and reserve, else the reserve."""
    if cand.device == "cpu":
        others, what = cand.need_per_device, "weights, KV and reserve"
    elif cand.split is not None:
        others, what = cand.split.host_need, "experts in RAM and reserve"
    else:
        others, what = int(config.cpu_reserve_gib * GIB), "reserve"
    return place_table(profile, others, what, probe.host.ram_total, config.assumed_disk_read_ms / 1e3, context)


def _split_candidate(
    profile: Profile, probe: Probe, variant: Variant, weights: int, kv: int, config: PlanConfig
) -> Candidate:
    """The variant with the routed experts of its first N MoE layers in host RAM: at each tp the fewest N that
    lets the rest fit the cards; of those the fastest that fits RAM too (else the one closest to fitting)."""
    s = sides(profile, variant, weights)
    by_free = sorted(probe.gpus, key=lambda g: g.memory_free, reverse=True)
    best: Candidate | None = None
    for tp in tp_sizes(profile, len(probe.gpus)):
        used = by_free[:tp]
        reserve = int(config.reserve_gib * GIB + config.reserve_share * max(g.memory_total for g in used))
        available = min(g.memory_free for g in used)
        room = available - reserve - (kv if profile.kv_replicated else kv // tp)
        n = fewest_layers(s, profile.moe_layers, room, tp)
        split = split_at(profile, s, max(1, profile.moe_layers if n is None else n), tp, probe,
                         int(config.cpu_reserve_gib * GIB), config.min_tok_s,
                         int(config.assumed_ram_bandwidth_gbs * 1e9), int(config.assumed_gpu_bandwidth_gbs * 1e9))
        cand = Candidate(variant, "cuda", tp, s.rest + split.gpu_experts_bytes, kv, reserve, available,
                         kv_replicated=profile.kv_replicated, split=split)
        if best is None or _split_key(cand) < _split_key(best):
            best = cand
    assert best is not None  # tp_sizes always yields 1
    return best


def _split_key(c: Candidate) -> tuple[Any, ...]:
    assert c.split is not None
    return (not c.fits, not c.gpu_fits, -c.split.tok_s if c.fits else c.split.host_need, c.tp)


def _split_notes(cand: Candidate, gpu_only: Candidate, profile: Profile, variant: Variant) -> list[str]:
    split = cand.split
    assert split is not None
    notes = [split.arithmetic, split.speed,
             f"GPU only it needs {gib(gpu_only.need_per_device)} per GPU at tp={gpu_only.tp}, "
             f"{gib(gpu_only.available_bytes)} free"]
    if cand.ok and split.slow:
        notes.append(f"below the {split.min_tok_s:g} tok/s floor: ranked after the variants that fit the GPU alone")
    elif cand.ok and not split.host_kernel:
        notes.append(f"{variant.expert_format} experts in RAM: no CPU expert kernel for them yet (layers/experts/cpu.py runs "
                     "GGUF Q4_0-Q8_0 and K-quants, AWQ, GPTQ, NVFP4); the torch reference runs each routed expert per step: "
                     "ranked after the variants that fit the GPU alone or have one")
    if not experts_kept_quantised(profile, variant) and variant.format not in ("bf16", "fp16", "fp32"):
        notes.append(f"{variant.name}: no expert kernel keeps its experts' types quantised as far as its name tells "
                     f"(IQ* types are dequantised at load, layers/experts/gguf.py; llama.cpp's Q2_K to Q8_0 file "
                     f"types stay quantised): planned at bf16, which is what is missing")
    return notes


def _split_reasons(c: Candidate) -> list[str]:
    """What is missing for a split variant: room on the cards for the rest, RAM for the experts, or both."""
    split = c.split
    assert split is not None
    reasons = []
    if not c.gpu_fits:
        reasons.append(f"does not fit: even with every MoE layer's experts in RAM the rest needs "
                       f"{gib(c.need_per_device)} per GPU at tp={c.tp}, {gib(c.available_bytes)} free "
                       f"({gib(c.need_per_device - c.available_bytes)} missing)")
    if not split.host_fits:
        reasons.append(f"does not fit: the experts in RAM need {gib(split.host_need)} of RAM, "
                       f"{gib(split.host_available)} in all ({gib(split.host_need - split.host_available)} missing)")
    return reasons


# A CPU variant that fits the machine's RAM but not what is free now: the one reason free RAM moves a plan.
SHORT_OF_FREE_RAM = "fits this machine's RAM but not what is free now"


def _moved_by_free_ram(candidates: list[Candidate], best: Candidate | None, probe: Probe) -> str | None:
    """Why the plan is not what it is on this machine at rest: a better variant that only free RAM rejects."""
    for c in candidates:
        if c.reasons and all(r.startswith(SHORT_OF_FREE_RAM) for r in c.reasons) and (
            best is None or _quality(c) < _quality(best)
        ):
            instead = f"chose {best.variant.name} instead" if best else "nothing runs now"
            need = c.split.host_need if c.split else c.need_per_device
            return (f"{c.variant.name} is the plan for this machine's RAM but needs {gib(need)} and "
                    f"{gib(probe.host.ram_free)} is free now: {instead} (free memory to get {c.variant.name} back)")
    return None


def _quality(c: Candidate) -> tuple[Any, ...]:
    return (c.slow, c.table_on_disk, -c.variant.bits, c.tp, c.need_per_device, c.variant.name)


MIN_USEFUL_CONTEXT = 4096  # below this an agent's system prompt alone does not fit


def fitting_context(cand: Candidate, profile: Profile, probe: Probe, sessions: int) -> int:
    """The longest context (a multiple of 1024 tokens) at which this candidate fits at its tp; 0 if none."""
    per_token = profile.kv_bytes_per_token(_kv_dtype_bytes(probe), mtp=cand.variant.carries_mtp) * sessions
    room = (cand.available_bytes - cand.reserve_bytes - cand.weights_bytes // cand.tp) * (1 if cand.kv_replicated else cand.tp)
    room -= profile.live_state_bytes() * sessions  # the snapshots in host memory (engine/exec/runner.py)
    return max(0, room // per_token // 1024 * 1024)


def tp_sizes(profile: Profile, num_gpus: int) -> list[int]:
    """Powers of two up to the GPU count that divide the KV heads (each rank holds whole heads; MLA: the
    profile's kv_heads are the attention heads whose up-projections the ranks split)."""
    sizes, tp = [], 1
    while tp <= max(1, num_gpus):
        if profile.kv_heads % tp == 0:
            sizes.append(tp)
        tp *= 2
    return sizes


def _best_tp(
    profile: Profile, probe: Probe, variant: Variant, weights: int, kv: int, config: PlanConfig
) -> Candidate:
    """The smallest tp that fits (fewer collectives per token); the largest tp when none does."""
    by_free = sorted(probe.gpus, key=lambda g: g.memory_free, reverse=True)
    cand: Candidate | None = None
    for tp in tp_sizes(profile, len(probe.gpus)):
        used = by_free[:tp]
        reserve = int(config.reserve_gib * GIB + config.reserve_share * max(g.memory_total for g in used))
        cand = Candidate(variant, "cuda", tp, weights, kv, reserve, min(g.memory_free for g in used),
                         kv_replicated=profile.kv_replicated)
        if cand.fits:
            return cand
    assert cand is not None  # tp_sizes always yields 1
    return cand


def _rank(c: Candidate) -> tuple[Any, ...]:
    # Accepted first; a split below the speed floor after the others; one that reads its n-gram table from disk
    # after those that keep it in RAM (its prefill pays a disk read per missing row, hub/ngram_table.py); then the
    # most bits per weight (quality), the GPU alone before a split of the same bits, the fewest ranks, the least
    # memory.
    return (not c.ok, c.slow, c.table_on_disk, -c.variant.bits, c.split is not None, c.tp, c.need_per_device,
            c.variant.name)


def _kv_dtype_bytes(probe: Probe) -> int:
    """bf16 on a GPU; fp16 on CPU too, the default CPU pool (EngineConfig.kv_dtype; --exact-cpu's fp32 is the
    exception, not the plan)."""
    del probe
    return 2


def describe_machine(probe: Probe) -> str:
    if probe.cpu_only:
        return f"CPU only: {probe.host.cpu_model}, {gib(probe.host.ram_total)} RAM ({gib(probe.host.ram_free)} free)"
    counts: dict[str, int] = {}
    for g in probe.gpus:
        key = f"{g.name} ({g.arch}, {gib(g.memory_total)})"
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{n}x {k}" for k, n in counts.items())
