"""The disk tier under the radix cache: pages that leave memory are written, a later match (or a new cache over
the same directory: a restart) reads them back bit-exact; torn and corrupt chunks are dropped and counted;
the tier stays within its budget; a model change never reuses a namespace."""

from __future__ import annotations

import json
import os
import threading
import time
from array import array
from pathlib import Path

import pytest
import torch

from agentbox.config import EngineConfig
from agentbox.engine.cache import disk_writer
from agentbox.engine.cache.cache_policies import LruCache
from agentbox.engine.cache.disk_namespace import namespace_for
from agentbox.engine.cache.disk_pages import bytes_to_pages, pages_to_bytes
from agentbox.engine.cache.disk_tier import DiskTier
from agentbox.engine.cache.kv_pool import PagePool
from agentbox.engine.cache.radix_disk import DiskLink
from agentbox.engine.cache.radix_node import Match, Tier
from agentbox.layers.backends.base import KVCache, KVLayerSpec

PS = 4


def on_disk(m: Match) -> int:
    """Of m's tokens, those its lock reads back from disk (the match's continuation below memory)."""
    return m.below.num_tokens if m.below is not None else 0


def _kv(num_pages: int = 12) -> KVCache:
    return KVCache.uniform(2, num_pages, PS, 2, 4, torch.float32, "cpu")


def _cache(root: Path, kv: KVCache, budget: int = 1 << 30, ns: str = "ns") -> LruCache:
    tier = DiskTier(root, ns, {"test": True}, kv.page_bytes, budget)
    return LruCache(PagePool(kv.num_pages, PS), kv, disk=DiskLink(tier, PS))


def _compute(cache: LruCache, kv: KVCache, toks: list[int], session: str | None = None,
             ) -> dict[int, list[torch.Tensor]]:
    """'Compute' toks: fresh pages filled with values derived from the tokens, inserted. Returns page data by
    page index in the sequence."""
    n = len(toks) // PS
    pages = cache.reserve(n)
    assert pages is not None
    out = {}
    for i, p in enumerate(pages):
        for t in (*kv.k, *kv.v):
            t[p * PS : (p + 1) * PS] = torch.randn(PS, 2, 4)
        out[i] = [t[p * PS : (p + 1) * PS].clone() for t in (*kv.k, *kv.v)]
    cache.insert(toks, pages, session)
    cache.check_integrity()
    return out


def _pages_of(kv: KVCache, pages: list[int]) -> list[list[torch.Tensor]]:
    return [[t[p * PS : (p + 1) * PS].clone() for t in (*kv.k, *kv.v)] for p in pages]


def test_evicted_pages_come_back_from_disk_exact_and_after_a_restart(tmp_path: Path) -> None:
    kv = _kv()
    cache = _cache(tmp_path, kv)
    toks = list(range(100, 100 + 8 * PS))
    data = _compute(cache, kv, toks)
    assert cache.evict(8) == 8 and cache.gpu_pages == 0  # no host tier: written to disk, freed
    assert cache.stats().disk_pages == 8 and cache.stats().disk_written == 8
    # The same prefix plus a new part: the match goes on on disk, the lock reads it back.
    m = cache.match([*toks, 1, 2, 3, 4, 5], "s")
    assert m.num_tokens == 8 * PS and on_disk(m) == 8 * PS and m.num_resident_tokens == 0
    # the API process's int32 array finds the same pages (the disk's hashes do not depend on the type)
    assert cache.match(array("i", [*toks, 1, 2, 3, 4, 5]), "s") == m
    lock = cache.lock(m)
    assert lock.num_tokens == 8 * PS and lock.num_copied_tokens == 8 * PS
    got = _pages_of(kv, lock.pages)
    assert all(torch.equal(a, b) for i in range(8) for a, b in zip(data[i], got[i], strict=True))
    cache.check_integrity()
    cache.release(lock.pages)
    # A diverging sequence matches only the shared pages.
    other = [*toks[: 3 * PS], *range(7, 7 + 5 * PS)]
    assert cache.match(other).num_tokens == 3 * PS
    # A restart: a new cache over the same directory finds every page (the index was flushed by persist).
    cache.persist(5.0)
    kv2 = _kv()
    again = _cache(tmp_path, kv2)
    assert on_disk(again.match(array("i", toks[: 6 * PS + 2]))) == 6 * PS  # a lookup's array, then a tuple
    m2 = again.match(toks[: 6 * PS + 2])
    assert m2.num_tokens == 6 * PS and on_disk(m2) == 6 * PS
    got2 = _pages_of(kv2, again.lock(m2).pages)
    assert all(torch.equal(a, b) for i in range(6) for a, b in zip(data[i], got2[i], strict=True))
    again.check_integrity()


