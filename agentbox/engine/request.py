"""A request owns its state: tokens, how many of them are computed, its cache handle, its sampling state,
timings.

There is no prefill or decode phase: each step catches `num_computed_tokens` up to `num_tokens` within the
step's token budget; when it reaches the end, the step samples one more token.

One writer per field: the scheduler (engine/scheduler.py) writes what scheduling decides (status, computed
tokens, the cache handle, the cache counters, the finish reason), the core (engine/core.py) what it creates
and what the client sees (grammar, loop guard, the prompt's array, output tokens, first-token time), the drafter
its draft state. The runner only reads (tests/test_architecture_claims.py checks this).
"""

from __future__ import annotations

import enum
import time
from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from agentbox.engine.sampling import SamplingParams

if TYPE_CHECKING:
    from agentbox.engine.cache.seq_cache import SeqCache
    from agentbox.engine.draft_state import DraftState
    from agentbox.engine.grammar import GrammarState
    from agentbox.engine.loop_guard import LoopGuard


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: a request is itself, never equal to another
class Request:
    request_id: str
    # Prompt then output, in one list that only grows: a step reads its new tokens by slice, never by
    # concatenating prompt + output (that was 30k tokens copied per agent per decode step).
    token_ids: list[int]
    sampling: SamplingParams
    session_id: str | None = None
    arrival: float = field(default_factory=time.monotonic)
    namespace: str = ""  # see AddRequest.namespace
    history_end: int = 0  # see AddRequest.history_end (0 < history_end < the prompt's length, or 0)

    num_prompt_tokens: int = field(init=False)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    # Cache accounting, from real events (set when the request first starts running).
    num_cached_tokens: int = 0  # prompt tokens served from the cache at admission (all tiers)
    num_host_cached_tokens: int = 0  # of those, copied back from the host tier
    num_recomputed_tokens: int = 0  # history of its session it had to recompute (cache had dropped it)
    # Done generating, but its last token's KV is computed one more step so the cache holds the whole turn
    # (when that token completes a page; otherwise it finishes at the next schedule: Scheduler._finish_needless_flushes).
    flushing: bool = False
    num_preemptions: int = 0  # > 0: it was admitted before (its turn began, its counters are set)
    first_token_time: float | None = None
    grammar_state: GrammarState | None = None  # when decoding is constrained
    loop_guard: LoopGuard | None = None  # engine/loop_guard.py, unless `serve --no-loop-guard`
    draft_state: DraftState | None = None  # speculative decoding (engine/draft.py), from its first draft
    _generator: torch.Generator | None = None
    # What the cache gave it while it runs (its pages, its row, its state seed): the cache's own object, opaque
    # to everyone else (engine/cache/seq_cache.py); None while it waits.
    cache_handle: SeqCache | None = field(default=None, repr=False)
    # The prompt as the int32 array the API process sent (rebuilt from its delta, engine/ipc/prompt_delta.py),
    # when it came as one: the cache compares it with the history's keys at C speed (token_array).
    prompt_ids: array | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output: the stored list itself, not a copy (read it, do not mutate it)."""
        return self.token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def token_array(self, n: int) -> array | None:
        """The first n tokens (prompt, then output) as an int32 array, when the prompt came as one; else None.
        Never mutated by the request: the cache may keep it."""
        p = self.prompt_ids
        if p is None:
            return None
        if n <= len(p):
            return p if n == len(p) else p[:n]
        return p + array("i", self.token_ids[len(p) : n])

    def append_output(self, token: int) -> None:
        self.token_ids.append(token)

    @property
    def num_drafted(self) -> int:
        return 0 if self.draft_state is None else self.draft_state.drafted

    @property
    def num_accepted(self) -> int:
        return 0 if self.draft_state is None else self.draft_state.accepted

    @property
    def is_running(self) -> bool:
        return self.status is Status.RUNNING

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def generator(self) -> torch.Generator | None:
        """A per-request generator when a seed is given, so a seeded output does not depend on batching."""
        if self.sampling.seed is None:
            return None
        if self._generator is None:
            g = torch.Generator(device="cpu")
            g.manual_seed(self.sampling.seed)  # raises on a seed beyond 64 bits: kept unset, it raises again
            self._generator = g
        return self._generator
