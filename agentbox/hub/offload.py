"""Routed experts in host RAM: how a MoE model larger than the GPUs splits between them and the host, and how
fast it decodes so split.

Only a few experts per token are active, so a model whose weights do not fit the cards still decodes at a
useful speed with attention, the dense layers, shared experts and the KV cache on the GPU and the routed
experts of the first N MoE layers in host RAM, run there by the CPU expert kernels (`serve --n-cpu-moe N`;
`--cpu-moe`: all of them; llama.cpp's flags of the same names). The planner takes the smallest N that lets
the rest fit the GPU at some tensor-parallel size, and estimates a decode step as the bytes each side reads
over that side's memory bandwidth (a bound: a step reads at least that):

    step = active expert bytes in RAM / RAM bandwidth + the rest of the active bytes / (GPU bandwidth x tp)

`PlanConfig.min_tok_s` is the floor below which a better quant split so ranks after a worse one that fits the
GPU alone (hub/plan.py `_rank`); so does a split whose experts the CPU expert kernels do not run (bf16, FP8,
MXFP4: the torch reference dequantises each routed expert per step, far below the bound, so there is no honest
estimate to rank it by).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from agentbox.hub.profiles import Profile, Variant
from agentbox.hub.weight_bytes import cpu_expert_kernel, expert_resident_bytes
from agentbox.hw.bandwidth import gpu_bandwidth, ram_bandwidth
from agentbox.hw.probe import GIB, Probe


@dataclass(frozen=True)
class ExpertSplit:
    """One placement: the routed experts of the first `in_ram` of `moe_layers` MoE layers in host RAM."""

    moe_layers: int
    in_ram: int
    host_bytes: int  # the experts in RAM, in the CPU kernels' form
    host_reserve: int  # the OS, Python, torch itself (PlanConfig.cpu_reserve_gib)
    host_available: int  # the machine's RAM (not what is free this minute: the plan must not move with it)
    gpu_experts_bytes: int  # the experts left on the GPUs, all ranks together
    ram_step_bytes: int  # what a decoded token reads from RAM: its routed experts there
    gpu_step_bytes: int  # what it reads from the GPUs, all ranks together
    ram_bandwidth: int  # bytes/s
    gpu_bandwidth: int  # bytes/s of one card
    tp: int
    min_tok_s: float
    ram_bandwidth_assumed: bool = False  # the machine description carries no host.ram_bandwidth
    gpu_bandwidth_assumed: bool = False
    host_kernel: bool = True  # the CPU expert kernels run these experts (else the torch reference: no estimate)

    @property
    def host_need(self) -> int:
        return self.host_bytes + self.host_reserve

    @property
    def host_fits(self) -> bool:
        return self.host_need <= self.host_available

    @property
    def ram_step_s(self) -> float:
        return self.ram_step_bytes / self.ram_bandwidth

    @property
    def gpu_step_s(self) -> float:
        return self.gpu_step_bytes / (self.gpu_bandwidth * self.tp)

    @property
    def tok_s(self) -> float:
        return 1.0 / (self.ram_step_s + self.gpu_step_s)

    @property
    def slow(self) -> bool:
        return self.tok_s < self.min_tok_s

    @property
    def preferred(self) -> bool:
        """Ranked by its bits beside the variants that fit the GPU alone: above the floor, on the CPU kernels
        (the reference's speed is not a bandwidth bound: far below it, and not estimated)."""
        return self.host_kernel and not self.slow

    @property
    def all_layers(self) -> bool:
        return self.in_ram == self.moe_layers

    @property
    def serve_flag(self) -> str:
        return "--cpu-moe" if self.all_layers else f"--n-cpu-moe {self.in_ram}"

    @property
    def arithmetic(self) -> str:
        op = "<=" if self.host_fits else ">"
        which = "every MoE layer" if self.all_layers else f"{self.in_ram} of {self.moe_layers} MoE layers"
        return (f"experts of {which} in RAM: {self.host_bytes / GIB:.1f} + {self.host_reserve / GIB:.1f} reserve = "
                f"{self.host_need / GIB:.1f} GiB {op} {self.host_available / GIB:.1f} GiB of RAM ({self.serve_flag})")

    @property
    def speed(self) -> str:
        ram = f"{self.ram_bandwidth / 1e9:.0f} GB/s RAM{' (assumed)' if self.ram_bandwidth_assumed else ''}"
        gpu = f"{self.gpu_bandwidth / 1e9:.0f} GB/s GPU{' (assumed)' if self.gpu_bandwidth_assumed else ''}"
        tp = f" x {self.tp}" if self.tp > 1 else ""
        verdict = "below" if self.slow else "above"
        if not self.host_kernel:
            verdict = "no CPU expert kernel for these experts: a bound the torch reference does not reach; " + verdict
        return (f"decode <= {self.tok_s:.1f} tok/s: {self.ram_step_bytes / 1e9:.2f} GB experts / {ram} "
                f"({self.ram_step_s * 1e3:.1f} ms) + {self.gpu_step_bytes / 1e9:.2f} GB rest / {gpu}{tp} "
                f"({self.gpu_step_s * 1e3:.1f} ms) per token; {verdict} the {self.min_tok_s:g} tok/s floor")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "host_need": self.host_need, "host_fits": self.host_fits, "tok_s": self.tok_s,
                "slow": self.slow, "serve_flag": self.serve_flag}


