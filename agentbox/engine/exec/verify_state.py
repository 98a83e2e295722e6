"""Speculative verifies of models with per-sequence state (hybrid models' Gated DeltaNet layers, Gemma 4's
sliding-window rings): rank 0's bookkeeping of how many of a verify's positions each sequence kept.

A verify scores a sequence's next token and its draft in one step; its state layers leave the slot as it was and
stash each position's inputs (layers/recurrent_state.py). Only after the core has taken the sampled tokens is it
known how many positions count (the accepted run can end early at a stop token, at max_tokens or where a grammar
starts closing), so the commit travels in the next step's `StepInputs.state_commits` (every tensor-parallel rank
keeps its own stash) and runs before that step's snapshot copies and forward pass.

The state at a page boundary is what turns' snapshots are taken from (engine/cache/state_snapshots.py). A
decode step ends on a boundary and the runner copies its state aside; a verify can pass one, so its commit stops
there to take the copy. Where each row's copy stands is the runner's to know (`aligned`, by row); it reports
every change with the handle it concerns (`report`), and the core tells the cache. A verify's is reported right
after sampling, before the core may end the request and save its snapshot; a shorter accepted run than the
sampler's is corrected at the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the core's types, for hints only: exec must not import the core at run time
    from agentbox.engine.cache.seq_cache import SeqCache
    from agentbox.engine.request import Request
    from agentbox.engine.scheduler import ScheduledSeq

Report = Callable[["SeqCache", int], None]  # (handle, position its row's page-aligned copy holds now)


@dataclass
class _Verify:
    req: Request
    handle: SeqCache
    row: int
    start: int  # position of the step's first new token (the request's last real token)
    aligned_before: int  # where its row's page-aligned copy stood before this verify
    told: int  # the page boundary the request was told after sampling (0: none)


class PendingVerifies:
    """Rank 0: the last step's verifies of stateful sequences, until the next step commits them."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.pending: list[_Verify] = []

    def _boundary(self, start: int, kept: int) -> int:
        """The last page boundary in (start, start + kept], or 0."""
        b = (start + kept) // self.page_size * self.page_size
        return b if b > start else 0

    def sampled(self, seqs: list[ScheduledSeq], tokens: list[list[int]], failed: dict[int, str], aligned: list[int],
                report: Report) -> None:
        """After sampling the step's sampled seqs: each verified request's state will be at its kept tokens (the
        sampled run, one position per token: the last real one and the accepted drafts; none if it failed)."""
        for i, s in enumerate(seqs):
            req, h = s.request, s.request.cache_handle
            if not s.draft or h is None:
                continue
            start = req.num_computed_tokens
            told = 0 if i in failed else self._boundary(start, len(tokens[i]))
            self.pending.append(_Verify(req, h, h.row, start, aligned[h.row], told))
            if told:
                aligned[h.row] = told
                report(h, told)

    def commits(self, aligned: list[int], report: Report) -> torch.Tensor:
        """int64 [C, 3] (slot, kept, aligned) for the next step; clears the list. A request still running kept
        what the core counted; one that ended needs its state only up to the boundary it was told."""
        out = []
        for v in self.pending:
            if v.req.is_running and v.req.cache_handle is v.handle:
                kept = v.req.num_computed_tokens - v.start
                b = self._boundary(v.start, kept)
                if b != v.told:  # the core kept fewer tokens than were sampled
                    aligned[v.row] = b or v.aligned_before
                    report(v.handle, aligned[v.row])
            else:
                b, kept = v.told, v.told - v.start if v.told else 0
            out.append((v.row, kept, b - v.start if b else 0))
        self.pending = []
        return torch.tensor(out, dtype=torch.int64).reshape(-1, 3)
