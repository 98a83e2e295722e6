"""`agentbox top`: Textual Pilot tests against the live agentbox (tests/conftest.py `live_server`) while a real
client runs two sessions, plus the pure pieces (rates from counter deltas, sparklines, the idle-CPU rule)."""

from __future__ import annotations

import asyncio
import html
import json
import re
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from agentbox.tui import panels, session_table
from agentbox.tui.app import ConfirmScreen, DetailScreen, TopApp
from agentbox.tui.rates import Rates, sparkline
from agentbox.tui.snapshot import render_summary, snapshot

SIZE = (180, 48)


# ---- pure pieces ----


def _stats(prompt: int, cached: int, computed: int, generated: int, recomputed: int = 0) -> dict[str, Any]:
    return {"counters": {"prompt_tokens": prompt, "cached_tokens": cached, "computed_tokens": computed,
                         "generated_tokens": generated, "recomputed_history_tokens": recomputed}}


def test_rates_from_counter_deltas() -> None:
    r = Rates()
    assert r.update(10.0, _stats(100, 0, 110, 10), None)["hit_rate"] is None  # no baseline yet
    cur = r.update(12.0, _stats(300, 150, 170, 20, recomputed=50), None)
    assert cur["hit_rate"] == pytest.approx(150 / 200)
    assert cur["recompute_ratio"] == pytest.approx(50 / 200)
    assert cur["prefill_tps"] == pytest.approx(((170 - 20) - (110 - 10)) / 2.0)
    assert cur["decode_tps"] == pytest.approx(10 / 2.0)
    idle = r.update(13.0, _stats(300, 150, 170, 20, recomputed=50), None)
    assert idle["hit_rate"] is None and idle["decode_tps"] == 0.0  # no prompts: no hit rate, not 0 %
    assert list(r.history["hit_rate"]) == [0.75, None]
    # A restarted server's counters fall back to 0: after reset() the next poll is a new baseline.
    r.reset()
    assert r.update(14.0, _stats(5, 0, 6, 1), None)["hit_rate"] is None


def test_sparkline_scales_and_gaps() -> None:
    assert sparkline([0.0, 0.5, 1.0], 3, top=1.0) == "▁▅█"
    assert sparkline([None, 2.0], 4) == "   █"
    assert sparkline([], 3) == "   "


def test_idle_cpu_alarm_only_when_no_request_runs() -> None:
    def line(running: int, cpu: float) -> str:
        snap = {"stats": {"running": running},
                "local": {"process": {"pid": 1, "processes": 2, "cpu_percent": cpu, "rss_bytes": 2**30},
                          "gpus": None, "gpu_error": "no GPU"}}
        return "\n".join(t.plain for t in panels.machine_panel(snap).renderables)  # type: ignore[union-attr]

    assert "busy while idle" in line(0, 12.0)
    assert "busy while idle" not in line(0, 1.0)
    assert "busy while idle" not in line(3, 95.0)
    assert "no GPU" in line(0, 1.0)


def test_columns_fit_the_width_most_wanted_first_and_say_where_the_kv_lives() -> None:
    keys = lambda cols: [c.key for c in cols]  # noqa: E731
    cpu = session_table.session_columns("cpu", None, frozenset())
    titles = [c.title for c in cpu]
    assert "KV tok" in titles and "host tok" not in titles and "snapshot" not in titles  # no host tier on CPU
    assert len(titles) == len(set(titles))  # `--once` had two columns titled "state"
    gpu = session_table.session_columns("cuda:0", None)
    assert {"GPU tok", "host tok", "snapshot", "spec acc"} <= {c.title for c in gpu}
    # 80 columns: the cache story (resident, hit, recomputed, TTFT) and the lease; the client gives way
    narrow = session_table.session_columns("cpu", 78, frozenset())
    assert keys(narrow) == ["id", "turns", "state", "resident_tokens_gpu", "lease_expires_in_s",
                            "last_turn_hit_rate", "hit_rate", "recomputed_history_tokens", "last_ttft_s"]
    assert sum(c.width + session_table.CELL_PADDING for c in narrow) <= 78
    wide = session_table.session_columns("cpu", 118, frozenset())
    assert keys(wide) == [c.key for c in session_table.SESSION_COLUMNS if c.key not in session_table.OPTIONAL]
    # the state the engine calls waiting_tool: the wait for the client's next turn, a tool's or a person's
    assert session_table.session_columns()[3].cell({"state": "waiting_tool"}).plain == "waiting"


