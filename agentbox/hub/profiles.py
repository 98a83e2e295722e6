"""Model profiles: one TOML per model under profiles/ — variants (repo, files, sizes), shape, parsers,
sampling defaults, template quirks and the known-bad matrix (format x compute capability x kernel)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from agentbox.chat.effort import ReasoningEffort
from agentbox.config import GPU_PAGE_SIZE

# Formats whose bytes on disk are the bytes resident on the device (quantised kernels run them as stored).
# Everything else the engine converts at load: safetensors to the compute dtype, GGUF dequantised.
QUANTISED_FORMATS = ("fp8", "awq", "gptq", "nvfp4", "mxfp4")
UNQUANTISED_FORMATS = ("bf16", "fp16", "fp32")
# An n-gram embedding table (Qwen3.8-Flash-Next's PLE) is an embedding, which every release keeps bf16.
NGRAM_TABLE_BYTES_PER_PARAM = 2


class ProfileError(ValueError):
    """A profile that is missing or malformed; the message names the file and the field."""


@dataclass(frozen=True)
class Variant:
    name: str
    format: str  # bf16 | fp16 | fp32 | fp8 | awq | gptq | nvfp4 | mxfp4 | gguf
    bits: float  # average bits per weight: ranks quality between variants
    repo: str
    files: tuple[str, ...]  # every file to fetch (common files included)
    size: int  # bytes on disk of all files (approximate where the profile says so)
    source: str = "hub"  # hub | embedded
    experts: str = ""  # the routed experts' format where it is not `format` (DeepSeek-V4's release: fp8 + mxfp4)

    @property
    def expert_format(self) -> str:
        return self.experts or self.format

    @property
    def is_gguf(self) -> bool:
        return self.format == "gguf"

    @property
    def carries_mtp(self) -> bool:
        """Whether agentbox loads a multi-token-prediction head from these files (where the model has one): from an
        unquantised safetensors checkpoint's `mtp.*` (models/loader.py); a GGUF file's next-n layers are not read,
        nor a quantised checkpoint's head (whether and how its release quantises it is not known)."""
        return self.format in UNQUANTISED_FORMATS


@dataclass(frozen=True)
class PagedKV:
    """One paged group of a layout (layers/cache_layout.py): `layers` layers each keeping `values` values per entry,
    one entry per `tokens_per_entry` tokens (DeepSeek-V4: CSA entries and indexer keys per 4, HCA entries per 128)."""

    layers: int
    values: int
    tokens_per_entry: int = 1

    def values_per_token(self, page_size: int) -> float:
        """What the pool allocates a token: a page holds page_size / tokens_per_entry entry slots, and at least
        one (an entry spanning pages keeps its slot in one of them: at 128 tokens an entry and pages of 16, one
        entry's worth per 16 tokens)."""
        return self.layers * self.values / min(self.tokens_per_entry, page_size)


@dataclass(frozen=True)
class KnownBad:
    format: str
    kernel: str
    reason: str
    sm: tuple[int, ...] = ()  # empty: every compute capability
    # Only kernels of this compute scheme failed (a QuantScheme value of layers/quant/formats.py, e.g.
    # "w8a8"; kept a string so profiles load without torch); empty: whatever kernel runs the format.
    scheme: str = ""

    def matches(self, fmt: str, sm: int | None) -> bool:
        return self.format == fmt and (not self.sm or (sm is not None and sm in self.sm))


