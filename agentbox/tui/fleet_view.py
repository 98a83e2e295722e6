"""`agentbox top --url A --url B`, or `--url` of a fleet's router: every backend in one view, each with its
sessions, KV residency and its process tree's CPU (idle CPU included), read-only. A router URL is expanded
into its backends through the router's own worker list (GET /workers), and its health verdict per backend
is shown beside each. One Poller per backend, so the rates are each backend's own."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rich.console import Group, RenderableType
from rich.rule import Rule
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.widgets import Footer, Static

from agentbox import fleet
from agentbox.tui import panels, session_table
from agentbox.tui.snapshot import Poller, snapshot


def expand(urls: list[str]) -> tuple[list[str], dict[str, bool]]:
    """(backend URLs, the routers' health verdict per backend URL): router URLs replaced by their backends."""
    backends: list[str] = []
    health: dict[str, bool] = {}
    for url in urls:
        listed = fleet.workers(url)
        if listed is None:
            backends.append(fleet.root_url(url))
            continue
        for w in listed:
            backends.append(fleet.root_url(str(w["url"])))
            health[backends[-1]] = bool(w.get("is_healthy"))
    return list(dict.fromkeys(backends)), health


def is_fleet(urls: list[str]) -> bool:
    return len(urls) > 1 or (len(urls) == 1 and fleet.workers(urls[0]) is not None)


def backend_view(snap: dict[str, Any], healthy: bool | None) -> RenderableType:
    verdict = "" if healthy is None else ("  router: healthy" if healthy else "  router: UNHEALTHY (out of rotation)")
    title = Rule(f"{snap.get('url')}{verdict}", style="green" if snap.get("up") and healthy is not False else "red")
    if not snap.get("up"):
        return Group(title, panels.down_message(snap))
    hist = {k: [v] for k, v in (snap.get("rates") or {}).items()}
    return Group(title, panels.header(snap), session_table.sessions_table(snap.get("sessions")),
                 panels.pool_panel(snap), panels.rates_panel(snap, hist), panels.machine_panel(snap))


def fleet_once(urls: list[str], api_key: str | None = None) -> tuple[list[dict[str, Any]], RenderableType]:
    """One snapshot per backend (polled at the same time) and their stacked view, for `top --once`."""
    backends, health = expand(urls)
    with ThreadPoolExecutor(max(1, len(backends))) as pool:
        snaps = list(pool.map(lambda u: snapshot(u, api_key=api_key), backends))
    for s in snaps:
        s["router_healthy"] = health.get(s["url"])
    up = sum(1 for s in snaps if s["up"])
    head = Text(f"fleet: {len(backends)} backends, {up} up, "
                f"{sum(len(s.get('sessions') or []) for s in snaps)} sessions", style="bold")
    return snaps, Group(head, *(backend_view(s, health.get(s["url"])) for s in snaps))


class FleetApp(App[None]):
    """The live form: the same stacked view, refreshed every interval."""

    BINDINGS = [Binding("q", "quit", "quit")]

    def __init__(self, urls: list[str], interval: float, api_key: str | None = None) -> None:
        super().__init__()
        self.urls, self.interval = urls, max(0.5, interval)
        backends, self.health = expand(urls)
        self.pollers = [Poller(u, api_key=api_key) for u in backends]
        self.polls = 0

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(id="fleet")
        yield Footer()

    def on_mount(self) -> None:
        self.set_interval(self.interval, self.poll)
        self.poll()

    def poll(self) -> None:
        self.run_worker(self._poll_thread, thread=True, group="poll", exclusive=True, exit_on_error=False)

    def _poll_thread(self) -> None:
        snaps = [p.poll() for p in self.pollers]
        _, self.health = expand(self.urls)  # the router's verdicts change: read them every poll
        view = Group(*(backend_view(s, self.health.get(s["url"])) for s in snaps))
        try:
            self.call_from_thread(self._show, view)
        except RuntimeError:  # shutting down
            pass

    def _show(self, view: RenderableType) -> None:
        self.polls += 1
        self.query_one("#fleet", Static).update(view)

    def on_unmount(self) -> None:
        for p in self.pollers:
            p.close()
