"""Rich renderables of a snapshot: the dashboard's panels and `top --once`'s tables are the same functions.
Any figure the server does not export shows as "–"."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from agentbox.tui.rates import sparkline
from agentbox.tui.snapshot import START_HINT, fmt_duration

DASH = "–"
# The server's own CPU while no request runs: above this it is burning a core doing nothing (DESIGN.md).
IDLE_CPU_ALARM_PERCENT = 3.0
SPARK_WIDTH = 26


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


# ---- the session table ----

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


# ---- header, gauges, rates, machine ----


def header(snap: Mapping[str, Any], paused: bool = False, width: int | None = None) -> Text:
    """One line: what runs where. Past `width` columns the least needed parts go first (attention backend and
    TP, then the device, then the URL), so the line never wraps under a narrow terminal."""
    st = snap.get("stats") or {}
    eng = st.get("engine") or {}
    parts: list[tuple[int, str, str]] = [  # (keep rank: lower stays longer, text, style)
        (0, " agentbox top ", "bold reverse"),
        (1, f"  {st.get('model') or eng.get('model_name') or DASH}", "bold"),
        (4, f"  {eng.get('device', DASH)}/{eng.get('dtype', DASH)}", ""),
        (5, f"  attn {eng.get('attention_backend', DASH)}  TP {eng.get('tensor_parallel_size', DASH)}", ""),
        (2, f"  up {fmt_duration(st.get('server_uptime_s', st.get('uptime_s')))}", ""),
        (3, f"  {snap.get('url', DASH)}", "cyan"),
    ]
    if snap.get("stale"):
        parts.append((0, f"  stale: {snap['stale']}", "bold yellow"))
    if paused:
        parts.append((0, "  PAUSED", "bold yellow"))
    while width is not None and sum(len(text) for _, text, _ in parts) > width and max(r for r, _, _ in parts) > 1:
        worst = max(r for r, _, _ in parts)
        parts = [p for p in parts if p[0] != worst]
    t = Text()
    for _, text, style in parts:
        t.append(text, style=style)
    return t


def down_message(snap: Mapping[str, Any], interval: float | None = None) -> Text:
    t = Text()
    t.append(f"No agentbox server answers at {snap.get('url')}.\n", style="bold red")
    t.append(f"({snap.get('error')})\n\n", style="dim")
    t.append("Start it:   ")
    t.append(START_HINT, style="bold")
    if interval is not None:
        t.append(f"\n\nRetrying every {interval:g} s; this view reconnects by itself.", style="dim")
    return t


def _gauge(parts: list[tuple[str, float | None, str]], total: float | None, width: int) -> Text:
    """A bar of `width` cells split among the parts in proportion, then a legend with the counts."""
    t = Text()
    if not total:
        t.append("─" * width, style="dim")
    else:
        used = 0
        for name, v, style in parts:
            if name == "free":  # the unfilled rest of the bar
                continue
            cells = round((v or 0) / total * width)
            cells = min(cells, width - used)
            t.append("█" * cells, style=style)
            used += cells
        t.append("·" * (width - used), style="grey37")
    t.append("\n")
    for name, v, style in parts:
        t.append("■ ", style=style)
        t.append(f"{name} {fmt_tokens(v)}  ")
    return t


def pool_panel(snap: Mapping[str, Any], width: int = 40) -> Group:
    st = snap.get("stats") or {}
    pool = st.get("pool") or {}
    cache = st.get("cache") or {}
    total, free, used = _n(pool.get("total_pages")), _n(pool.get("free_pages")), _n(pool.get("used_pages"))
    tree, leased = _n(cache.get("gpu_pages")), _n(cache.get("leased_pages"))
    # A partition of the pool: the tree owns `gpu_pages` (leased ⊂ them); running requests alone hold the
    # rest of the used pages (pages a request shares with the tree count as leased / cached).
    in_use = max(0.0, used - tree) if used is not None and tree is not None else used
    cached = max(0.0, tree - leased) if tree is not None and leased is not None else tree
    ps = pool.get("page_size")
    title = Text(f"KV pool (pages of {ps if ps is not None else DASH} tokens, {fmt_tokens(total)} total)",
                 style="bold")
    gpu = _gauge([("in use", in_use, "magenta"), ("leased", leased, "green"), ("cached", cached, "blue"),
                  ("free", free, "grey50")], total, width)
    host_total = _n(cache.get("host_total_pages", cache.get("host_capacity_pages")))
    host = _n(cache.get("host_pages"))
    host_title = Text(f"host tier ({fmt_tokens(host_total)} pages)", style="bold")
    host_free = max(0.0, host_total - host) if host_total is not None and host is not None else None
    host_g = _gauge([("held", host, "cyan"), ("free", host_free, "grey50")], host_total, width)
    moves = Text(f"evictions {fmt_tokens(cache.get('evictions'))}  demotions {fmt_tokens(cache.get('demotions'))}  "
                 f"promotions {fmt_tokens(cache.get('promotions'))}", style="dim")
    if _n(cache.get("disk_budget_bytes")):
        moves.append(f"\non disk {fmt_tokens(cache.get('disk_pages'))} pages "
                     f"({(_n(cache.get('disk_bytes')) or 0) / 2**30:.1f} of {(_n(cache.get('disk_budget_bytes')) or 0) / 2**30:.1f} GiB)"
                     f"  read back {fmt_tokens(cache.get('disk_restored'))}  torn {cache.get('disk_torn', 0)}")
    snaps = st.get("snapshots")
    if not snaps:
        return Group(title, gpu, host_title, host_g, moves)
    # hybrid models: the recurrent-state snapshots beside the pool (a fixed set of slots, one state each)
    held = Text(f"state snapshots {snaps.get('count', DASH)} of {snaps.get('capacity', DASH)}, "
                f"{fmt_bytes(snaps.get('used_bytes'))} of {fmt_bytes(snaps.get('capacity_bytes'))}  "
                f"hits {fmt_tokens(snaps.get('hits'))}  dropped {fmt_tokens(snaps.get('dropped'))}")
    if snaps.get("host_capacity"):  # a full device store demotes to host RAM (engine/cache/state_snapshots.py)
        held.append(f"  host {snaps.get('host_count', 0)} of {snaps['host_capacity']}, "
                    f"demoted {fmt_tokens(snaps.get('demoted'))}  promoted {fmt_tokens(snaps.get('promoted'))}")
    return Group(title, gpu, host_title, host_g, moves, held)


def _series(label: str, now: str, values: Iterable[float | None], top: float | None, style: str) -> Text:
    t = Text()
    t.append(f"{label:<16}", style="bold")
    t.append(f"{now:>9} ")
    t.append(sparkline(list(values), SPARK_WIDTH, top), style=style)
    return t


def _latest(values: Iterable[float | None], now: float | None) -> float | None:
    if now is not None:
        return now
    return next((v for v in reversed(list(values)) if v is not None), None)


def rates_panel(snap: Mapping[str, Any], history: Mapping[str, Iterable[float | None]]) -> Group:
    r = snap.get("rates") or {}
    life = snap.get("lifetime_hit_rate")
    # A ratio exists only for polls in which prompts finished: show the latest one there was.
    hit = _latest(history.get("hit_rate", ()), r.get("hit_rate"))
    rec = _latest(history.get("recompute_ratio", ()), r.get("recompute_ratio"))
    return Group(
        _series("hit rate", fmt_pct(hit), history.get("hit_rate", ()), 1.0, "green"),
        Text(f"{'':<16}{'lifetime ' + fmt_pct(life):>9}", style="dim"),
        _series("recompute ratio", fmt_pct(rec), history.get("recompute_ratio", ()), 1.0, "red"),
        _series("prefill tok/s", fmt_tokens(r.get("prefill_tps")), history.get("prefill_tps", ()), None, "magenta"),
        _series("decode tok/s", fmt_tokens(r.get("decode_tps")), history.get("decode_tps", ()), None, "cyan"),
    )


def drafters_line(stats: Mapping[str, Any]) -> Text | None:
    """Accepted draft tokens per verify step of each draft source that has verified any (/v1/stats
    speculative.drafters: the text match `suffix`, the model's MTP head `mtp`); None when none has."""
    drafters = (stats.get("speculative") or {}).get("drafters") or {}
    used = [(name, d) for name, d in drafters.items() if d.get("steps")]
    if not used:
        return None
    return Text("drafts " + ", ".join(f"{name} {d.get('accepted_per_step', 0):.2f} accepted/step ({d['steps']} steps)"
                                      for name, d in used))


def experts_line(ex: Mapping[str, Any]) -> Text | None:
    """Where a MoE model's routed experts live (`serve --cpu-moe / --n-cpu-moe`) and what the host's share of a
    step costs, from /v1/stats `experts`; None for a dense model."""
    moe = ex.get("moe_layers")
    if not moe:
        return None
    device = "the GPU" if str(ex.get("device") or "").startswith("cuda") else "the CPU"
    host = ex.get("host_layers") or 0
    if not host:
        return Text(f"experts of all {moe} MoE layers on {device}", style="dim")
    t = Text(f"experts of {host} of {moe} MoE layers in host RAM ({fmt_bytes(ex.get('host_bytes'))}), the rest on "
             f"{device}")
    if ex.get("steps"):
        t.append(f"\nCPU experts {ex.get('cpu_expert_ms_per_step', 0):.1f} ms a step, "
                 f"{fmt_pct(ex.get('cpu_expert_share'))} of it (last {ex.get('last_cpu_expert_ms', 0):.1f} of "
                 f"{ex.get('last_step_ms', 0):.1f} ms)")
    return t


def machine_panel(snap: Mapping[str, Any]) -> Group:
    st = snap.get("stats") or {}
    local = snap.get("local")
    lines: list[RenderableType] = []
    adm = st.get("admission") or {}
    queued = adm.get("queued", adm.get("queued_new_sessions", DASH))
    lines.append(Text(f"requests {st.get('running', DASH)} running, {st.get('waiting', DASH)} waiting"))
    lines.append(Text(f"admission queue {queued}, {adm.get('timeouts', DASH)} timed out"))
    if (drafts := drafters_line(st)) is not None:
        lines.append(drafts)
    if (experts := experts_line(st.get("experts") or {})) is not None:
        lines.append(experts)
    if local is None:
        lines.append(Text("server is not on this machine: no process or GPU figures", style="dim"))
        return Group(*lines)
    proc = local.get("process")
    if proc:
        cpu = proc["cpu_percent"]
        idle_burn = st.get("running") == 0 and cpu > IDLE_CPU_ALARM_PERCENT
        t = Text("server CPU ")
        t.append(f"{cpu:5.1f} %", style="bold red" if idle_burn else "green")
        t.append(f"  mem {fmt_bytes(proc['rss_bytes'])}  {proc['processes']} procs (pid {proc['pid']})")
        if idle_burn:
            t.append("  busy while idle!", style="bold red")
        lines.append(t)
    gpus = local.get("gpus")
    if not gpus:
        lines.append(Text(f"no GPU ({local.get('gpu_error') or 'none found'})", style="dim"))
    for g in gpus or []:
        mem_u, mem_t = g.get("memory_used_bytes"), g.get("memory_total_bytes")
        power, temp, util = _n(g.get("power_w")), _n(g.get("temperature_c")), _n(g.get("util_percent"))
        lines.append(Text(
            f"GPU{g['index']} {str(g.get('name') or '')[:22]:<22} util {DASH if util is None else f'{util:3.0f}'} %  "
            f"mem {fmt_bytes(mem_u)}/{fmt_bytes(mem_t)}  {DASH if power is None else f'{power:.0f}'} W  "
            f"{DASH if temp is None else f'{temp:.0f}'} °C"
        ))
    return Group(*lines)


def once(snap: Mapping[str, Any], history: Mapping[str, Iterable[float | None]] | None = None,
         width: int | None = None) -> RenderableType:
    """The whole snapshot for `top --once` (no sparkline history: one rate from two polls), for a terminal
    `width` columns wide (None: as wide as it needs)."""
    if not snap.get("up"):
        return down_message(snap)
    hist = history or {k: [v] for k, v in (snap.get("rates") or {}).items()}
    sessions = sessions_table(snap.get("sessions"), device=engine_device(snap), width=width,
                              optional=optional_columns(snap))
    return Group(header(snap, width=width), Text(""), sessions, Text(""), pool_panel(snap),
                 Text(""), rates_panel(snap, hist), Text(""), machine_panel(snap))
