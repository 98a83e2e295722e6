"""How `top` shows a figure: tokens (1.2k, 34k, 1.5M), a percentage, seconds (ms below one), bytes (K, M, G).
Any figure the server does not export (None, or not a number) shows as "–". `_n` reads a number or None; the
panels (panels.py) and the session table (session_table.py) share all of these."""

from __future__ import annotations

from typing import Any

DASH = "–"


def _n(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def fmt_tokens(v: Any) -> str:
    x = _n(v)
    if x is None:
        return DASH
    if abs(x) >= 1e6:
        return f"{x / 1e6:.1f}M"
    if abs(x) >= 1e4:
        return f"{x / 1e3:.0f}k"
    if abs(x) >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def fmt_pct(v: Any) -> str:
    x = _n(v)
    return DASH if x is None else f"{100 * x:.0f}%"


def fmt_secs(v: Any) -> str:
    x = _n(v)
    if x is None:
        return DASH
    return f"{x * 1000:.0f}ms" if x < 1 else f"{x:.1f}s"


def fmt_bytes(v: Any) -> str:
    x = _n(v)
    if x is None:
        return DASH
    if x < 2**20:  # a tiny model's state snapshot is a few KiB
        return f"{x / 2**10:.0f}K"
    return f"{x / 2**30:.1f}G" if x >= 2**30 else f"{x / 2**20:.0f}M"