def test_the_header_drops_what_is_least_needed_to_stay_one_line() -> None:
    snap = {"url": "http://127.0.0.1:8000", "stats": {"model": "SmolLM2-135M-Instruct.Q4_1", "server_uptime_s": 7,
            "engine": {"device": "cpu", "dtype": "float32", "attention_backend": "torch", "tensor_parallel_size": 1}}}
    full = panels.header(snap).plain
    assert "attn torch" in full and "cpu/float32" in full
    at80 = panels.header(snap, width=80).plain
    assert len(at80) <= 80 and "SmolLM2-135M-Instruct.Q4_1" in at80 and "http://127.0.0.1:8000" in at80
    assert "attn" not in at80
    assert panels.header(snap, paused=True, width=40).plain.endswith("PAUSED")


# ---- against the live server ----


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def run_session(url: str, sid: str, turns: int = 2, between: Callable[[], None] | None = None) -> list[dict]:
    """A real agent-shaped session: each turn re-sends the whole transcript plus one new user message."""
    model = _model(url)
    messages = [{"role": "system", "content": "You are a terse coding assistant working in a repository. " * 12}]
    usages = []
    for t in range(turns):
        messages.append({"role": "user", "content": f"turn {t}: name three files of project {sid}"})
        r = httpx.post(f"{url}/v1/chat/completions", timeout=300,
                       headers={"X-Session-Id": sid, "User-Agent": f"pytest-tui/{sid}"},
                       json={"model": model, "messages": messages, "max_tokens": 8, "temperature": 0})
        r.raise_for_status()
        body = r.json()
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        usages.append(body["usage"])
        if between:
            between()
    return usages


def sessions_endpoint(url: str) -> bool:
    return httpx.get(f"{url}/v1/sessions", timeout=10).status_code == 200


async def wait_for(pilot: Any, cond: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await pilot.pause(0.1)


def _screen_text(app: TopApp) -> str:
    """What the dashboard shows on screen right now, as plain text (its SVG screenshot without the markup)."""
    svg = app.export_screenshot()
    return html.unescape(re.sub(r"<[^>]+>", "", svg)).replace("\xa0", " ")


@pytest.mark.slow
def test_two_live_sessions_appear_cache_and_close(live_server: str) -> None:
    url = live_server
    if not sessions_endpoint(url):
        pytest.xfail("session endpoints pending")
    done: dict[str, list[dict]] = {}

    def client() -> None:
        threads = [threading.Thread(target=lambda s=s: done.__setitem__(s, run_session(url, s))) for s in ("tui-a", "tui-b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    async def scenario() -> None:
        app = TopApp(url, interval=0.3)
        async with app.run_test(size=SIZE) as pilot:
            worker = threading.Thread(target=client)
            worker.start()
            await wait_for(pilot, lambda: {"tui-a", "tui-b"} <= set(app.session_ids()), 300, "both sessions listed")
            await wait_for(pilot, lambda: len(done) == 2, 300, "the client to finish")
            worker.join()
            # Second turns hit the cache: the engine reports it in usage and the dashboard shows it per session.
            assert all(u[1]["prompt_tokens_details"]["cached_tokens"] > 0 for u in done.values())

            def turns_done() -> bool:
                ss = {s["id"]: s for s in (app.snap or {}).get("sessions") or []}
                return all((ss.get(k) or {}).get("turns") == 2 for k in ("tui-a", "tui-b"))

            await wait_for(pilot, turns_done, 30, "two turns on both sessions")
            by_id = {s["id"]: s for s in app.snap["sessions"]}
            for sid in ("tui-a", "tui-b"):
                assert by_id[sid]["last_turn_hit_rate"] > 0
                assert by_id[sid]["client"] == f"pytest-tui/{sid}"
            # The shared server holds every earlier test's sessions: a filter keeps these two on screen.
            app.filter_text = "tui-"
            app.refresh_view()
            await pilot.pause(0.3)
            text = _screen_text(app)
            assert "tui-a" in text and "tui-b" in text and "pytest-tui/tui-a" in text

            # Enter on tui-a opens its turns: turn 2 with non-zero cached tokens and a TTFT.
            table = app.query_one("#sessions")
            app.filter_text = "tui-a"
            app.refresh_view()
            assert app.session_ids() == ["tui-a"]
            table.focus()
            await pilot.press("enter")
            await wait_for(pilot, lambda: isinstance(app.screen, DetailScreen), 10, "the detail screen")
            detail = app.screen.detail
            assert detail is not None and [t["turn"] for t in detail["turn_history"]][-2:] == [1, 2]
            assert detail["turn_history"][-1]["cached_tokens"] > 0
            assert detail["turn_history"][-1]["ttft_s"] > 0
            await pilot.press("escape")
            await wait_for(pilot, lambda: not isinstance(app.screen, DetailScreen), 10, "detail to close")

            # d asks first; n keeps the session.
            await pilot.press("d")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), 10, "the confirm dialog")
            await pilot.press("n")
            await pilot.pause(0.5)
            assert "tui-a" in {s["id"] for s in httpx.get(f"{url}/v1/sessions", timeout=10).json()["data"]}
            # d, y closes it: gone from the server and from the table; tui-b stays.
            await pilot.press("d")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), 10, "the confirm dialog")
            await pilot.press("y")
            await wait_for(pilot, lambda: "tui-a" not in {s["id"] for s in (app.snap or {}).get("sessions") or []},
                           30, "tui-a to disappear")
            assert "tui-a" not in {s["id"] for s in httpx.get(f"{url}/v1/sessions", timeout=10).json()["data"]}
            app.filter_text = ""
            app.refresh_view()
            assert "tui-b" in app.session_ids() and "tui-a" not in app.session_ids()

    asyncio.run(scenario())


