"""A session of a model with per-sequence state survives a restart (issue 26): its state snapshots go to the
disk tier beside its pages. Hybrid: two sessions on the tiny Qwen3.5 (Gated DeltaNet + gated attention) in a store of two snapshots: the
second session's snapshots push the first's out of memory (written to disk as they leave), a graceful stop
writes the rest; a new engine over the same state directory resumes the first session's next turn from disk
(>= 90 % cached); the second's own pages are torn on disk (the shared prefix's are not), so it computes from
the start (its state would resume at the wrong place after the shorter prefix); each answer equals transformers' cold greedy run. Gemma 4 (sliding-window rings as
its state): one session, the same after a graceful stop."""

from __future__ import annotations

from pathlib import Path

import pytest
from gemma4_models import configs as gemma4_configs
from gemma4_models import save_gemma4
from hybrid_models import configs, hf_greedy, save_hybrid

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams

ANSWER = 4


def test_a_hybrid_session_survives_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path / "home"))
    hf = save_hybrid(configs()["qwen3_5"], tmp_path / "model")
    config = EngineConfig(model=str(tmp_path / "model"), page_size=16, attention="torch", num_pages=64,
                          max_num_seqs=2, host_cache_gb=0.0, disk_cache_gb=0.05, state_snapshots=2, cpu_threads=1)
    sp = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
    shared = [(i * 17 + 3) % 256 for i in range(64)]  # a system prompt both send: a chunk of its own on disk
    history = {s: shared + [(k * 31 + i * 13 + 5) % 256 for i in range(136)] for k, s in enumerate(("a", "b"))}
    with LLM(config) as llm:
        for s, h in history.items():  # one after the other: b's snapshots push a's out of the store
            history[s] = h + llm.generate([h], sp, session_ids=[s])[0].token_ids + [7, 8, 9, 10, 11]
        disk = llm.core.cache.state_group.disk
        assert disk is not None and disk.written >= 1  # a's, written as it left memory
        llm.core.persist()  # a graceful stop: b's (and the pages)
        assert disk.written >= 2
        tier = disk.tier
        b_pages = tier.find(tuple(history["b"]), 16, 0)
    torn = tier.chunks_dir / f"{b_pages[-1][1].chunk}.kv"  # b's pages come back short: its state is useless
    assert b_pages[0][1].chunk != b_pages[-1][1].chunk  # the shared part still reads: a lock short of the state
    torn.write_bytes(b"\0" * torn.stat().st_size)
    with LLM(config) as llm:
        for s, h in history.items():
            out = llm.generate([h], sp, session_ids=[s])[0]
            if s == "a":
                assert out.num_cached_tokens >= 0.9 * len(h), (out.num_cached_tokens, len(h))
            else:  # computed from the start, never resumed at the wrong place
                assert out.num_cached_tokens < 16 * len(b_pages)
            assert out.token_ids == hf_greedy(hf, h, ANSWER), s
        disk = llm.core.cache.state_group.disk
        assert disk is not None and disk.restored == 2
        stats = llm.core.cache.stats()
        assert stats.disk_restored > 0 and stats.disk_states >= 2 and stats.disk_torn == 1


def test_a_hybrid_session_survives_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No graceful stop: each turn's pages and state snapshot were written behind at its end (disk_states.py,
    radix_disk.py), so a new engine over the same directory (as after kill -9) resumes the session from disk."""
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path / "home"))
    hf = save_hybrid(configs()["qwen3_5"], tmp_path / "model")
    config = EngineConfig(model=str(tmp_path / "model"), page_size=16, attention="torch", num_pages=64,
                          max_num_seqs=2, host_cache_gb=0.0, disk_cache_gb=0.05, state_snapshots=2, cpu_threads=1)
    sp = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
    h = [(i * 29 + 7) % 256 for i in range(140)]
    with LLM(config) as llm:
        for turn in range(2):  # each turn ends on a new page boundary: a new turn snapshot each
            h = h + llm.generate([h], sp, session_ids=["a"])[0].token_ids + [(turn * 7 + i) % 256 for i in range(12)]
        disk = llm.core.cache.state_group.disk
        assert disk is not None and disk.written == 2 and disk.tier.writer.wait(60)  # the turns' snapshots
        assert llm.core.cache.stats().evictions == 0  # nothing left memory: only the write-behind wrote
    with LLM(config) as llm:  # no persist: what a kill -9 leaves
        out = llm.generate([h], sp, session_ids=["a"])[0]
        assert out.num_cached_tokens >= 0.9 * len(h), (out.num_cached_tokens, len(h))
        assert out.token_ids == hf_greedy(hf, h, ANSWER)
        assert llm.core.cache.state_group.disk.restored == 1  # type: ignore[union-attr]


def test_a_gemma4_session_survives_a_restart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path / "home"))
    name, gemma = next(iter(gemma4_configs().items()))
    hf = save_gemma4(gemma, tmp_path / name)
    config = EngineConfig(model=str(tmp_path / name), page_size=4, attention="torch", num_pages=64, max_num_seqs=2,
                          host_cache_gb=0.0, disk_cache_gb=0.05, cpu_threads=1)
    sp = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
    history = [(i * 37 + 11) % 256 for i in range(40)]  # far past the 8-token window
    with LLM(config) as llm:
        history += llm.generate([history], sp, session_ids=["s"])[0].token_ids + [7, 8, 9]
        llm.core.persist()
    with LLM(config) as llm:
        out = llm.generate([history], sp, session_ids=["s"])[0]
        disk = llm.core.cache.state_group.disk
    assert out.num_cached_tokens >= 0.9 * len(history), (out.num_cached_tokens, len(history))
    assert out.token_ids == hf_greedy(hf, history, ANSWER)
    assert disk is not None and disk.restored == 1
