"""`agentbox bench restart`: what a server restart costs the sessions in flight. The same replay runs on a
spawned agentbox straight through, then cut after each session's first `restart_after` turns by a graceful
stop (SIGTERM: the engine writes its cache to disk) and a start over the same state directory, and, for
comparison, the same cut with `serve --no-restore` (the restart every other engine has). Each run reports
the recomputed share of history (bench/stats.py) overall and on the first turn after the cut."""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from agentbox.bench.replay import ReplayOptions, replay_sync
from agentbox.bench.spawn import agentbox_command, spawned
from agentbox.bench.stats import TurnRecord, history_accounting
from agentbox.trace import Session


def _shares(records: list[TurnRecord], turn: int) -> dict[str, Any]:
    history, recomputed = history_accounting(records)
    at = [r for r in records if r.turn in (turn - 1, turn)]
    h_at, r_at = history_accounting(at)
    return {"history_tokens": history, "recomputed_tokens": recomputed,
            "recomputed_share": round(recomputed / history, 4) if history else None,
            "first_turn_after_cut": {"history_tokens": h_at, "recomputed_tokens": r_at,
                                     "recomputed_share": round(r_at / h_at, 4) if h_at else None}}


def _cut(sessions: list[Session], cmd: list[str], second: list[str], k: int, out_dir: Path, name: str,
         options: ReplayOptions) -> list[TurnRecord]:
    tag = uuid.uuid4().hex[:8]  # the same session ids on both sides of the restart
    with tempfile.TemporaryDirectory(prefix="agentbox-bench-") as home:
        with spawned(cmd, out_dir / f"{name}.log", home=home) as (url, _):
            first = replay_sync([replace(s, turns=s.turns[:k]) for s in sessions], url, options, run_tag=tag)
        with spawned([*cmd, *second], out_dir / f"{name}.log", home=home) as (url, _):
            rest = replay_sync(sessions, url, options, start_turn=k, run_tag=tag)
    return first.records + rest.records


def bench_restart(sessions: list[Session], model: str, serve_args: Sequence[str], restart_after: int,
                  out_dir: Path, options: ReplayOptions = ReplayOptions()) -> dict[str, Any]:
    cmd = agentbox_command(model, serve_args)
    out_dir.mkdir(parents=True, exist_ok=True)
    with spawned(cmd, out_dir / "straight.log") as (url, _):
        straight = replay_sync(sessions, url, options).records
    runs = {"straight": straight,
            "restart": _cut(sessions, cmd, [], restart_after, out_dir, "restart", options),
            "restart_no_restore": _cut(sessions, cmd, ["--no-restore"], restart_after, out_dir, "cold", options)}
    return {"restart_after_turns": restart_after, "sessions": len(sessions),
            **{name: _shares(recs, restart_after) for name, recs in runs.items()}}