@dataclass(frozen=True)
class Profile:
    name: str
    family: str
    architecture: str
    params: int
    moe: bool
    layers: int
    kv_heads: int
    head_dim: int
    context_length: int
    tool_parser: str
    reasoning_parser: str
    variants: tuple[Variant, ...]
    sampling: dict[str, float] = field(default_factory=dict)
    template_quirks: tuple[str, ...] = ()
    known_bad: tuple[KnownBad, ...] = ()
    known_good: tuple[KnownBad, ...] = ()  # same shape; informational (shown by `plan`)
    default_rank: int | None = None  # serve with no model tries ranked profiles in this order
    # Output budget for a request that sends no max_tokens: enough for an agent writing a whole file,
    # bounded so a looping answer cannot run to the end of the context.
    max_output_tokens: int | None = None
    path: Path | None = None
    active_params_: int | None = None  # MoE: parameters one token reads (routed experts + the rest)
    expert_params: int = 0  # MoE: parameters in the routed experts (what stays quantised on CPU too); 0: unknown
    # MoE: routed experts per MoE layer and how many a token uses (its share of expert_params it reads, the
    # bytes a decoded token takes from host RAM when the experts live there, hub/offload.py); 0: unknown
    experts: int = 0
    experts_per_token: int = 0
    moe_layers_: int | None = None  # layers with routed experts (GLM-4.7-Flash: all but the first); None: all
    # Hybrid models (Gated DeltaNet): only `kv_layers` of the layers keep KV per token; the others keep a
    # fixed recurrent state of `state_bytes` per sequence (conv + fp32 matrices, engine/layers/recurrent_state.py).
    kv_layers_: int | None = None
    state_bytes: int = 0
    # Slots of `state_bytes` one session holds on the device (see state_bytes_per_session), and of those the
    # running request's own (live_state_bytes): snapshots go to host memory on a card without room for them.
    state_slots: int = 4
    live_state_slots: int = 2
    # Multi-head latent attention (GLM-4.7-Flash, DeepSeek): the cache keeps one latent of kv_lora_rank and one
    # rope key per token and layer, and every tensor-parallel rank keeps all of it (tp splits the heads of the
    # up-projections, not the latent). 0: ordinary K and V heads.
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    # Models whose cache is paged groups of compressed entries (DeepSeek-V4), replicated on every rank: the
    # groups count per token instead of kv_heads x head_dim. Empty: ordinary (or MLA) KV.
    paged_groups: tuple[PagedKV, ...] = ()
    # The checkpoint's multi-token-prediction head (Qwen3.5 / 3.6 / 3.8 `mtp.*`), a draft for `--speculative mtp`:
    # its parameters (beyond the shared embedding and LM head) and its attention layers, each keeping its own KV.
    mtp_params: int = 0
    mtp_layers: int = 0
    # The effort a request that names none is rendered at; None: the template's own default.
    reasoning_effort: ReasoningEffort | None = None
    # Hashed n-gram embedding tables (Qwen3.8-Flash-Next's PLE), not in `params`: memory-mapped from the checkpoint
    # into host RAM, never resident in VRAM (a token gathers a few rows, which alone go to the GPU).
    ngram_table_params: int = 0
    ngram_rows_per_token: int = 0  # rows of it one token gathers: hashed heads x PLE layers

    @property
    def active_params(self) -> int:
        return self.active_params_ or self.params

    @property
    def moe_layers(self) -> int:
        return self.moe_layers_ or self.layers

    @property
    def routed_share(self) -> float:
        """The share of the routed experts' parameters one token reads: top-k of E where the profile says, else
        what active_params leaves after the rest (every non-expert parameter counted active)."""
        if self.experts and self.experts_per_token:
            return self.experts_per_token / self.experts
        if not self.expert_params:
            return 1.0
        return min(1.0, max(0, self.active_params - (self.params - self.expert_params)) / self.expert_params)

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        names = ", ".join(v.name for v in self.variants)
        raise ProfileError(f"{self.name} has no variant {name!r} (it has: {names})")

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def kv_replicated(self) -> bool:
        """Every tensor-parallel rank keeps the whole cache (MLA's latent, DeepSeek-V4's entries)."""
        return self.mla or bool(self.paged_groups)

    def kv_bytes_per_token(self, dtype_bytes: int = 2, mtp: bool = True) -> int:
        """K and V for every attention layer (the MTP head's included): 2 x kv layers x kv_heads x head_dim x dtype bytes; MLA: the
        latent and the rope key, kv layers x (kv_lora_rank + qk_rope_head_dim) x dtype bytes, on each rank;
        paged groups: each group's values a token at the engine's page size, on each rank. mtp: with the MTP
        head's layers (a variant that carries the head, Variant.carries_mtp)."""
        layers = (self.kv_layers_ or self.layers) + (self.mtp_layers if mtp else 0)
        if self.paged_groups:
            page = GPU_PAGE_SIZE  # plans place models on GPUs
            return round(sum(g.values_per_token(page) for g in self.paged_groups) * dtype_bytes)
        if self.mla:
            return layers * (self.kv_lora_rank + self.qk_rope_head_dim) * dtype_bytes
        return 2 * layers * self.kv_heads * self.head_dim * dtype_bytes

    @property
    def ngram_table_bytes(self) -> int:
        """The n-gram table's bytes in the files and in host RAM (bf16 in every release)."""
        return self.ngram_table_params * NGRAM_TABLE_BYTES_PER_PARAM

    def state_bytes_per_session(self) -> int:
        """A hybrid model's recurrent state a session holds (state_slots 4): while it runs, its live state and
        its copy at the last page boundary; between turns, its two snapshots (end of prompt, end of turn;
        engine/cache/state_snapshots.py). Gemma 4's sliding rings (state_slots 2): the live ring (a page of
        slack makes it its own page-aligned copy, layers/window_kv.py) and one snapshot, what the runner
        allocates per running request by default. 0 for attention-only models."""
        return self.state_slots * self.state_bytes

    def live_state_bytes(self) -> int:
        """The state of a running session alone (hybrids: live and page-aligned copy; rings: the live ring),
        what stays on a card whose snapshots are in host memory (engine/exec/memory_budget.py fit_state_slots)."""
        return self.live_state_slots * self.state_bytes


def profile_dirs() -> list[Path]:
    """Where profiles are looked up, first match wins: $AGENTBOX_PROFILES, the source tree's profiles/."""
    dirs = [Path(p) for p in os.environ.get("AGENTBOX_PROFILES", "").split(os.pathsep) if p]
    dirs.append(Path(__file__).resolve().parents[2] / "profiles")
    return [d for d in dirs if d.is_dir()]


