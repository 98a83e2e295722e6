"""One request's drafting state (engine/draft.py drafts; the request holds this): its token history as an
int32 array and its recent acceptance. Apart from the drafter so the request needs nothing of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

# The per-token acceptance a new request starts from, and its weight in verified tokens; each verify's counts
# decay by DECAY, so a is the recent acceptance.
PRIOR_ACCEPTANCE, PRIOR_WEIGHT, DECAY = 0.7, 2.0, 0.8
PAUSE_STEPS = 16


class DraftSource(Enum):
    """Where a draft came from: the request's own text (suffix or n-gram match) or the checkpoint's MTP head."""

    TEXT = "suffix"
    MTP = "mtp"


class TokenHistory:
    """An int32 array that only grows, kept in step with a token list by appending what it lacks."""

    def __init__(self, capacity: int = 1024) -> None:
        self.buf = np.empty(capacity, dtype=np.int32)
        self.n = 0

    def extend(self, tokens: list[int] | np.ndarray) -> None:
        need = self.n + len(tokens)
        if need > self.buf.size:
            grown = np.empty(max(need, 2 * self.buf.size), dtype=np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : need] = tokens
        self.n = need

    def sync(self, tokens: list[int]) -> None:
        if len(tokens) > self.n:
            self.extend(tokens[self.n :])

    @property
    def view(self) -> np.ndarray:
        return self.buf[: self.n]


@dataclass
class DraftState:
    """One request's drafting: its token history, its recent acceptance, what it drafted and had accepted."""

    history: TokenHistory = field(default_factory=TokenHistory)
    drafted: int = 0
    accepted: int = 0
    # decayed counts of accepted draft tokens and of rejections (one per verify that stopped early)
    kept: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    refused: float = (1 - PRIOR_ACCEPTANCE) * PRIOR_WEIGHT
    paused_until: int = 0  # a decode-step count
    pause: int = PAUSE_STEPS
    steps: int = 0
    source: DraftSource = DraftSource.TEXT  # of the draft last proposed
    # The MTP head's draft from the last step (engine/exec/mtp.py), for a request of `mtp_after` tokens.
    mtp: list[int] = field(default_factory=list)
    mtp_after: int = -1

    @property
    def acceptance(self) -> float:
        """The recent chance that a draft token is accepted, given the one before it was."""
        return self.kept / (self.kept + self.refused)
