"""Hybrid models' recurrent-state snapshots beyond one session: a new session that repeats another's prefix
(system prompt + tool definitions) resumes at the divergence point the radix cache knows, answering as a cold
run does; and what the snapshots hold is reported per session and in the engine's stats, from the store."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hybrid_models import configs, hf_greedy, save_hybrid

from agentbox.config import EngineConfig
from agentbox.engine.ipc.messages import Query, QueryKind
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.stats import to_json
from agentbox.tui.panels import pool_panel
from agentbox.tui.session_table import sessions_table

PREFIX = [(i * 13 + 5) % 256 for i in range(100)]  # the shared system prompt + tools: 6 whole pages and 4 tokens
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLM, torch.nn.Module]]:
    path: Path = tmp_path_factory.mktemp("qwen3_5-snapshots")
    hf = save_hybrid(configs()["qwen3_5"], path)
    config = EngineConfig(model=str(path), page_size=16, attention="torch", num_pages=128, host_cache_gb=0.0)
    with LLM(config) as llm:
        yield llm, hf


def _tail(seed: int) -> list[int]:
    return [(seed * 37 + k * 11) % 256 for k in range(20)]


def test_new_session_resumes_at_the_shared_prefix(hybrid: tuple[LLM, torch.nn.Module]) -> None:
    llm, hf = hybrid
    prompts = {name: PREFIX + _tail(seed) for seed, name in enumerate(("first", "second", "third", "fourth"))}
    outs = {name: llm.generate([p], SP, session_ids=[name])[0] for name, p in prompts.items()}
    for name, out in outs.items():
        assert out.token_ids == hf_greedy(hf, prompts[name], 6), name  # a snapshot never changes an answer
    # first: nothing known. second: the tree knows the first's 96 tokens of the prefix but no state there, so it
    # computes them and keeps its state at 96. third and fourth resume there.
    assert [outs[n].num_cached_tokens for n in prompts] == [0, 0, 96, 96]
    snaps = llm.core.stats().snapshots
    assert snaps is not None and snaps.hits == 2
    llm.core.check_integrity()


def test_snapshot_bytes_reported_from_the_store(hybrid: tuple[LLM, torch.nn.Module]) -> None:
    llm, _ = hybrid
    llm.generate([PREFIX + _tail(9)], SP, session_ids=["agent"])
    state = llm.core.runner.state_cache
    assert state is not None
    slot = sum(t[0].nbytes for t in (*state.conv, *state.matrix))  # one slot of the real tensors
    sessions = {s["id"]: s for s in to_json(llm.core.query(Query(0, QueryKind.SESSIONS)))["data"]}
    # the agent's turn ended: its prompt's and its turn's snapshots are held
    assert sessions["agent"]["snapshot_bytes"] == 2 * slot
    detail = to_json(llm.core.query(Query(0, QueryKind.SESSION, "agent")))
    assert detail["snapshot_bytes"] == 2 * slot
    stats = to_json(llm.core.stats())
    snaps = stats["snapshots"]
    own = sum(s["snapshot_bytes"] for s in sessions.values())
    assert snaps["slot_bytes"] == slot and snaps["used_bytes"] == snaps["count"] * slot
    assert snaps["used_bytes"] >= own  # the sessions' own, and any shared prefix's
    assert snaps["capacity_bytes"] == snaps["capacity"] * slot
    # `agentbox top` shows both: the session's column and the pool panel's line
    snap = {"stats": stats, "sessions": list(sessions.values())}
    text = _render(sessions_table(snap["sessions"])) + _render(pool_panel(snap))
    assert f"state snapshots {snaps['count']} of {snaps['capacity']}" in text
    assert f"{2 * slot / 1024:.0f}K" in text


def _render(renderable: object) -> str:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


def test_a_full_store_drops_shared_prefixes_before_sessions() -> None:
    from agentbox.engine.cache.state_snapshots import SnapshotPoint, SnapshotStore

    store = SnapshotStore(num_rows=2, num_snapshots=3, slot_bytes=100)
    a, shared, b = [1] * 32, [2] * 32, [3] * 32
    store.save("a", SnapshotPoint.TURN, a, 0)
    store.save_shared(shared, 0)
    store.save("b", SnapshotPoint.TURN, b, 0)
    assert store.find_shared(shared + [9], 64) is not None and store.find_shared([2] * 16, 64) is None
    store.save("c", SnapshotPoint.TURN, [4] * 32, 0)  # full: the shared prefix goes, not the older session "a"
    assert store.find_shared(shared, 64) is None
    assert store.find("a", a, 64) is not None and store.session_bytes("a") == 100
    store.save("d", SnapshotPoint.TURN, [5] * 32, 0)  # then the least recently used session's
    assert store.find("a", a, 64) is None and store.stats().dropped == 2


def test_a_ring_snapshot_taken_exactly_resumes_a_page_back() -> None:
    """A ring keeps a page of slack: its snapshot of a state that stands exactly at its position (a prompt's chunk
    ended there) also resumes a page earlier, as a view of the same slot; one whose ring ran past it (a turn's end)
    does not, nor does a store of states without slack (back 0)."""
    from agentbox.engine.cache.state_snapshots import SnapshotPoint, SnapshotStore

    ring = SnapshotStore(num_rows=2, num_snapshots=4, slot_bytes=100, in_place=True, back=16)
    prompt = list(range(48))
    assert ring.save("a", SnapshotPoint.PROMPT, prompt, 0, exact=True)
    diverged = prompt[:40] + [999] * 8  # the next turn drops the prompt's last 8 tokens
    view = ring.find_any(diverged, 32)
    slot = ring.find("a", prompt, 48).slot  # type: ignore[union-attr]
    assert view is not None and (view.num_tokens, view.slot) == (32, slot)
    ring.used(view)
    assert ring.stats().hits == 1
    assert ring.find_any(diverged[:20] + [7] * 28, 32) is None  # a page back is as far as the slack reaches
    ring.save("b", SnapshotPoint.TURN, [5] * 48, 0)  # a turn's ring ran past its position: no earlier resume
    assert ring.find_any([5] * 40 + [6] * 8, 32) is None
    plain = SnapshotStore(num_rows=2, num_snapshots=4, slot_bytes=100)
    plain.save("a", SnapshotPoint.PROMPT, prompt, 0, exact=True)
    assert plain.find_any(diverged, 32) is None


def test_prompt_snapshot_stands_before_the_generation_prompt(hybrid: tuple[LLM, torch.nn.Module]) -> None:
    """A chat prompt ends in the template's generation prompt, which the next turn renders otherwise (its answer in
    its place). The prompt snapshot is taken at the last page boundary before that tail (`history_end`), so the
    next turn resumes there; at the prompt's last boundary (128, past the divergence at 125) it resumed at 0."""
    llm, hf = hybrid
    history = [(i * 29 + 3) % 256 for i in range(125)]
    gen = [7, 8, 9, 10, 11]  # the generation prompt: 130 tokens in all
    first = llm.generate([history + gen], SP, session_ids=["chat"], history_ends=[len(history)])[0]
    second = history + [12, 13, *first.token_ids, 14, 15, 16]  # the answer rendered in the history, a tool result
    out = llm.generate([second], SP, session_ids=["chat"])[0]
    assert out.num_cached_tokens == 112  # 125 // 16 * 16
    assert out.token_ids == hf_greedy(hf, second, 6)
    llm.core.check_integrity()
