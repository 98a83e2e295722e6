"""What the planner weighs: its knobs (`PlanConfig`) and one variant at one tensor-parallel size (`Candidate`),
carrying its memory arithmetic and its reasons (hub/plan.py builds and ranks them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agentbox.config import PLAN_CONTEXT, PLAN_MIN_TOK_S, PLAN_SESSIONS
from agentbox.hub.ngram_table import TablePlacement
from agentbox.hub.offload import ExpertSplit
from agentbox.hub.profiles import Variant
from agentbox.hw.probe import GIB


@dataclass(frozen=True)
class PlanConfig:
    context: int | None = None  # tokens per session; None: min(default_context, the model's context length)
    sessions: int = PLAN_SESSIONS  # sessions whose KV stays resident at full context
    reserve_gib: float = 1.0  # per GPU: CUDA context, activations, CUDA graphs
    reserve_share: float = 0.04  # plus this share of the card (allocator fragmentation)
    cpu_reserve_gib: float = 2.0  # host: the OS, Python, torch itself
    default_context: int = PLAN_CONTEXT
    # Experts in host RAM (hub/offload.py): a split variant decoding below this bound ranks after the variants
    # that fit the GPU alone, whatever its bits
    min_tok_s: float = PLAN_MIN_TOK_S
    experts_in_ram: bool = True  # False: the GPUs alone (a MoE model that does not fit them does not run)
    # Bandwidths assumed where the machine description carries none (the row says "assumed"): two channels of
    # DDR5 reach about this much; a card the name table does not know gets this.
    assumed_ram_bandwidth_gbs: float = 50.0
    assumed_gpu_bandwidth_gbs: float = 500.0
    # One random 4 KiB read from an NVMe disk at queue depth 1 (a page fault reads one page at a time): what a
    # row of an n-gram table that does not fit RAM costs (hub/ngram_table.py).
    assumed_disk_read_ms: float = 0.1


@dataclass
class Candidate:
    variant: Variant
    device: str  # "cuda" or "cpu"
    tp: int
    weights_bytes: int  # resident on the device(s), all ranks together
    kv_bytes: int  # all ranks together
    reserve_bytes: int  # per device
    available_bytes: int  # per device: free memory of the emptiest device used (or available RAM)
    reasons: list[str] = field(default_factory=list)  # empty: accepted
    notes: list[str] = field(default_factory=list)
    decode_weight_bytes: int = 0  # weights one decoded token reads (MoE: the active parameters only)
    kv_replicated: bool = False  # MLA: every rank keeps the whole latent cache (kv_bytes is then per rank)
    split: ExpertSplit | None = None  # routed experts of some MoE layers in host RAM (weights_bytes: the GPUs' part)
    table: TablePlacement | None = None  # an n-gram table in host RAM (never in weights_bytes)

    @property
    def ok(self) -> bool:
        return not self.reasons

    @property
    def need_per_device(self) -> int:
        kv = self.kv_bytes if self.kv_replicated else self.kv_bytes // self.tp
        return self.weights_bytes // self.tp + kv + self.reserve_bytes

    @property
    def table_on_disk(self) -> bool:
        """Part of its n-gram table does not fit RAM beside the rest: those rows are read from disk."""
        return self.table is not None and not self.table.in_ram

    @property
    def gpu_fits(self) -> bool:
        return self.need_per_device <= self.available_bytes

    @property
    def fits(self) -> bool:
        return self.gpu_fits and (self.split is None or self.split.host_fits)

    @property
    def slow(self) -> bool:
        """Split to host RAM and not preferred: below the plan's floor, or its host experts have no CPU kernel
        (ranked after the variants that fit the GPU alone)."""
        return self.split is not None and not self.split.preferred

    @property
    def arithmetic(self) -> str:
        # CPU plans against the machine's RAM (stable); a GPU's is its free memory
        where = "free per GPU" if self.device == "cuda" else "of RAM"
        op = "<=" if self.gpu_fits else ">"
        split = f"/{self.tp}" if self.tp > 1 else ""  # weights and KV shared by the tp ranks (row: "tp N")
        kv = (f"{gib_num(self.kv_bytes)} KV (every rank keeps the whole latent cache)" if self.kv_replicated
              else f"{gib_num(self.kv_bytes)}{split} KV")
        return (
            f"{gib_num(self.weights_bytes)}{split} weights + {kv} + "
            f"{gib_num(self.reserve_bytes)} reserve = {gib(self.need_per_device)} {op} {gib(self.available_bytes)} {where}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "variant": self.variant.name,
            "format": self.variant.format,
            "repo": self.variant.repo,
            "download_bytes": self.variant.size,
            "device": self.device,
            "tp": self.tp,
            "weights_bytes": self.weights_bytes,
            "kv_bytes": self.kv_bytes,
            "kv_replicated": self.kv_replicated,
            "reserve_bytes": self.reserve_bytes,
            "need_per_device": self.need_per_device,
            "available_bytes": self.available_bytes,
            "fits": self.fits,
            "ok": self.ok,
            "arithmetic": self.arithmetic,
            "decode_weight_bytes": self.decode_weight_bytes,
            "split": self.split.to_dict() if self.split else None,
            "table": self.table.to_dict() if self.table else None,
            "reasons": self.reasons,
            "notes": self.notes,
        }


def gib_num(n: int) -> str:
    return f"{n / GIB:.1f}"


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"