def load_profiles() -> list[Profile]:
    seen: dict[str, Profile] = {}
    for d in profile_dirs():
        for path in sorted(d.glob("*.toml")):
            prof = load_profile_file(path)
            seen.setdefault(prof.name.lower(), prof)
    return list(seen.values())


def find_profile(model: str) -> Profile:
    """By name, case-insensitive; also accepts a repo id (`Qwen/Qwen3-8B`) or the name after the slash."""
    wanted = model.lower()
    profiles = load_profiles()
    for prof in profiles:
        repos = {v.repo.lower() for v in prof.variants}
        if wanted in (prof.name.lower(), prof.path.stem.lower() if prof.path else "") or wanted in repos:
            return prof
    short = wanted.rsplit("/", 1)[-1]
    for prof in profiles:
        if prof.name.lower() == short:
            return prof
    raise ProfileError(f"no profile for {model!r}; {names_hint(model, profiles)}")


def names_hint(wanted: str, profiles: list[Profile]) -> str:
    """The profile names close to a mistyped one (`serve --model`, `plan`, `pull` say the same), else them all."""
    import difflib

    from agentbox.invocation import agentbox_cmd

    names = [p.name for p in profiles]
    lower = {n.lower(): n for n in names}
    close = [lower[m] for m in difflib.get_close_matches(wanted.lower(), list(lower), n=3, cutoff=0.5)]
    close += [n for n in names if wanted.lower() in n.lower() and n not in close]
    if not close:
        return f"known models: {', '.join(names)}"
    return f"close matches: {', '.join(close[:4])}   (all of them: {agentbox_cmd()} models --known)"


def load_profile_file(path: Path) -> Profile:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: {exc}") from exc
    try:
        return _profile(data, path)
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"{path}: bad or missing field ({exc})") from exc


def _profile(data: dict[str, Any], path: Path) -> Profile:
    common = tuple(data.get("common_files", []))
    variants = tuple(_variant(v, common) for v in data["variants"])
    return Profile(
        name=data["name"],
        family=data["family"],
        architecture=data["architecture"],
        params=int(data["params"]),
        moe=bool(data.get("moe", False)),
        layers=int(data["layers"]),
        kv_heads=int(data["kv_heads"]),
        head_dim=int(data["head_dim"]),
        context_length=int(data["context_length"]),
        tool_parser=data.get("tool_parser", ""),
        reasoning_parser=data.get("reasoning_parser", ""),
        variants=variants,
        sampling=dict(data.get("sampling", {})),
        template_quirks=tuple(data.get("template_quirks", [])),
        known_bad=tuple(_known(k) for k in data.get("known_bad", [])),
        known_good=tuple(_known(k) for k in data.get("known_good", [])),
        default_rank=data.get("default_rank"),
        max_output_tokens=int(data["max_output_tokens"]) if "max_output_tokens" in data else None,
        path=path,
        active_params_=int(data["active_params"]) if "active_params" in data else None,
        expert_params=int(data.get("expert_params", 0)),
        experts=int(data.get("experts", 0)),
        experts_per_token=int(data.get("experts_per_token", 0)),
        moe_layers_=int(data["moe_layers"]) if "moe_layers" in data else None,
        kv_layers_=int(data["kv_layers"]) if "kv_layers" in data else None,
        state_bytes=int(data.get("state_bytes", 0)),
        state_slots=int(data.get("state_slots", 4)),
        live_state_slots=int(data.get("live_state_slots", 2)),
        kv_lora_rank=int(data.get("kv_lora_rank", 0)),
        qk_rope_head_dim=int(data.get("qk_rope_head_dim", 0)),
        paged_groups=tuple(PagedKV(int(g["layers"]), int(g["values"]), int(g.get("tokens_per_entry", 1)))
                           for g in data.get("paged_groups", [])),
        mtp_params=int(data.get("mtp_params", 0)),
        mtp_layers=int(data.get("mtp_layers", 0)),
        reasoning_effort=ReasoningEffort(data["reasoning_effort"]) if "reasoning_effort" in data else None,
        ngram_table_params=int(data.get("ngram_table_params", 0)),
        ngram_rows_per_token=int(data.get("ngram_rows_per_token", 0)),
    )


def _variant(v: dict[str, Any], common: tuple[str, ...]) -> Variant:
    files = list(v.get("files", []))
    shards = int(v.get("shards", 0))
    if shards == 1:
        files.append("model.safetensors")
    elif shards > 1:  # the hub's standard sharded layout
        files += [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
        files.append("model.safetensors.index.json")
    if v.get("common", True):
        files = list(common) + files
    if not files:
        raise ValueError(f"variant {v['name']!r} lists no files")
    return Variant(
        name=v["name"],
        format=v["format"],
        bits=float(v["bits"]),
        repo=v.get("repo", ""),
        files=tuple(files),
        size=int(v["size"]),
        source=v.get("source", "hub"),
        experts=v.get("experts_format", ""),
    )


def _known(k: dict[str, Any]) -> KnownBad:
    return KnownBad(
        format=k["format"], kernel=k.get("kernel", "any"), reason=k["reason"], sm=tuple(k.get("sm", [])),
        scheme=str(k.get("scheme", "")),
    )
