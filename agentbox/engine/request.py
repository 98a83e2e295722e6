"""A request owns its state: tokens, how many of them are computed, its pages, its sampling state, timings.

There is no prefill or decode phase: each step catches `num_computed_tokens` up to `num_tokens` within the
step's token budget; when it reaches the end, the step samples one more token.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from agentbox.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from agentbox.engine.grammar import GrammarState
    from agentbox.engine.loop_guard import LoopGuard


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: a request is itself, never equal to another
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    session_id: str | None = None
    arrival: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    pages: list[int] = field(default_factory=list)  # this request's page table, one page per page_size tokens
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # Cache accounting, from real events (set when the request first starts running).
    num_cached_tokens: int = 0  # prompt tokens served from the cache at admission (all tiers)
    num_host_cached_tokens: int = 0  # of those, copied back from the host tier
    num_recomputed_tokens: int = 0  # history of its session it had to recompute (cache had dropped it)
    # Done generating, but its last token's KV is computed one more step so the cache holds the whole turn.
    flushing: bool = False
    turn_started: bool = False  # counted once as its session's turn, at its first admission attempt
    prompt_counted: bool = False  # its cache counters were set, at its first successful admission
    num_preemptions: int = 0
    first_token_time: float | None = None
    grammar_state: GrammarState | None = None  # when decoding is constrained
    loop_guard: LoopGuard | None = None  # engine/loop_guard.py, unless `serve --no-loop-guard`
    _generator: torch.Generator | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def generator(self) -> torch.Generator | None:
        """A per-request generator when a seed is given, so a seeded output does not depend on batching."""
        if self.sampling.seed is None:
            return None
        if self._generator is None:
            self._generator = torch.Generator(device="cpu")
            self._generator.manual_seed(self.sampling.seed)
        return self._generator