def test_corrupt_and_torn_chunks_are_dropped_counted_never_served(tmp_path: Path) -> None:
    kv = _kv()
    cache = _cache(tmp_path, kv)
    a = list(range(1, 1 + 3 * PS))
    _compute(cache, kv, a)
    cache.evict(3)  # one chunk: a's 3 pages
    b = [*a, *range(50, 50 + 3 * PS)]
    _compute(cache, kv, b)  # a's pages are back? no: recomputed here, then b's tail is a second chunk
    cache.evict(12)
    cache.persist(5.0)
    chunks = sorted((tmp_path / "ns" / "chunks").iterdir(), key=lambda p: p.stat().st_mtime_ns)
    assert len(chunks) == 2
    tail = chunks[-1]
    raw = bytearray(tail.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # a flipped byte in b's tail chunk
    tail.write_bytes(bytes(raw))
    (tmp_path / "ns" / "chunks" / "deadbeef.tmp").write_bytes(b"half a chunk")  # a crash's leftover
    kv2 = _kv()
    again = _cache(tmp_path, kv2)
    assert again.stats().disk_torn == 1  # the leftover, found at start
    m = again.match([*b, 9])
    assert m.num_tokens == 6 * PS  # the index still names both chunks
    lock = again.lock(m)
    assert lock.num_tokens == 3 * PS  # the corrupt chunk is not served: its tokens are recomputed
    assert again.stats().disk_torn == 2 and on_disk(again.match([*b, 9])) == 0
    again.check_integrity()


def test_a_chunk_read_ahead_is_taken_only_while_it_is_what_the_index_names(tmp_path: Path) -> None:
    """Reads ahead (on arrival, and the next chunks of a restore) run on worker threads; a chunk rewritten
    after its read was asked is read again, a torn one is dropped and counted, as without reading ahead."""
    tier = DiskTier(tmp_path, "ns", {}, page_bytes=8, budget_bytes=1 << 20)
    hs = [bytes([i]) * 16 for i in range(1, 4)]
    assert tier.write(hs[:2], b"A" * 16) and tier.write(hs[2:], b"B" * 8)
    refs = [tier.pages[h.hex()] for h in hs]
    tier.prefetch(refs)
    assert tier.reader.asked(refs[0].chunk) and tier.reader.asked(refs[2].chunk)
    assert tier.write(hs[:2], b"C" * 16)  # the same chunk name, other bytes: the read ahead is stale
    assert [(bytes(d), i) for d, i in tier.read_runs(refs)] == [(b"C" * 16, [0, 1]), (b"B" * 8, [0])]
    (tier.chunks_dir / f"{refs[2].chunk}.kv").write_bytes(b"torn!!!!")  # same size, other bytes
    tier.prefetch(refs)
    assert [bytes(d) for d, _ in tier.read_runs(refs)] == [b"C" * 16]  # the torn one is dropped, counted
    assert tier.torn == 1 and refs[2].chunk not in tier.chunks and tier.read == 5


def test_bounded_by_budget_other_namespaces_first(tmp_path: Path) -> None:
    kv = _kv()
    per_page = kv.page_bytes
    stale = tmp_path / "stale-model"
    (stale / "chunks").mkdir(parents=True)
    (stale / "chunks" / "x.kv").write_bytes(b"\0" * per_page * 2)
    cache = _cache(tmp_path, kv, budget=5 * per_page)
    for j in range(4):
        _compute(cache, kv, list(range(1000 * j, 1000 * j + 2 * PS)))
        cache.evict(2)
    t = cache.disk.tier  # type: ignore[union-attr]
    assert not stale.exists()  # the other namespace went first
    assert t.bytes_used <= 5 * per_page and t.num_pages == 4  # then the oldest chunks of this one
    assert on_disk(cache.match(list(range(3000, 3000 + 2 * PS)))) == 2 * PS  # the newest is kept
    assert on_disk(cache.match(list(range(0, 2 * PS)))) == 0


def test_a_full_disk_is_a_warning_not_a_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    kv = _kv()
    cache = _cache(tmp_path, kv)
    _compute(cache, kv, list(range(2 * PS)))

    def enospc(*_: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", enospc)  # what the kernel says when the disk is full
    assert cache.evict(2) == 2  # the pages are dropped, eviction goes on
    assert cache.stats().disk_pages == 0 and "No space left" in caplog.text
    assert not list((tmp_path / "ns" / "chunks").iterdir())  # no temporary left behind


def test_a_model_change_never_reuses_a_namespace(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"w" * 64)
    (model / "tokenizer_config.json").write_text('{"chat_template": "a"}')
    cfg = EngineConfig(model=str(model), dtype="float32", device="cpu")
    kv = _kv()
    base = namespace_for(cfg, kv).key
    assert namespace_for(cfg, _kv()).key == base  # same model, same settings: the same namespace
    keys = {
        namespace_for(EngineConfig(model=str(model), dtype="bfloat16", device="cpu"), kv).key,
        namespace_for(cfg, KVCache.uniform(2, 12, 8, 2, 4, torch.float32, "cpu")).key,  # page size
        namespace_for(cfg, KVCache.uniform(2, 12, PS, 2, 4, torch.bfloat16, "cpu")).key,  # KV dtype
        # the default CPU pool (fp16) against --exact-cpu's or an older release's fp32 one: never read as the other
        namespace_for(cfg, KVCache.uniform(2, 12, PS, 2, 4, torch.float16, "cpu")).key,
        namespace_for(cfg, KVCache.uniform(3, 12, PS, 2, 4, torch.float32, "cpu")).key,  # layout
        namespace_for(cfg, kv, tp=2).key,
        namespace_for(EngineConfig(model=str(model), dtype="float32", device="cpu", exact_cpu=True), kv).key,
    }
    (model / "tokenizer_config.json").write_text('{"chat_template": "b"}')  # another chat template
    keys.add(namespace_for(cfg, kv).key)
    (model / "model.safetensors").write_bytes(b"v" * 65)  # other weights
    keys.add(namespace_for(cfg, kv).key)
    assert base not in keys and len(keys) == 9


def test_a_garbled_index_is_rebuilt_from_the_chunks_headers(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    kv = _kv()
    cache = _cache(tmp_path, kv)
    data = _compute(cache, kv, list(range(2 * PS)))
    cache.evict(2)
    cache.persist(5.0)
    for garbage in ("{not json", '{"chunks": 3}', "\x00\xff" * 10):
        caplog.clear()
        (tmp_path / "ns" / "index.json").write_text(garbage)
        kv2 = _kv()
        again = _cache(tmp_path, kv2)
        assert "index rebuilt from the chunks' own headers: 1 chunks (2 pages" in caplog.text
        assert again.stats().disk_pages == 2 and again.stats().disk_torn == 0
        lock = again.lock(again.match(list(range(2 * PS + 1))))
        got = _pages_of(kv2, lock.pages)
        assert lock.num_tokens == 2 * PS
        assert all(torch.equal(a, b) for i in range(2) for a, b in zip(data[i], got[i], strict=True))
        again.release(lock.pages)
    # An entry of the wrong shape is refused, logged and counted; its file is adopted from its own header.
    (tmp_path / "ns" / "index.json").write_text('{"chunks": [{"name": 1}]}')
    again = _cache(tmp_path, _kv())
    assert again.stats().disk_pages == 2 and "1 index entries refused" in caplog.text


def test_an_entry_naming_a_path_outside_is_refused_and_nothing_outside_is_deleted(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    victim = tmp_path / "victim.kv"
    victim.write_bytes(b"the user's file")
    kv = _kv()
    cache = _cache(tmp_path / "root", kv, budget=3 * kv.page_bytes)
    _compute(cache, kv, list(range(2 * PS)))
    cache.persist(5.0)
    index = tmp_path / "root" / "ns" / "index.json"
    raw = json.loads(index.read_text())
    evil = {**raw["chunks"][0], "name": "../../../victim", "used": 0.0}
    index.write_text(json.dumps({"chunks": [evil, *raw["chunks"]]}))
    again = _cache(tmp_path / "root", _kv(), budget=3 * kv.page_bytes)
    assert "refused '../../../victim'" in caplog.text or "1 index entries refused" in caplog.text
    for j in range(3):  # the budget makes room: only this tier's own chunks go
        _compute(again, again.kv, list(range(100 * (j + 1), 100 * (j + 1) + 2 * PS)))  # type: ignore[arg-type]
        again.evict(2)
    again.disk.tier.clear()  # type: ignore[union-attr]
    assert victim.read_bytes() == b"the user's file"


def test_sessions_come_back_under_their_ids_on_disk(tmp_path: Path) -> None:
    kv = _kv()
    cache = _cache(tmp_path, kv)
    toks = list(range(40, 40 + 5 * PS))
    pages = cache.reserve(5)
    assert pages is not None
    cache.insert(toks, pages, "agent-7")
    cache.end_turn("agent-7")
    cache.persist(5.0)
    again = _cache(tmp_path, _kv())
    assert again.restore_sessions() == 1 and "agent-7" in again.sessions
    assert again.session_pages("agent-7")[Tier.DISK] == 5 and again.stats().disk_sessions == 1
    m = again.match([*toks, 1, 2])  # no id: the request is recognised by its history on disk
    assert m.session == "agent-7" and on_disk(m) == 5 * PS
    assert again.match(toks[: 3 * PS]).session is None  # a prefix of it is not its next turn
    again.lock(m)
    assert again.session_pages("agent-7") == {Tier.GPU: 5, Tier.HOST: 0, Tier.DISK: 0}  # back: not "on disk"
    again.check_integrity()


def test_a_finished_turn_is_written_behind_and_survives_a_crash(tmp_path: Path) -> None:
    """A turn's end queues its new pages to the writer thread (no eviction, no graceful stop): a new cache over
    the same directory, started as after a kill -9, finds them, the ones indexed and the ones adopted from their
    headers alike; the next turn writes only its new pages."""
    kv = _kv(16)
    cache = _cache(tmp_path, kv)
    turn1 = list(range(40, 40 + 5 * PS))
    data = _compute(cache, kv, turn1, "agent")
    cache.end_turn("agent")
    turn2 = [*turn1, *range(90, 90 + 3 * PS)]
    data.update({i: d for i, d in _compute(cache, kv, turn2, "agent").items() if i >= 5})
    cache.end_turn("agent")
    tier = cache.disk.tier  # type: ignore[union-attr]
    assert tier.writer.wait(30)
    stats = cache.stats()
    assert stats.disk_written_behind == 8 and stats.disk_pages == 8 and stats.disk_queued == 0
    assert stats.gpu_pages == 8  # nothing was evicted: every page is still in memory too
    # No persist, and an index that names the first chunk alone (as a crash within INDEX_EVERY_S of the second
    # write leaves it): the second is adopted from its own header.
    index = tmp_path / "ns" / "index.json"
    first = json.loads(index.read_text())["chunks"][:1]
    index.write_text(json.dumps({"chunks": first}))
    again = _cache(tmp_path, _kv(16))
    assert again.restore_sessions() == 1  # the session table was written behind too
    assert again.sessions.get("agent").last_sequence_tokens == 8 * PS  # type: ignore[union-attr]
    m = again.match([*turn2, 1])  # no id: recognised by its history on disk, as after a graceful stop
    assert m.session == "agent" and on_disk(m) == 8 * PS
    got = _pages_of(again.kv, again.lock(m).pages)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for i in range(8) for a, b in zip(data[i], got[i], strict=True))
    again.check_integrity()


def test_write_behind_drops_the_oldest_queued_write_when_the_disk_falls_behind(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, "ns", {}, page_bytes=8, budget_bytes=1 << 20)
    gate = threading.Event()
    real = disk_writer.write_chunk

    def slow(w: disk_writer.Write, tmp_suffix: str = ".wb.tmp") -> None:
        gate.wait(30)  # a disk that does not keep up
        real(w, tmp_suffix)

    tier.writer.queue_bytes = 16  # two pages queued at most
    hs = [bytes([i]) * 16 for i in range(1, 5)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(disk_writer, "write_chunk", slow)
        assert tier.write_behind(hs[:1], b"A" * 8)  # taken by the thread at once, then held there
        deadline = time.monotonic() + 10
        while tier.writer.pending and len(tier.writer._queue) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tier.write_behind(hs[1:2], b"B" * 8) and tier.write_behind(hs[2:3], b"C" * 8)
        assert tier.write_behind(hs[3:4], b"D" * 8)  # the queue is full: B, the oldest queued, goes
        assert not tier.has(hs[1]) and all(tier.has(h) for h in (hs[0], hs[2], hs[3]))
        gate.set()
        assert tier.finish_writes(30)
    assert tier.writer.dropped == 1 and tier.num_pages == 3 and hs[1].hex() not in tier.pages


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_page_bytes_round_trip_bf16_exact(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    kv = KVCache.uniform(3, 6, PS, 2, 8, torch.bfloat16, device)
    for t in (*kv.k, *kv.v):
        t.copy_(torch.randn(t.shape).to(torch.bfloat16))
    blob = pages_to_bytes(kv, [4, 1])
    assert len(blob) == 2 * kv.page_bytes
    out = KVCache.uniform(3, 6, PS, 2, 8, torch.bfloat16, device)
    bytes_to_pages(out, [2, 5], [blob[: kv.page_bytes], blob[kv.page_bytes :]])
    for a, b in zip((*kv.k, *kv.v), (*out.k, *out.v), strict=True):
        assert torch.equal(a[4 * PS : 5 * PS], b[2 * PS : 3 * PS]) and torch.equal(a[PS : 2 * PS], b[5 * PS : 6 * PS])


def test_pages_of_mixed_layer_shapes_round_trip() -> None:
    # Gemma 4 / MLA pools: layers differ in heads and head sizes, and a tied layer's V is its K (stored once).
    specs = [KVLayerSpec(2, 4), KVLayerSpec(1, 8, tied=True), KVLayerSpec(1, 6, v_head_dim=3)]
    kv = KVCache(specs, 6, PS, torch.float32, "cpu")
    for t in kv.tensors():
        t.copy_(torch.randn(t.shape))
    blob = pages_to_bytes(kv, [4, 1])
    assert len(blob) == 2 * kv.page_bytes == 2 * PS * 4 * (2 * 4 * 2 + 8 + 6 + 3)
    out = KVCache(specs, 6, PS, torch.float32, "cpu")
    bytes_to_pages(out, [2, 5], [blob[: kv.page_bytes], blob[kv.page_bytes :]])
    assert out.v[1] is out.k[1]
    for a, b in zip(kv.tensors(), out.tensors(), strict=True):
        assert torch.equal(a[4 * PS : 5 * PS], b[2 * PS : 3 * PS]) and torch.equal(a[PS : 2 * PS], b[5 * PS : 6 * PS])