@pytest.mark.slow
def test_keys_sort_filter_pause_quit(live_server: str) -> None:
    async def scenario() -> None:
        app = TopApp(live_server, interval=0.2)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.polls >= 2, 30, "two polls")
            assert app.snap["up"]
            await pilot.press("s")
            assert app.sort_index == 1
            await pilot.press("slash")
            assert app.query_one("#filter").has_focus
            await pilot.press("q", "z", "enter")  # typed into the filter, not taken as quit
            assert app.filter_text == "qz" and app.is_running
            await pilot.press("p")
            assert app.paused
            polls = app.polls
            await pilot.pause(0.8)
            assert app.polls == polls  # paused: no polling at all
            await pilot.press("p")
            await wait_for(pilot, lambda: app.polls > polls, 10, "polling to resume")
            await pilot.press("q")
            await wait_for(pilot, lambda: not app.is_running, 10, "quit")

    asyncio.run(scenario())


class Forwarder:
    """A loopback TCP forwarder to the live server, started and stopped by the test: stopping it makes
    the server look down to `top` (refused connections) without touching the real server."""

    def __init__(self, upstream: tuple[str, int], port: int = 0) -> None:
        self.upstream = upstream
        self.port = port
        self._sock: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(16)
        self.port = s.getsockname()[1]
        self._sock = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, s: socket.socket) -> None:
        while True:
            try:
                client, _ = s.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, up]
            for a, b in ((client, up), (up, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for x in (a, b):
                try:
                    x.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        if self._sock is not None:
            try:  # wakes the thread blocked in accept(); close() alone leaves the port listening on Linux
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
            self._sock = None
        with self._lock:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
            self._conns.clear()


@pytest.mark.slow
def test_server_down_state_shows_and_recovers(live_server: str) -> None:
    upstream = httpx.URL(live_server)
    fwd = Forwarder((upstream.host, upstream.port))
    fwd.start()

    async def scenario() -> None:
        app = TopApp(f"http://127.0.0.1:{fwd.port}", interval=0.2)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: bool(app.snap and app.snap["up"]), 30, "the first poll")
            assert app.query_one("#main").display and not app.query_one("#down").display
            fwd.stop()
            await wait_for(pilot, lambda: not app.snap["up"], 30, "the down state")
            await pilot.pause(0.1)
            text = _screen_text(app)
            assert "No agentbox server answers" in text and "agentbox serve" in text
            assert app.query_one("#down").display and not app.query_one("#main").display
            # It keeps polling at the interval (no spin, no give-up): a few polls in a second, not hundreds.
            polls = app.polls
            await pilot.pause(1.0)
            assert 2 <= app.polls - polls <= 8
            fwd.start()  # same port
            await wait_for(pilot, lambda: app.snap["up"], 30, "reconnect")
            await pilot.pause(0.1)
            assert "No agentbox server answers" not in _screen_text(app)
            assert app.query_one("#main").display

    try:
        asyncio.run(scenario())
    finally:
        fwd.stop()


@pytest.mark.slow
def test_once_snapshot_json_and_summary(live_server: str) -> None:
    from typer.testing import CliRunner

    from agentbox.cli.main import app as cli

    snap = snapshot(live_server)
    assert snap["up"] and snap["stats"]["engine"]["model_name"]
    assert snap["local"] is not None and snap["local"]["process"]["processes"] >= 2  # API + engine process
    summary = render_summary(snap)
    assert snap["stats"]["model"] in summary and "KV pool" in summary
    r = CliRunner().invoke(cli, ["top", "--once", "--json", "--url", live_server])
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["up"] is True
    r = CliRunner().invoke(cli, ["top", "--once", "--url", live_server])
    assert r.exit_code == 0 and "KV pool" in r.output and "agentbox top" in r.output
    with socket.socket() as s:  # a port with nothing on it
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    r = CliRunner().invoke(cli, ["top", "--once", "--url", dead])
    assert r.exit_code == 1 and "agentbox serve" in r.output
