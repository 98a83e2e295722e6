"""The session table of `top`: its columns (which a terminal keeps when not all fit, which only some servers
fill), the rows it shows (filtered and sorted) and a session's turns (the detail screen). The dashboard
(app.py), the fleet view (fleet_view.py) and `top --once` (panels.py `once`) render it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from rich import box
from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from agentbox.tui.fmt import DASH, _n, fmt_bytes, fmt_pct, fmt_secs, fmt_tokens

_STATE_STYLE = {"generating": "bold green", "waiting": "yellow", "idle": "dim", "on disk": "cyan"}
_LEASE_STYLE = {"live": "green", "expired": "red", "none": "dim"}


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    value: Callable[[Mapping[str, Any]], Any]  # what it sorts by
    cell: Callable[[Mapping[str, Any]], Text | str]  # what it shows
    width: int  # columns its widest usual cell takes (title included): what fitting it to a terminal counts


def _lease(s: Mapping[str, Any]) -> Text:
    state = s.get("lease_state")
    left = _n(s.get("lease_expires_in_s"))
    label = (f"{left:.1f}s" if left < 10 else f"{left:.0f}s") if state == "live" and left is not None else (state or DASH)
    return Text(label, style=_LEASE_STYLE.get(state or "", ""))


def _state(s: Mapping[str, Any]) -> Text:
    state = s.get("state") or DASH
    if state == "idle" and (_n(s.get("on_disk_tokens")) or 0) > 0:
        state = "on disk"  # saved at the last stop, read back when it returns
    # The engine's `waiting_tool`: between turns with a live lease. A tool's result or a person's next message
    # is the same wait to the cache (a plain chat showed as "tool wait").
    state = "waiting" if state == "waiting_tool" else state
    return Text(state, style=_STATE_STYLE.get(state, ""))


def _hit(key: str) -> Callable[[Mapping[str, Any]], Text]:
    def cell(s: Mapping[str, Any]) -> Text:
        x = _n(s.get(key))
        style = "" if x is None else ("green" if x >= 0.8 else "yellow" if x >= 0.4 else "red")
        return Text(fmt_pct(x), style=style)

    return cell


def _num_value(key: str) -> Callable[[Mapping[str, Any]], Any]:
    return lambda s: _n(s.get(key)) if _n(s.get(key)) is not None else -1.0


SESSION_COLUMNS: tuple[Column, ...] = (
    Column("id", "session", lambda s: str(s.get("id", "")), lambda s: _clip(s.get("id"), 22), 22),
    Column("client", "client", lambda s: str(s.get("client") or ""), lambda s: _short_client(s.get("client")), 18),
    Column("turns", "turns", _num_value("turns"), lambda s: fmt_tokens(s.get("turns")), 5),
    Column("state", "state", lambda s: str(s.get("state") or ""), _state, 10),
    Column("resident_tokens_gpu", "GPU tok", _num_value("resident_tokens_gpu"),
           lambda s: fmt_tokens(s.get("resident_tokens_gpu")), 7),
    Column("resident_tokens_host", "host tok", _num_value("resident_tokens_host"),
           lambda s: fmt_tokens(s.get("resident_tokens_host")), 8),
    Column("snapshot_bytes", "snapshot", _num_value("snapshot_bytes"),
           lambda s: fmt_bytes(s.get("snapshot_bytes")) if s.get("snapshot_bytes") else DASH, 8),
    Column("lease_expires_in_s", "lease", _num_value("lease_expires_in_s"), _lease, 7),
    Column("last_turn_hit_rate", "hit last", _num_value("last_turn_hit_rate"), _hit("last_turn_hit_rate"), 8),
    Column("hit_rate", "hit life", _num_value("hit_rate"), _hit("hit_rate"), 8),
    Column("recomputed_history_tokens", "recomp", _num_value("recomputed_history_tokens"),
           lambda s: fmt_tokens(s.get("recomputed_history_tokens")), 6),
    Column("last_ttft_s", "TTFT", _num_value("last_ttft_s"), lambda s: fmt_secs(s.get("last_ttft_s")), 5),
    Column("spec_acceptance", "spec acc", lambda s: a if (a := _spec_acceptance(s)) is not None else -1.0,
           lambda s: _hit("spec_acceptance")({"spec_acceptance": _spec_acceptance(s)}), 8),
)
# Which columns a terminal keeps when not all fit, most wanted first; the table shows them in SESSION_COLUMNS'
# order. What tells a session's cache story (resident, hit, recomputed, time to first token) beats who it is.
FIT_ORDER = ("id", "state", "turns", "resident_tokens_gpu", "last_turn_hit_rate", "hit_rate",
             "recomputed_history_tokens", "last_ttft_s", "lease_expires_in_s", "client", "resident_tokens_host",
             "snapshot_bytes", "spec_acceptance")
# Columns that say something only on some servers: host tokens where a host-RAM tier exists (none on a CPU,
# whose pool is in RAM already), snapshots for models with recurrent state, acceptance where drafts ran.
OPTIONAL = frozenset({"resident_tokens_host", "snapshot_bytes", "spec_acceptance"})
CELL_PADDING = 2  # a table's cell padding, both sides together
# Below this many columns for the table, session ids clip shorter and the hit titles shorten.
NARROW_TABLE = 100
_NARROW_TITLES = {"last_turn_hit_rate": "hit", "hit_rate": "life"}


def _spec_acceptance(s: Mapping[str, Any]) -> float | None:
    """Speculative decoding: the share of the session's draft tokens the model accepted (none drafted: None)."""
    drafted = _n(s.get("spec_drafted_tokens"))
    return None if not drafted else (_n(s.get("spec_accepted_tokens")) or 0) / drafted


