"""Rates from counter deltas between two polls, and their recent history for the sparklines.

The server exports monotonic counters, not rates: a rate is Δcounter / Δt (or / Δanother counter) between
consecutive polls. Hit rate = Δcached_tokens / Δprompt_tokens; recompute ratio = Δrecomputed history tokens
/ Δhistory tokens the sessions re-sent (Δprompt_tokens on a server that does not export history_tokens). A poll with no new prompt tokens has no hit rate (None), not 0 %: an idle box is not
missing its cache."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

HISTORY = 120  # samples kept per series (two minutes at the default interval)
SERIES = ("hit_rate", "recompute_ratio", "prefill_tps", "decode_tps")
_BLOCKS = "▁▂▃▄▅▆▇█"


def _num(d: dict[str, Any] | None, key: str) -> float | None:
    v = (d or {}).get(key)
    return float(v) if isinstance(v, (int, float)) else None


def counter_totals(stats: dict[str, Any], sessions: list[dict[str, Any]] | None) -> dict[str, float | None]:
    """The monotonic totals the rates are derived from, with fallbacks for servers that export less."""
    c = stats.get("counters") or {}
    generated = _num(c, "generated_tokens")
    computed = _num(c, "computed_tokens")
    prefill = _num(c, "prefill_tokens")
    if prefill is None and computed is not None and generated is not None:
        prefill = computed - generated  # every computed token that was not a sampled one
    recomputed = _num(c, "recomputed_history_tokens")
    if recomputed is None and sessions is not None:
        recomputed = float(sum(s.get("recomputed_history_tokens") or 0 for s in sessions))
    # History re-sent by sessions (the denominator of the recompute ratio); prompt tokens when not exported.
    history = None
    if sessions is not None and sessions and all("history_tokens" in s for s in sessions):
        history = float(sum(s.get("history_tokens") or 0 for s in sessions))
    decode = _num(c, "decode_tokens")
    return {
        "prompt": _num(c, "prompt_tokens"),
        "cached": _num(c, "cached_tokens"),
        "recomputed": recomputed,
        "history": history,
        "prefill": prefill,
        "decode": decode if decode is not None else generated,
    }


def _delta(new: float | None, old: float | None) -> float | None:
    if new is None or old is None:
        return None
    return max(0.0, new - old)  # a restarted server or a closed session's counters must not go negative


@dataclass
class Rates:
    """Feed it every poll; it keeps the previous totals and the history of each rate."""

    history: dict[str, deque[float | None]] = field(
        default_factory=lambda: {k: deque(maxlen=HISTORY) for k in SERIES}
    )
    _last: dict[str, float | None] | None = None
    _last_t: float | None = None
    current: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(SERIES))

    def update(self, t: float, stats: dict[str, Any], sessions: list[dict[str, Any]] | None) -> dict[str, float | None]:
        totals = counter_totals(stats, sessions)
        cur: dict[str, float | None] = dict.fromkeys(SERIES)
        if self._last is not None and self._last_t is not None and t > self._last_t:
            dt = t - self._last_t
            d = {k: _delta(totals[k], self._last[k]) for k in totals}
            if d["prompt"]:
                if d["cached"] is not None:
                    cur["hit_rate"] = min(1.0, d["cached"] / d["prompt"])
            base = d["history"] if d["history"] is not None else d["prompt"]
            if d["recomputed"] is not None and base:
                cur["recompute_ratio"] = min(1.0, d["recomputed"] / base)
            if d["prefill"] is not None:
                cur["prefill_tps"] = d["prefill"] / dt
            if d["decode"] is not None:
                cur["decode_tps"] = d["decode"] / dt
            for k in SERIES:
                self.history[k].append(cur[k])
        self._last, self._last_t = totals, t
        self.current = cur
        return cur

    def reset(self) -> None:
        """The server went away: the next poll starts a fresh baseline (its counters may restart at 0)."""
        self._last = self._last_t = None
        self.current = dict.fromkeys(SERIES)


def lifetime_hit_rate(stats: dict[str, Any] | None) -> float | None:
    c = (stats or {}).get("counters") or {}
    prompt, cached = c.get("prompt_tokens"), c.get("cached_tokens")
    if not prompt or cached is None:
        return None
    return cached / prompt


def sparkline(values: list[float | None] | deque[float | None], width: int, top: float | None = None) -> str:
    """The last `width` values as block characters scaled to `top` (default: their max); None is a gap."""
    vals = list(values)[-width:]
    known = [v for v in vals if v is not None]
    hi = top if top is not None else (max(known) if known else 0.0)
    out = []
    for v in vals:
        if v is None:
            out.append(" ")
        elif hi <= 0:
            out.append(_BLOCKS[0])
        else:
            out.append(_BLOCKS[min(len(_BLOCKS) - 1, max(0, round(v / hi * (len(_BLOCKS) - 1))))])
    return "".join(out).rjust(width)
