"""A hashed n-gram embedding table in host RAM (Qwen3.8-Flash-Next's per-layer embedding, PLE): where the
planner puts it and what it costs when RAM is short.

The table (~51B parameters, 95 GiB at bf16) is memory-mapped from the checkpoint and never copied to a GPU: each
token gathers a few rows of it (one per hashed head and PLE layer) and only those go to the card. So it takes
host RAM, not VRAM, and it never stops a variant from running: what does not fit the RAM left beside everything
else there (experts kept in RAM, the reserve) stays on disk, and the page cache reads those rows from it. Rows are
hashed uniformly, so the share of gathered rows that miss RAM is the share of the table that does not fit it;
each miss is one random read from disk:

    disk time per token = rows a token x (table bytes past RAM / table bytes) x one random read

A decoded token gathers few rows (small), a prefill gathers rows for every prompt token (the cost an agent's cold
turn pays); the plan shows both, and ranks a variant whose table fits RAM before one that reads it from disk.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from agentbox.hub.profiles import Profile
from agentbox.hw.probe import GIB


@dataclass(frozen=True)
class TablePlacement:
    table_bytes: int
    others_bytes: int  # what else lives in host RAM: experts kept there, the reserve (or a CPU plan's all)
    others: str  # what that is, in words
    ram_bytes: int  # the machine's RAM (not what is free this minute: the plan must not move with it)
    rows_per_token: int  # rows one token gathers (hashed heads x PLE layers)
    read_s: float  # one random read from disk (PlanConfig.assumed_disk_read_ms)
    context: int  # a prefill of this many tokens (the plan's context) is what the prefill cost is given for

    @property
    def room(self) -> int:
        return max(0, self.ram_bytes - self.others_bytes)

    @property
    def short(self) -> int:
        return max(0, self.table_bytes - self.room)

    @property
    def in_ram(self) -> bool:
        return self.short == 0

    @property
    def disk_share(self) -> float:
        return self.short / self.table_bytes

    @property
    def decode_disk_s(self) -> float:
        return self.rows_per_token * self.disk_share * self.read_s

    @property
    def prefill_disk_s(self) -> float:
        return self.context * self.decode_disk_s

    @property
    def arithmetic(self) -> str:
        head = (f"n-gram table in host RAM (memory-mapped from the checkpoint, never copied to a GPU; a token gathers "
                f"{self.rows_per_token} rows): {_gib(self.table_bytes)} + {_gib(self.others_bytes)} {self.others} = "
                f"{_gib(self.table_bytes + self.others_bytes)} GiB")
        if self.in_ram:
            return f"{head} <= {_gib(self.ram_bytes)} GiB of RAM"
        return (f"{head} > {_gib(self.ram_bytes)} GiB of RAM: {_gib(self.short)} GiB of it stays on disk, so "
                f"{self.disk_share:.0%} of the rows gathered are read from disk ({self.read_s * 1e3:g} ms a read, "
                f"assumed): +{self.decode_disk_s * 1e3:.1f} ms a decoded token, +{self.prefill_disk_s:.1f} s a "
                f"{self.context:,}-token prefill; {_gib(self.short)} GiB more RAM keeps it in RAM")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "in_ram": self.in_ram, "short": self.short, "decode_disk_s": self.decode_disk_s,
                "prefill_disk_s": self.prefill_disk_s}


def place_table(
    profile: Profile, others_bytes: int, others: str, ram_bytes: int, read_s: float, context: int
) -> TablePlacement | None:
    """The table beside `others_bytes` of host RAM; None for a model without one."""
    if not profile.ngram_table_params:
        return None
    return TablePlacement(profile.ngram_table_bytes, others_bytes, others, ram_bytes, profile.ngram_rows_per_token,
                          read_s, context)


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"
