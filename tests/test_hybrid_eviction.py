"""A hybrid model's pages and recurrent-state snapshots leave together (engine/cache/state_units.py), and a full
snapshot store demotes to host RAM instead of dropping (state_snapshots.py).

The cache-level tests drive a radix cache with a snapshot store the way the scheduler does (a turn's pages
inserted, then its snapshot saved) and evict one unit at a time in LRU order. The engine test runs a tiny
random Qwen3.5 with two device snapshot slots: sessions' snapshots go to host, and a later turn that resumes
from one (its pages demoted to the host tier too) answers as transformers' cold run does."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from hybrid_models import configs, hf_greedy, save_hybrid
from radix_harness import make_cache, run_turn
from rich.console import Console

from agentbox.config import CachePolicy, EngineConfig
from agentbox.engine.cache.radix_cache import RadixCache
from agentbox.engine.cache.radix_node import Tier
from agentbox.engine.cache.state_snapshots import SnapshotPoint, SnapshotStore
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.stats import to_json
from agentbox.tui.panels import pool_panel

P = [1, 2, 3, 4]  # the shared system prompt: 2 pages of 2 tokens


def _setup(history: bool = True) -> tuple[RadixCache, SnapshotStore]:
    """Session b on P with a shared snapshot at P's end; session a's two turns on P; a's turns are the oldest."""
    cache, clock = make_cache(num_pages=24, page_size=2, policy=CachePolicy.LRU)
    store = SnapshotStore(num_rows=1, num_snapshots=8)
    cache.keep_states(store)
    a1, a2 = P + [10, 11], P + [10, 11, 12, 13, 14, 15]
    for t, (sid, toks) in enumerate([("a", a1), ("a", a2), ("b", P + [20, 21, 22, 23])]):
        clock.t = float(t)
        run_turn(cache, toks, sid)
        store.save(sid, SnapshotPoint.TURN, toks, src=0)  # a1's stays as a's history point
    if not history:
        store.drop("a")
        store.save("a", SnapshotPoint.TURN, a2, src=0)
    store.save_shared(P, src=0)
    return cache, store


def _positions(store: SnapshotStore, session: str, tokens: list[int]) -> int:
    snap = store.find(session, tokens, len(tokens))
    return snap.num_tokens if snap is not None else 0


def test_a_turn_evicted_leaves_the_session_its_earlier_snapshot() -> None:
    cache, store = _setup()
    a2 = P + [10, 11, 12, 13, 14, 15]
    assert _positions(store, "a", a2 + [9]) == 10
    freed = cache.evict(1)  # the least recently used leaf: a's second turn, [12, 15]
    assert freed == 2 and cache.match(a2 + [9]).num_tokens == 6
    # its snapshot went with its pages; the first turn's (kept as history) resumes the pages left
    assert store.stats().evicted == 1 and _positions(store, "a", a2 + [9]) == 6
    cache.check_integrity(Counter())


def test_pages_no_snapshot_needs_leave_with_the_unit() -> None:
    cache, store = _setup(history=False)
    a2 = P + [10, 11, 12, 13, 14, 15]
    before = cache.gpu_pages
    cache.evict(1)
    # a's whole suffix went as one unit (its only snapshot was on the leaf): the pages under it resume nothing
    assert cache.gpu_pages == before - 3 and cache.match(a2 + [9]).num_tokens == 4
    assert _positions(store, "a", a2 + [9]) == 0
    # P stays: b's turn and the shared snapshot resume on it
    assert store.find_shared(a2, len(a2)) is not None and cache.match(P + [20, 21, 22, 23, 9]).num_tokens == 8
    cache.check_integrity(Counter())


def test_a_dead_tail_goes_alone() -> None:
    cache, clock = make_cache(num_pages=24, page_size=2, policy=CachePolicy.LRU)
    store = SnapshotStore(num_rows=1, num_snapshots=4)
    cache.keep_states(store)
    toks = P + [30, 31, 32, 33, 34, 35]
    run_turn(cache, toks, "c")
    store.save("c", SnapshotPoint.PROMPT, toks[:6], src=0)  # inside the node: [6, 10) resumes nothing
    assert cache.evict(1) == 2
    assert cache.match(toks + [9]).num_tokens == 6 and _positions(store, "c", toks) == 6
    assert store.stats().evicted == 0
    cache.check_integrity(Counter())