@dataclass(frozen=True)
class Sides:
    """A variant's weights as the split sees them: experts on either side, the rest, what a token reads."""

    experts_gpu: int  # every routed expert in the GPU form
    experts_cpu: int  # every routed expert in the CPU kernels' form
    rest: int  # everything else, on the GPU
    rest_step: int  # what a token reads of the rest (the input embedding table aside)
    routed_share: float  # of the experts a token reads
    host_kernel: bool  # the CPU expert kernels run them in host RAM


def sides(profile: Profile, variant: Variant, gpu_weights: int) -> Sides:
    """`gpu_weights`: the variant's resident bytes with everything on the GPU (hub/weight_bytes.py)."""
    experts_gpu = expert_resident_bytes(profile, variant, "cuda")
    rest = max(0, gpu_weights - experts_gpu)
    others = profile.params - profile.expert_params
    # the active non-expert parameters: active_params less the routed experts a token reads (no input table)
    active_rest = profile.active_params - profile.expert_params * profile.routed_share
    rest_share = min(1.0, max(0.0, active_rest / others)) if others > 0 else 1.0
    return Sides(experts_gpu, expert_resident_bytes(profile, variant, "cpu"), rest, round(rest * rest_share),
                 profile.routed_share, cpu_expert_kernel(profile, variant))


def can_split(profile: Profile) -> bool:
    """Every MoE model's routed experts are FusedMoE layers (Nemotron-H's un-gated ones too), which
    layers/experts/placement.py can put in host RAM."""
    return profile.moe and profile.expert_params > 0


def split_at(
    profile: Profile, s: Sides, in_ram: int, tp: int, probe: Probe, host_reserve: int, min_tok_s: float,
    assumed_ram_bandwidth: int, assumed_gpu_bandwidth: int,
) -> ExpertSplit:
    """The split with the experts of the first `in_ram` MoE layers in RAM (every layer's experts the same size)."""
    layers = profile.moe_layers
    host = s.experts_cpu * in_ram // layers
    gpu_experts = s.experts_gpu * (layers - in_ram) // layers
    ram_bw = ram_bandwidth(probe.host)
    gpu_bws = [bw for g in probe.gpus if (bw := gpu_bandwidth(g))]
    return ExpertSplit(
        moe_layers=layers,
        in_ram=in_ram,
        host_bytes=host,
        host_reserve=host_reserve,
        host_available=probe.host.ram_total,
        gpu_experts_bytes=gpu_experts,
        ram_step_bytes=round(host * s.routed_share),
        gpu_step_bytes=round(gpu_experts * s.routed_share) + s.rest_step,
        ram_bandwidth=ram_bw or assumed_ram_bandwidth,
        gpu_bandwidth=min(gpu_bws) if len(gpu_bws) == len(probe.gpus) and gpu_bws else assumed_gpu_bandwidth,
        tp=tp,
        min_tok_s=min_tok_s,
        ram_bandwidth_assumed=ram_bw is None,
        gpu_bandwidth_assumed=len(gpu_bws) != len(probe.gpus) or not gpu_bws,
        host_kernel=s.host_kernel,
    )


def fewest_layers(s: Sides, layers: int, room: int, tp: int) -> int | None:
    """The fewest MoE layers whose experts must leave the GPUs so that the weights left take at most `room`
    bytes per card at `tp` (split over the ranks); None when even with every layer's experts gone they do not."""
    return next((n for n in range(layers + 1) if (s.rest + s.experts_gpu * (layers - n) // layers) // tp <= room),
                None)
