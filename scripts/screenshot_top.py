"""Regenerate docs/top.svg: the `agentbox top` dashboard photographed during a real replay.

Replays a seeded synthetic agent trace (agentbox.bench) against a running server while `top` polls it
under Textual's headless driver, and saves an SVG screenshot once the cache has had turns to prove itself.

    agentbox serve --num-pages 512          # or any running agentbox; the CPU test model is enough
    python scripts/screenshot_top.py [--url http://127.0.0.1:8000] [--out docs/top.svg]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
from pathlib import Path

from agentbox.bench import synth
from agentbox.bench.replay import ReplayOptions, replay_sync
from agentbox.cli import daemon
from agentbox.tui.app import TopApp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="server root (default: the running agentbox)")
    ap.add_argument("--out", default="docs/top.svg")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--scale", type=float, default=0.1, help="token sizes of the synthetic trace (0.1: CPU)")
    ap.add_argument("--shoot-after-turns", type=int, default=20, help="photograph once this many turns finished")
    ap.add_argument("--size", default="184x42", help="terminal COLUMNSxROWS")
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args()

    url = args.url
    if url is None:
        st = daemon.read_state()
        if st is None:
            raise SystemExit("no running agentbox; start one (agentbox serve) or pass --url")
        url = daemon.url_of(st)
    cols, rows = (int(x) for x in args.size.split("x"))
    cfg = synth.SynthConfig(sessions=args.sessions, turns=args.turns, turn_sigma=0.0, scale=args.scale, seed=0)
    sessions = synth.generate(cfg)
    finished: list[object] = []
    # Daemon thread: the screenshot is taken mid-replay; leaving ends the rest (the server aborts them).
    threading.Thread(
        target=replay_sync, args=(sessions, url, ReplayOptions(max_concurrency=None)),
        kwargs={"on_turn": finished.append}, daemon=True,
    ).start()

    async def shoot() -> None:
        app = TopApp(url, interval=1.0)
        async with app.run_test(size=(cols, rows)) as pilot:
            deadline = time.monotonic() + args.timeout
            # Mid-replay, with a busy moment on screen: enough finished turns, and a request running now.
            while len(finished) < args.shoot_after_turns or not (app.snap or {}).get("stats", {}).get("running"):
                if time.monotonic() > deadline:
                    raise SystemExit(f"only {len(finished)} turns finished within {args.timeout:.0f} s")
                await pilot.pause(0.2)
            await pilot.pause(0.3)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            path = app.save_screenshot(filename=Path(args.out).name, path=str(Path(args.out).parent))
            print(f"wrote {path} after {len(finished)} turns")

    asyncio.run(shoot())


if __name__ == "__main__":
    main()