def test_host_pages_keep_their_snapshot_until_dropped() -> None:
    cache, _ = make_cache(num_pages=24, page_size=2, host_pages=8, policy=CachePolicy.LRU)
    store = SnapshotStore(num_rows=1, num_snapshots=4)
    cache.keep_states(store)
    toks = P + [40, 41]
    run_turn(cache, toks, "d")
    store.save("d", SnapshotPoint.TURN, toks, src=0)
    cache.evict(3)  # demoted: the pages still resume at 6, from host
    assert cache.host_pages == 3 and _positions(store, "d", toks) == 6
    assert cache.match(toks + [9]).num_copied_tokens == 6
    cache.evict_host(1)  # dropped: the snapshot goes with them
    assert cache.host_pages == 0 and store.stats().evicted == 1 and _positions(store, "d", toks) == 0
    cache.check_integrity(Counter())


def test_a_full_store_demotes_to_host_then_drops() -> None:
    store = SnapshotStore(num_rows=1, num_snapshots=1, num_host=1)
    first = 2  # device snapshot slot (after the live row and its aligned copy); host slot 3
    assert store.save("a", SnapshotPoint.TURN, [1] * 4, src=1)
    assert store.take_copies() == [(1, first)]
    assert store.save("b", SnapshotPoint.TURN, [2] * 4, src=1)
    assert store.take_copies() == [(first, 3), (1, first)]  # a's state to host before b's overwrites its slot
    snap = store.find("a", [1] * 6, 6)
    assert snap is not None and snap.slot == 3
    store.used(snap)
    assert store.save("c", SnapshotPoint.TURN, [3] * 4, src=1)  # b to host; host full: a (its victim) dropped
    s = store.stats()
    assert (s.count, s.host_count, s.demoted, s.promoted, s.dropped) == (1, 1, 2, 1, 1)
    assert store.find("a", [1] * 6, 6) is None and store.find("b", [2] * 6, 6) is not None


def test_host_snapshots_resume_exactly(tmp_path: Path) -> None:
    hf = save_hybrid(configs()["qwen3_5"], tmp_path)
    # a pool of 10 pages: the third session's turn pushes the first's pages to the host tier
    config = EngineConfig(model=str(tmp_path), page_size=16, attention="torch", num_pages=10, host_cache_gb=0.002,
                          state_snapshots=2, host_state_snapshots=4, max_num_seqs=2)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = {f"s{i}": [(i * 29 + k * 7 + 1) % 256 for k in range(40)] for i in range(3)}
    with LLM(config) as llm:
        first = {sid: llm.generate([p], sp, session_ids=[sid])[0] for sid, p in prompts.items()}
        # each turn kept 2 snapshots (prompt at 32, turn at 48): s0's and s1's were demoted to host by s2's;
        # the session whose pages the evictor demoted comes back
        sid = next(s for s in ("s0", "s1") if llm.core.cache.session_pages(s)[Tier.HOST])
        second = prompts[sid] + first[sid].token_ids + [5, 6, 7]
        out = llm.generate([second], sp, session_ids=[sid])[0]
        assert out.token_ids == hf_greedy(hf, second, 12)  # a snapshot from host never changes an answer
        assert out.num_cached_tokens == 48
        stats = to_json(llm.core.stats())
        assert stats["cache"]["promotions"] > 0 and stats["counters"]["host_cached_tokens"] > 0  # pages from host
        snaps = stats["snapshots"]
        assert snaps["promoted"] == 1 and snaps["demoted"] >= 2 and snaps["host_count"] >= 1
        assert snaps["host_capacity"] == 4
        console = Console(width=200, record=True)  # `agentbox top` shows the host store beside the device one
        console.print(pool_panel({"stats": stats, "sessions": []}))
        assert f"host {snaps['host_count']} of 4, demoted {snaps['demoted']}" in console.export_text()
        llm.core.check_integrity()


def test_state_slots_move_between_device_and_host_and_out_as_records() -> None:
    from agentbox.layers.recurrent_state import LinearStateSpec, StateCache, StateRecord

    cache = StateCache([LinearStateSpec(6, 3, 2, 4, 4)] * 2, num_slots=3, dtype=torch.float32, device="cpu",
                       num_host=2)
    for tensors in cache.layers:
        for t in tensors:
            t[0] = torch.randn_like(t[0])
    cache.copy([0, 4], [4, 2])  # device slot 0 -> host slot 1 (index 4) -> device slot 2, in order
    record = cache.read(2, num_tokens=32, digest=b"d" * 16)
    assert isinstance(record, StateRecord) and len(record.tensors) == 4
    for got, want in zip(record.tensors, (t[0] for tensors in cache.layers for t in tensors), strict=True):
        assert torch.equal(got, want)
    cache.write(3, record)  # back into host slot 0
    assert all(torch.equal(host[0], t[0]) for hl, dl in zip(cache.host_layers, cache.layers, strict=True)
               for host, t in zip(hl, dl, strict=True))
