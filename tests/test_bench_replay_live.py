"""Replay 2 sessions x 3 turns against live agentbox servers (spawned per cache policy) on SmolLM2."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from agentbox.bench import synth
from agentbox.bench.replay import ReplayOptions
from agentbox.bench.spawn import agentbox_target, run_targets
from agentbox.hub.embedded import INSTALL_HINT, embedded_model_path

pytestmark = pytest.mark.slow


def _server_missing() -> str | None:
    try:
        importlib.import_module("agentbox.server.app")
    except ImportError as e:
        return f"agentbox.server.app cannot be imported yet ({e})"
    return None


@pytest.mark.skipif(_server_missing() is not None, reason=str(_server_missing()))
@pytest.mark.skipif(embedded_model_path() is None, reason=f"SmolLM2 GGUF not installed: {INSTALL_HINT}")
def test_replay_against_live_agentbox_counts_add_up(tmp_path: Path) -> None:
    sessions = synth.generate(synth.SynthConfig(sessions=2, turns=3, turn_sigma=0.0, scale=0.05, wait=0.2))
    targets = [agentbox_target(str(embedded_model_path()), policy, []) for policy in ("session", "none")]
    notes: list[str] = []
    runs = run_targets(sessions, targets, ReplayOptions(request_timeout_s=300), tmp_path, notes=notes)
    assert notes == [], notes
    session_run, none_run = runs
    for run in runs:
        recs = run.records
        assert len(recs) == 6 and all(r.ok for r in recs), [r.error for r in recs]
        for r in recs:
            (s,) = [s for s in sessions if s.id == r.session]
            assert r.output_tokens == s.turns[r.turn].output_tokens  # ignore_eos honoured
            assert r.cached_tokens is not None and 0 <= r.cached_tokens <= r.prompt_tokens
            assert r.ttft_s is not None and r.ttft_s <= r.latency_s
        for prev, cur in zip(recs, recs[1:], strict=False):
            if prev.session == cur.session:
                assert cur.prompt_tokens > prev.prompt_tokens  # the conversation only grows
        st = run.stats
        assert st.turns == 6 and st.errors == 0
        assert st.prompt_tokens == sum(r.prompt_tokens for r in recs)
        # history at turn k: turn k-1's prompt (the recorded answer, not the model's, is sent back)
        assert st.history_tokens == sum(r.prompt_tokens for r in recs if r.turn < 2)
        assert 0 <= st.recomputed_tokens <= st.history_tokens
    # the session policy kept each conversation; `none` recomputed every token of it
    assert all(r.cached_tokens > 0 for r in session_run.records if r.turn > 0)
    # no pressure: the session policy misses only each previous prompt's last partial page (4 counted turns)
    assert session_run.stats.recomputed_tokens <= 4 * 15
    assert none_run.stats.cached_tokens == 0 and none_run.stats.recomputed_share == 1.0
    # the servers' own counters (read from /v1/stats after each run) tell the same story, in whole pages
    assert session_run.server_stats is not None and none_run.server_stats is not None
    assert session_run.server_stats["counters"]["recomputed_history_tokens"] == 0
    server_none = none_run.server_stats["counters"]["recomputed_history_tokens"]
    assert 0 <= none_run.stats.recomputed_tokens - server_none <= 4 * 15
