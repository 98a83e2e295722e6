"""Per-turn records of a replay and the run statistics computed from them (pure functions).

Recomputed history is the number this benchmark exists for. At turn k of a session, the history is what
the server had already computed for that session and turn k re-sends: turn k-1's prompt, as the server
reported it. (The replayer appends the *recorded* answer, not the model's, so the model's own output tokens
were computed but are never re-sent, and the recorded answer's tokens are new to the server: neither is
history.) What the server did not report as cached out of that history, it computed again. Summed over all
turns and divided by the summed history, that is the share of history recomputed (the published replay
study measured 51-55 % for LRU prefix caches under 24 concurrent agents). A page-granular cache still
misses the previous prompt's last partial page each turn (up to page_size - 1 tokens).
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TurnRecord:
    session: str
    turn: int
    start_s: float  # request sent, seconds since the run started
    ttft_s: float | None  # first generated text; None when nothing streamed
    latency_s: float  # request sent to stream finished
    prompt_tokens: int
    cached_tokens: int | None  # None: the server reported no cached-token count
    output_tokens: int
    error: str | None = None
    usage: bool = True  # False: the stream carried no usage; token counts are unknown (output: chunks seen)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class RunStats:
    name: str
    wall_s: float
    sessions: int
    turns: int
    errors: int
    turns_without_usage: int  # succeeded, but the server sent no usage (no token counts for them)
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    ttft_by_turn_s: list[float | None]  # median time to first token at each turn index
    prompt_tokens: int
    cached_tokens: int
    cache_reported: bool  # False: the server never reported cached tokens, so they count as recomputed
    history_tokens: int
    recomputed_tokens: int
    recomputed_share: float | None
    output_tokens: int
    output_tok_per_s: float
    prompt_tok_per_s: float
    extra: dict[str, Any] = field(default_factory=dict)
    # median latency (sent to stream finished) of each session's turns after its first: the warm turns whose
    # decode speculative decoding shortens (bench replay --compare-spec)
    later_latency_p50_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear interpolation between closest ranks; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile out of range: {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def history_accounting(records: list[TurnRecord]) -> tuple[int, int]:
    """(history tokens, recomputed history tokens) summed over every turn that has a previous turn.

    A turn counts only when it and its session's previous turn both succeeded with usage reported: other
    turns have no token counts to measure against.
    """
    by_key = {(r.session, r.turn): r for r in records}
    history = recomputed = 0
    for r in records:
        prev = by_key.get((r.session, r.turn - 1))
        if r.turn == 0 or prev is None or not (r.ok and prev.ok and r.usage and prev.usage):
            continue
        h = prev.prompt_tokens
        history += h
        recomputed += max(0, h - (r.cached_tokens or 0))
    return history, recomputed


def ttft_by_turn(records: list[TurnRecord]) -> list[float | None]:
    per_turn: dict[int, list[float]] = defaultdict(list)
    for r in records:
        if r.ok and r.ttft_s is not None:
            per_turn[r.turn].append(r.ttft_s)
    n = max((r.turn for r in records), default=-1) + 1
    return [statistics.median(per_turn[t]) if per_turn[t] else None for t in range(n)]


def summarize(name: str, records: list[TurnRecord], wall_s: float, **extra: Any) -> RunStats:
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    history, recomputed = history_accounting(records)
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    return RunStats(
        name=name,
        wall_s=wall_s,
        sessions=len({r.session for r in records}),
        turns=len(records),
        errors=len(records) - len(ok),
        turns_without_usage=sum(not r.usage for r in ok),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        ttft_p99_s=percentile(ttfts, 99),
        ttft_by_turn_s=ttft_by_turn(records),
        prompt_tokens=prompt,
        cached_tokens=sum(r.cached_tokens or 0 for r in ok),
        cache_reported=any(r.cached_tokens is not None for r in ok),
        history_tokens=history,
        recomputed_tokens=recomputed,
        recomputed_share=recomputed / history if history else None,
        output_tokens=output,
        output_tok_per_s=output / wall_s if wall_s > 0 else 0.0,
        prompt_tok_per_s=prompt / wall_s if wall_s > 0 else 0.0,
        extra=dict(extra),
        later_latency_p50_s=percentile([r.latency_s for r in ok if r.turn > 0], 50),
    )
