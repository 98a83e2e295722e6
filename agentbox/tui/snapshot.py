"""One poll of everything `top` shows, as a plain dict: the server's stats and sessions (HTTP), rates from the
previous poll, and — when the server runs here — its process tree and the GPUs.

`Poller` is what the dashboard calls every interval; `snapshot(url)` is one poll for scripts (`top --once`)
and for `agentbox status`; `render_summary(snapshot)` is its few-line text form."""

from __future__ import annotations

import time
from typing import Any

from agentbox.tui.client import Api, ServerDown, ServerSlow
from agentbox.tui.machine import GpuProbe, ProcessProbe, local_server_pid
from agentbox.tui.rates import Rates, lifetime_hit_rate

START_HINT = "agentbox serve"


class Poller:
    def __init__(self, url: str, api_key: str | None = None, gpus: GpuProbe | None = None) -> None:
        self.url = url.rstrip("/")
        self.api = Api(self.url, api_key=api_key)
        self.rates = Rates()
        self.procs = ProcessProbe()
        self._gpus = gpus
        self.last: dict[str, Any] | None = None  # the last snapshot of a server that answered

    @property
    def gpus(self) -> GpuProbe:
        if self._gpus is None:  # nvmlInit takes a moment: only when a local server is seen
            self._gpus = GpuProbe()
        return self._gpus

    def poll(self) -> dict[str, Any]:
        t = time.time()
        snap: dict[str, Any] = {"url": self.url, "time": t, "up": False, "error": None, "stats": None,
                                "sessions": None, "rates": dict(self.rates.current), "local": None, "stale": None}
        try:
            stats = self.api.stats()
        except ServerSlow as exc:
            if self.last is None:
                snap["error"] = str(exc)
                return snap
            # Busy, not gone: keep showing the last figures, marked stale; the rates keep their baseline.
            return {**self.last, "time": t, "stale": f"server slow to answer ({exc})"}
        except ServerDown as exc:
            self.rates.reset()
            self.last = None
            snap["error"] = str(exc)
            return snap
        try:
            sessions = self.api.sessions()
        except Exception as exc:  # slow or failing sessions endpoint: the last list, marked stale
            sessions = (self.last or {}).get("sessions")
            snap["stale"] = f"/v1/sessions: {type(exc).__name__}: {exc}"
        snap.update(up=True, stats=stats, sessions=sessions, rates=self.rates.update(t, stats, sessions))
        snap["lifetime_hit_rate"] = lifetime_hit_rate(stats)
        pid = local_server_pid(self.url, stats)
        if pid is not None:
            snap["local"] = {
                "pid": pid,
                "process": self.procs.sample(pid),
                "gpus": self.gpus.sample() if self.gpus.available else None,
                "gpu_error": None if self.gpus.available else (self.gpus.error or "no GPU"),
            }
        self.last = snap
        return snap

    def close(self) -> None:
        self.api.close()
        if self._gpus is not None:
            self._gpus.close()


def snapshot(url: str, api_key: str | None = None, sample_s: float = 0.5) -> dict[str, Any]:
    """One snapshot for scripts. Polls twice `sample_s` apart so CPU % and the rates cover a real interval."""
    poller = Poller(url, api_key=api_key)
    try:
        first = poller.poll()
        if not first["up"] or sample_s <= 0:
            return _jsonable(first)
        time.sleep(sample_s)
        return _jsonable(poller.poll())
    finally:
        poller.close()


def _jsonable(snap: dict[str, Any]) -> dict[str, Any]:
    snap = dict(snap)
    snap["start_hint"] = None if snap["up"] else START_HINT
    return snap


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.1f} %"


def render_summary(snap: dict[str, Any]) -> str:
    """A few plain lines: what is served, the sessions, the cache and the server's own CPU use."""
    if not snap.get("up"):
        return f"agentbox top: no server at {snap.get('url')} ({snap.get('error')}).  Start it:   {START_HINT}"
    st = snap["stats"] or {}
    eng = st.get("engine") or {}
    pool = st.get("pool") or {}
    cache = st.get("cache") or {}
    sessions = snap.get("sessions")
    lines = [
        f"{st.get('model', '–')} on {eng.get('device', '–')} ({eng.get('dtype', '–')}, "
        f"{eng.get('attention_backend', '–')}, TP {eng.get('tensor_parallel_size', 1)}) at {snap['url']}, "
        f"up {fmt_duration(st.get('server_uptime_s'))}",
        f"requests: {st.get('running', '–')} running, {st.get('waiting', '–')} waiting, "
        f"{_queued(st)} queued for admission",
    ]
    if sessions is None:
        lines.append("sessions: – (this server has no /v1/sessions)")
    else:
        states: dict[str, int] = {}
        for s in sessions:
            states[s.get("state", "?")] = states.get(s.get("state", "?"), 0) + 1
        detail = ", ".join(f"{n} {k}" for k, n in sorted(states.items()))
        lines.append(f"sessions: {len(sessions)}" + (f" ({detail})" if detail else ""))
    total = pool.get("total_pages")
    lines.append(
        f"KV pool: {pool.get('used_pages', '–')}/{total if total is not None else '–'} pages used, "
        f"{cache.get('leased_pages', '–')} leased, {cache.get('gpu_pages', '–')} cached; "
        f"host tier {cache.get('host_pages', '–')} pages"
    )
    lines.append(f"prefix hit rate: {_pct(snap.get('lifetime_hit_rate'))} lifetime, "
                 f"{_pct((snap.get('rates') or {}).get('hit_rate'))} last interval")
    proc = (snap.get("local") or {}).get("process")
    if proc:
        lines.append(f"server process tree: {proc['cpu_percent']:.1f} % CPU, {proc['rss_bytes'] / 2**30:.2f} GiB, "
                     f"{proc['processes']} processes")
    return "\n".join(lines)


def fmt_duration(seconds: float | None) -> str:
    if not isinstance(seconds, (int, float)):
        return "–"
    s = int(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _queued(stats: dict[str, Any]) -> Any:
    adm = stats.get("admission") or {}
    return adm.get("queued", adm.get("queued_new_sessions", "–"))