def device_label(device: Any) -> str:
    """Where the KV pool lives, from the engine's device ("cpu", "cuda:0"): the resident-tokens column's name.
    On a CPU the pool is in RAM: "KV" (a "CPU" column beside "host" read as two places for one)."""
    d = str(device or "")
    return "GPU" if d.startswith("cuda") else "KV"


def optional_columns(snap: Mapping[str, Any]) -> frozenset[str]:
    """The OPTIONAL columns this server has something for."""
    st = snap.get("stats") or {}
    cache, sessions = st.get("cache") or {}, snap.get("sessions") or []
    found = set()
    if _n(cache.get("host_total_pages", cache.get("host_capacity_pages"))):
        found.add("resident_tokens_host")
    if st.get("snapshots") or any(s.get("snapshot_bytes") for s in sessions):
        found.add("snapshot_bytes")
    if any(_n(s.get("spec_drafted_tokens")) for s in sessions):
        found.add("spec_acceptance")
    return frozenset(found)


def session_columns(device: Any = None, width: int | None = None, optional: frozenset[str] = OPTIONAL,
                    padding: int = CELL_PADDING) -> tuple[Column, ...]:
    """The table's columns: the resident-tokens one named by the real device, the optional ones this server
    has, and as many as fit `width` columns (None: all) at `padding` columns each besides their cells, in
    FIT_ORDER."""
    cols = {c.key: c for c in SESSION_COLUMNS if c.key not in OPTIONAL or c.key in optional}
    cols["resident_tokens_gpu"] = replace(cols["resident_tokens_gpu"], title=f"{device_label(device)} tok")
    if width is None:
        return tuple(cols[c.key] for c in SESSION_COLUMNS if c.key in cols)
    if width < NARROW_TABLE:
        cols["id"] = replace(cols["id"], cell=lambda s: _clip(s.get("id"), 12), width=12)
        for key, title in _NARROW_TITLES.items():
            cols[key] = replace(cols[key], title=title, width=4)
    kept, used = set(), 0
    for key in (k for k in FIT_ORDER if k in cols):
        need = cols[key].width + padding
        if used + need <= width:
            kept.add(key)
            used += need
    return tuple(cols[c.key] for c in SESSION_COLUMNS if c.key in kept)


def engine_device(snap: Mapping[str, Any]) -> Any:
    return ((snap.get("stats") or {}).get("engine") or {}).get("device")


def _short_client(ua: Any) -> str:
    """User-Agent's first product token ("claude-cli/1.0.3 (external, cli)" -> "claude-cli/1.0.3")."""
    if not ua:
        return DASH
    return _clip(str(ua).split(" ")[0], 18)


def _clip(v: Any, n: int) -> str:
    """Long ids (Claude Code's are UUIDs) keep their head and tail: both tell sessions apart."""
    s = DASH if v is None else str(v)
    return s if len(s) <= n else s[: n - 7] + "…" + s[-6:]


def select_sessions(sessions: Iterable[Mapping[str, Any]], sort: str = "id", reverse: bool = False,
                    filter_text: str = "") -> list[Mapping[str, Any]]:
    """The sessions the table shows: matching the filter (substring of id, client or state), sorted."""
    col = next((c for c in SESSION_COLUMNS if c.key == sort), SESSION_COLUMNS[0])
    needle = filter_text.lower().strip()
    rows = [s for s in sessions
            if not needle or any(needle in str(s.get(k) or "").lower() for k in ("id", "client", "state"))]
    return sorted(rows, key=col.value, reverse=reverse)


def sessions_table(sessions: list[dict[str, Any]] | None, sort: str = "id", device: Any = None,
                   width: int | None = None, optional: frozenset[str] = OPTIONAL) -> RenderableType:
    if sessions is None:
        return Text("sessions: – (this server has no /v1/sessions endpoint)", style="dim")
    narrow = width is not None and width < NARROW_TABLE
    table = Table(title="sessions", title_justify="left", expand=False, header_style="bold",
                  box=box.SIMPLE_HEAD if narrow else box.HEAVY_HEAD, collapse_padding=narrow, pad_edge=not narrow)
    # a heavy box's rule and padding take 3 columns per column (and one more at the edge); collapsed, 2
    columns = session_columns(device, width if width is None or narrow else width - 1, optional, 2 if narrow else 3)
    for c in columns:  # the client gives way first: the numbers stay whole
        table.add_column(c.title, justify="left" if c.key in ("id", "client", "state") else "right",
                         no_wrap=c.key != "client", overflow="ellipsis")
    for s in select_sessions(sessions, sort):
        table.add_row(*(c.cell(s) for c in columns))
    if not sessions:
        table.caption = "no sessions yet"
    return table


def turns_table(detail: Mapping[str, Any]) -> Table:
    table = Table(title=f"session {detail.get('id', DASH)}: turns", title_justify="left", header_style="bold")
    for title in ("turn", "prompt tok", "cached tok", "hit", "TTFT", "completion tok"):
        table.add_column(title, justify="right")
    for t in detail.get("turn_history") or []:
        prompt, cached = _n(t.get("prompt_tokens")), _n(t.get("cached_tokens"))
        hit = cached / prompt if prompt and cached is not None else None
        table.add_row(str(t.get("turn", DASH)), fmt_tokens(prompt), fmt_tokens(cached), _hit("h")({"h": hit}),
                      fmt_secs(t.get("ttft_s")), fmt_tokens(t.get("completion_tokens")))
    return table
