"""`agentbox top` in an 80x24 and a 120x40 terminal, against the live CPU server: every column that fits shows,
the resident-tokens column says where the KV lives (a CPU's pool is in RAM: "KV tok"), every panel is one key
away at 80x24 and all on screen at 120x40, the header stays one line, "q quit" stays in the footer and
Ctrl-C quits."""

from __future__ import annotations

import asyncio

import pytest
from test_tui import _screen_text, run_session, sessions_endpoint, wait_for
from typer.testing import CliRunner

from agentbox.cli.main import app as cli_app
from agentbox.tui.app import TopApp

NARROW = (80, 24)


@pytest.mark.slow
def test_top_at_80x24_shows_every_column_and_each_panel(live_server: str) -> None:
    if not sessions_endpoint(live_server):
        pytest.xfail("session endpoints pending")
    run_session(live_server, "narrow-tui", turns=1)

    async def scenario() -> None:
        app = TopApp(live_server, interval=0.3)
        async with app.run_test(size=NARROW) as pilot:
            await wait_for(pilot, lambda: "narrow-tui" in app.session_ids(), 60, "the session listed")
            # The shared server holds every earlier test's sessions; 24 rows show only some: filter to ours.
            app.filter_text = "narrow-tui"
            app.refresh_view()
            await pilot.pause(0.3)
            assert app.stacked and app.cycling
            text = _screen_text(app)
            rows = text.splitlines()
            header = next(r for r in rows if "session" in r and "state" in r)
            # every number column is on screen, the pool named as it is: a CPU server's is in RAM
            for title in ("turns", "KV tok", "lease", "hit", "life", "recomp", "TTFT"):
                assert title in header, header
            assert "GPU tok" not in text and "q quit" in text
            assert "narrow-tui" in text
            # the KV pool panel shows first; v brings the rates, then the machine
            assert "KV pool (pages" in text and "decode tok/s" not in text
            await pilot.press("v")
            await pilot.pause(0.3)
            text = _screen_text(app)
            assert "decode tok/s" in text and "recompute ratio" in text and "KV pool (pages" not in text
            await pilot.press("v")
            await pilot.pause(0.3)
            text = _screen_text(app)
            assert "requests" in text and "server CPU" in text and "no GPU" in text
            await pilot.press("ctrl+c")
            await wait_for(pilot, lambda: not app.is_running, 10, "Ctrl-C to quit")

    asyncio.run(scenario())


@pytest.mark.slow
def test_top_at_120x40_shows_every_column_that_fits_and_every_panel(live_server: str) -> None:
    run_session(live_server, "tall-tui", turns=1)

    async def scenario() -> None:
        app = TopApp(live_server, interval=0.3)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: "tall-tui" in app.session_ids(), 60, "the session listed")
            await pilot.pause(0.3)  # the panels' new text is laid out on the next refresh
            assert app.stacked and not app.cycling
            text = _screen_text(app)
            header = next(r for r in text.splitlines() if "session" in r and "state" in r)
            for title in ("client", "turns", "state", "KV tok", "lease", "hit last", "hit life", "recomp", "TTFT"):
                assert title in header, header
            # the three panels under the table, none a key away
            assert "KV pool (pages" in text and "decode tok/s" in text and "server CPU" in text
            assert "q quit" in text and "v panel" not in text

    asyncio.run(scenario())


@pytest.mark.slow
def test_top_once_fits_80_columns(live_server: str) -> None:
    out = CliRunner().invoke(cli_app, ["top", "--once", "--url", live_server], env={"COLUMNS": "80"})
    assert out.exit_code == 0, out.output
    assert "KV tok" in out.output and "GPU tok" not in out.output
    too_long = [line for line in out.output.splitlines() if len(line) > 80]
    assert not too_long, too_long
