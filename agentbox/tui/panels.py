"""Rich renderables of a snapshot: the dashboard's panels and `top --once`'s tables are the same functions
(the session table's are session_table.py's). Any figure the server does not export shows as "–" (fmt.py)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Group, RenderableType
from rich.text import Text

from agentbox.tui.fmt import DASH, _n, fmt_bytes, fmt_pct, fmt_tokens
from agentbox.tui.rates import sparkline
from agentbox.tui.session_table import engine_device, optional_columns, sessions_table
from agentbox.tui.snapshot import START_HINT, fmt_duration

# The server's own CPU while no request runs: above this it is burning a core doing nothing (DESIGN.md).
IDLE_CPU_ALARM_PERCENT = 3.0
SPARK_WIDTH = 26


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
