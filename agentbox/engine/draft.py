"""Draft-free speculative decoding: drafts proposed from text the request has already seen.

An agent's output repeats its context: the file it edits around the change, a diff against a file it just
read, a tool call's arguments, a test name from a log. So the draft for the next tokens is the continuation
of the longest earlier match of the request's last tokens: first in its own tokens (prompt + output: an
agent's prompt is its session's whole history), then in a bounded window of recent outputs of every session
(SuffixDecoding's global tree, NeurIPS 2025; llama.cpp's `ngram` speculation is the fixed-length case). The
engine verifies a draft as a short extend (scheduler.py reserves its slots, exec/verify.py keeps the longest
prefix the model agrees with plus one token), so the output is exactly what plain decoding gives.

The search is a vectorised scan instead of a suffix tree: positions holding the last token, narrowed token by
token backwards while any still match. It needs no index to build or keep in step with the request (the
history is an int32 array that only grows), and costs tens of microseconds at 30k tokens against a decode
step's milliseconds. `arctic-inference` (SuffixDecoding's own tree) was not used: see docs/speculative.md.

A rejected draft still costs its rows: on a CPU each verified row adds 0.1-0.3 of a decode step (the kernels
share a weight's pass among 8 rows; measured by `agentbox bench spec` per kernel variant), on a GPU almost nothing.
So k is chosen per step to maximise the expected tokens per unit of step cost, (1 + a + a^2 + ... + a^k) /
(1 + c k), from the request's recent per-token acceptance a and the row cost c. When no k pays (a too low for
c), the request stops drafting for a while (a pause that doubles each time), so prose that repeats nothing
decodes as before.

Where the checkpoint ships a multi-token-prediction head (Qwen3.5 / 3.6 / 3.8) the runner also drafts with it
after every step (engine/exec/mtp.py) and hands the draft here (`offer`): under `--speculative mtp` it is the
draft; under `auto` the longer of it and the text match is. A text match wins on an edit (it runs for dozens of
tokens), the head on new text, where no match exists. Each source's verified and accepted tokens are counted
apart (`by_source`, /v1/stats).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from agentbox.config import EngineConfig, Speculative
from agentbox.engine.draft_state import (
    DECAY,
    PRIOR_ACCEPTANCE,
    PRIOR_WEIGHT,
    DraftSource,
    DraftState,
    TokenHistory,
)
from agentbox.kernels import cpu_gemv

if TYPE_CHECKING:
    from agentbox.engine.request import Request

# The longest match looked for: past this, a longer match predicts no better (and the scan stops early).
MAX_MATCH = 32
# The drafting policy's defaults, when the config names none: (what a verified row costs over a decode step, the
# longest draft per matched token). CPU from `agentbox bench spec`'s verify_cost on SmolLM2 per kernel variant: the
# AVX2 build on a shared 2-core EPYC, 4 rows 1.5x a decode, 8 rows 2.5x, 16 rows 5.2x (0.3 a row); the AVX-512 VNNI
# build on a Xeon, 8 rows 1.5-1.8x, 16 rows 2.7-3.0x (0.1-0.2 a row: its Q8 LM head's rows share a pass). At 0.2
# a draft as long as its match (1.0) pays: the edit workload's answer in 77 steps and 195 verified rows against
# 87 and 193 at (0.3, 0.5), the tool call's in 17 against 24 (bench/results/spec/README.md). Variants not
# measured keep the EPYC's numbers. GPU decode is memory-bound, so rows up to 16 cost about as much as one. The
# avx512-amx build runs the VNNI kernels for up to 8 rows and its Q8_0 tiles from 9, so a verify costs it at most
# what it costs the VNNI build: the same policy.
CPU_POLICY = {cpu_gemv.Isa.AVX512_VNNI: (0.2, 1.0), cpu_gemv.Isa.AVX512_AMX: (0.2, 1.0)}
POLICY = {"cpu": (0.3, 0.5), "cuda": (0.02, 0.5)}
MAX_PAUSE_STEPS = 512
MAX_SESSIONS = 4096  # per-session counts kept for /v1/sessions (the session table holds at most 1024 by default)


def default_policy(device: str) -> tuple[float, float]:
    """(row cost, match factor) for a device: on CPU, the kernel variant's measured numbers where there are some."""
    if device == "cpu":
        isa = cpu_gemv.isa() if cpu_gemv.available() else None
        if isa in CPU_POLICY:
            return CPU_POLICY[isa]
    return POLICY[device]


