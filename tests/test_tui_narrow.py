"""`agentbox top` in an 80x24 terminal, against the live CPU server: the whole session table shows (not two
columns of it), the resident-tokens column is named by the real device, and every panel is one key away."""

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
            assert app.narrow
            text = _screen_text(app)
            rows = text.splitlines()
            header = next(r for r in rows if "session" in r and "state" in r)
            # every number column is on screen, the device named as it is: a CPU server says CPU
            for title in ("turns", "CPU tok", "lease", "hit", "life", "recomp", "TTFT"):
                assert title in header, header
            assert "GPU tok" not in text
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

    asyncio.run(scenario())


@pytest.mark.slow
def test_top_once_fits_80_columns(live_server: str) -> None:
    out = CliRunner().invoke(cli_app, ["top", "--once", "--url", live_server], env={"COLUMNS": "80"})
    assert out.exit_code == 0, out.output
    assert "CPU tok" in out.output and "GPU tok" not in out.output
    too_long = [line for line in out.output.splitlines() if len(line) > 80]
    assert not too_long, too_long