def best_k(acceptance: float, row_cost: float, max_k: int) -> int:
    """The k maximising expected tokens per step cost, (1 + a + ... + a^k) / (1 + c k); 0 when none beats 1."""
    best, best_gain, tokens, p = 0, 1.0, 1.0, 1.0
    for k in range(1, max_k + 1):
        p *= acceptance
        tokens += p
        gain = tokens / (1 + row_cost * k)
        if gain > best_gain:
            best, best_gain = k, gain
    return best


def longest_match(hay: np.ndarray, limit: int, pattern: np.ndarray, max_len: int = MAX_MATCH) -> tuple[int, int]:
    """(end, length): the latest position `end < limit` of `hay` where the longest suffix of `pattern` (up to
    max_len tokens) ends, and that suffix's length; (-1, 0) when the last token of pattern is nowhere."""
    cand = np.flatnonzero(hay[:limit] == pattern[-1])
    if cand.size == 0:
        return -1, 0
    length = 1
    while length < min(max_len, pattern.size):
        prev = cand - length
        ok = prev >= 0
        keep = cand[ok][hay[prev[ok]] == pattern[-1 - length]]
        if keep.size == 0:
            break
        cand, length = keep, length + 1
    return int(cand[-1]), length


class GlobalHistory:
    """Recent outputs of every session, one array with -1 between outputs; the oldest half goes when full."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.tokens = TokenHistory(max(16, min(capacity, 4096)))

    def add(self, output: list[int]) -> None:
        if self.capacity <= 0 or not output:
            return
        output = output[-(self.capacity // 2) :]
        if self.tokens.n + len(output) + 1 > self.capacity:
            keep = self.tokens.view[self.tokens.n - self.capacity // 2 :].copy() if self.tokens.n else []
            self.tokens.n = 0
            self.tokens.extend(keep)
        self.tokens.extend([*output, -1])


class Drafter:
    """Proposes drafts for the scheduler and learns from their verification (engine/core.py)."""

    def __init__(self, config: EngineConfig, mtp: bool = False) -> None:
        spec = config.speculative
        self.mtp = mtp  # the runner drafts with the checkpoint's MTP head (auto or mtp, where there is one)
        self.text = spec is not Speculative.MTP  # drafts matched in the text (suffix, ngram; auto)
        self.mode = Speculative.SUFFIX if spec is Speculative.AUTO else spec
        self.mtp_tokens = config.spec_mtp_tokens
        self.max_draft = config.spec_max_draft
        self.min_match = config.spec_min_match
        row_cost, match_factor = default_policy("cuda" if config.resolved_device.startswith("cuda") else "cpu")
        self.row_cost = row_cost if config.spec_row_cost is None else config.spec_row_cost
        self.match_factor = match_factor if config.spec_match_factor is None else config.spec_match_factor
        self.recent = GlobalHistory(config.spec_global_tokens if self.mode is Speculative.SUFFIX else 0)
        self.by_session: dict[str, list[int]] = {}  # session -> [drafted, accepted], the newest MAX_SESSIONS
        # per source: [verify steps, drafted tokens, accepted tokens]
        self.by_source: dict[DraftSource, list[int]] = {src: [0, 0, 0] for src in self.sources}

    @property
    def sources(self) -> tuple[DraftSource, ...]:
        return (DraftSource.TEXT,) * self.text + (DraftSource.MTP,) * self.mtp

    def describe(self) -> str:
        """The mode as /v1/stats shows it: suffix, ngram, mtp, or suffix+mtp."""
        if not self.text:
            return Speculative.MTP.value
        return self.mode.value + ("+mtp" if self.mtp else "")

    @staticmethod
    def eligible(req: Request) -> bool:
        """Drafts are verified for greedy and unseeded sampled requests without penalties or logprobs (those
        would need each draft position's own counts), and for greedy ones under a grammar that is not closing
        (a closing grammar forces its tokens; exec/verify.py masks each draft position with the grammar). A
        seeded sampled request is not drafted: its draws would depend on the drafts, which depend on the
        batch and on other sessions, and a seed promises the same output whatever else runs."""
        s, gs = req.sampling, req.grammar_state
        return (
            (s.greedy or s.seed is None) and (gs is None or (s.greedy and gs.closing is None))
            and s.logprobs is None and s.repetition_penalty == 1.0 and not s.presence_penalty
            and not s.frequency_penalty
        )

    def offer(self, req: Request, tokens: list[int], after: int) -> None:
        """The MTP head's draft to follow the request's first `after` tokens (engine/exec/mtp.py)."""
        st = req.draft_state
        if st is None:
            st = req.draft_state = DraftState()
        st.mtp, st.mtp_after = tokens, after

    def propose(self, req: Request, limit: int) -> list[int]:
        """Up to min(k, limit) draft tokens to follow req's tokens, or none: the longer of the text match's and
        the MTP head's."""
        if limit <= 0 or not self.eligible(req):
            return []
        st = req.draft_state
        if st is None:
            st = req.draft_state = DraftState()
        head = st.mtp[: min(limit, self.mtp_tokens)] if self.mtp and st.mtp_after == req.num_tokens else []
        text = self._text(req, st, limit) if self.text else []
        st.source = DraftSource.MTP if len(head) > len(text) else DraftSource.TEXT
        return head if st.source is DraftSource.MTP else text

    def _text(self, req: Request, st: DraftState, limit: int) -> list[int]:
        st.steps += 1
        if st.steps < st.paused_until:
            return []
        k = min(best_k(st.acceptance, self.row_cost, self.max_draft), limit)
        if k == 0:  # no draft pays at this acceptance: pause, then start again from the prior
            st.paused_until, st.pause = st.steps + st.pause, min(2 * st.pause, MAX_PAUSE_STEPS)
            st.kept, st.refused = PRIOR_ACCEPTANCE * PRIOR_WEIGHT, (1 - PRIOR_ACCEPTANCE) * PRIOR_WEIGHT
            return []
        st.history.sync(req.all_token_ids)
        hist = st.history.view
        pattern = hist[-MAX_MATCH:]
        if self.mode is Speculative.NGRAM:
            end, n = longest_match(hist, hist.size - 1, pattern, self.min_match)
        else:
            end, n = longest_match(hist, hist.size - 1, pattern)
        if n >= self.min_match:  # a longer match predicts further: the draft grows with it
            return hist[end + 1 : end + 1 + self._length(k, n)].tolist()
        glob = self.recent.tokens.view
        if glob.size:
            end, n = longest_match(glob, glob.size - 1, pattern)
            if n >= self.min_match:
                cont = glob[end + 1 : end + 1 + self._length(k, n)]
                stop = np.flatnonzero(cont < 0)
                return (cont[: stop[0]] if stop.size else cont).tolist()
        return []

    def _length(self, k: int, matched: int) -> int:
        return max(1, min(k, int(self.match_factor * matched)))

    def observe(self, req: Request, drafted: int, accepted: int) -> None:
        """A verify's result: the request's acceptance follows it (the text drafts' own: an MTP draft's length
        does not follow it), and its source's counts."""
        st = req.draft_state
        if st is None or drafted == 0:
            return
        st.drafted += drafted
        st.accepted += accepted
        counts = self.by_source[st.source]
        counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + drafted, counts[2] + accepted
        if req.session_id is not None:
            per = self.by_session.pop(req.session_id, None) or [0, 0]
            per[0] += drafted
            per[1] += accepted
            self.by_session[req.session_id] = per  # re-inserted: the dict's order is recency
            if len(self.by_session) > MAX_SESSIONS:
                del self.by_session[next(iter(self.by_session))]
        if st.source is DraftSource.TEXT:
            st.kept = DECAY * st.kept + accepted
            st.refused = DECAY * st.refused + (accepted < drafted)

    def finished(self, req: Request) -> None:
        self.recent.add(req.output_token_ids)

    def forget(self) -> None:
        """Drops the recent outputs (a benchmark repeating a request would otherwise draft its last answer)."""
        self.recent = GlobalHistory(self.recent.capacity)
