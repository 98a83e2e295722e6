"""Gemma 4's sliding-window rings in the engine: what it allocates (one ring of window + a page per running
request and per snapshot, no page-aligned copies; snapshots in host memory on a small card), a new session
resuming at a prefix another session sent (rings from a shared snapshot, global layers from the radix cache),
answering as a cold run does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gemma4_models import WINDOW, configs, save_gemma4
from hybrid_models import hf_greedy

from agentbox.config import EngineConfig
from agentbox.engine.exec import memory_budget
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.layers.recurrent_state import StateCache
from agentbox.layers.window_kv import WindowKVSpec

PREFIX = [(i * 13 + 5) % 256 for i in range(100)]  # the shared system prompt + tools: 6 whole pages and 4 tokens
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PAGE, ROWS, SNAPSHOTS = 16, 3, 8  # room for 4 sessions' snapshots and the shared prefix's (a full store drops it first)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLM, torch.nn.Module]]:
    """Every snapshot held in the host-memory slots a small card uses (the runner's sizing, which puts them
    there only on a GPU, replaced; on a CPU they are separate tensors in the same memory)."""
    path: Path = tmp_path_factory.mktemp("gemma4-rings")
    hf = save_gemma4(configs()["dense"], path)
    config = EngineConfig(model=str(path), page_size=PAGE, attention="torch", num_pages=128, host_cache_gb=0.0,
                          host_state_snapshots=0,
                          max_num_seqs=ROWS, state_snapshots=SNAPSHOTS)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory_budget, "fit_state_slots", lambda r, per_row, per_slot: r.num_snapshots)
        llm = LLM(config)
    with llm:
        yield llm, hf


def test_one_ring_per_running_request_and_per_snapshot(gemma: tuple[LLM, torch.nn.Module]) -> None:
    """2 sliding layers x K and V x (window 8 + a page of 16) positions x 2 KV heads x 16, fp32: per slot; slots
    are the running requests (no extra row, no page-aligned copy) and the snapshots (here all held)."""
    llm, _ = gemma
    state = llm.core.runner.state_cache
    assert state is not None
    ring = 2 * 2 * (WINDOW + PAGE) * 2 * 16 * 4
    assert state.slot_bytes() == ring and (state.num_slots, state.num_host) == (ROWS, SNAPSHOTS)
    assert sum(t.nbytes for layer in state.layers for t in layer) == ROWS * ring
    assert sum(t.nbytes for layer in state.host_layers for t in layer) == SNAPSHOTS * ring


def test_new_session_resumes_at_the_shared_prefix(gemma: tuple[LLM, torch.nn.Module]) -> None:
    llm, hf = gemma
    tails = [[(seed * 37 + k * 11) % 256 for k in range(20)] for seed in range(4)]
    prompts = {f"agent{i}": PREFIX + tail for i, tail in enumerate(tails)}
    outs = {name: llm.generate([p], SP, session_ids=[name])[0] for name, p in prompts.items()}
    for name, out in outs.items():
        assert out.token_ids == hf_greedy(hf, prompts[name], 6), name  # a resumed ring never changes an answer
    # agent0: nothing known. agent1: the tree knows agent0's 96 tokens of the prefix, and agent0's prompt snapshot
    # (its rings exactly at 112, with a page of slack) resumes a page back, at 96; so do agent2's and agent3's.
    assert [outs[n].num_cached_tokens for n in prompts] == [0, 96, 96, 96]
    snaps = llm.core.stats().snapshots
    assert snaps is not None and snaps.hits == 3
    llm.core.check_integrity()


def test_held_snapshot_slots_copy_through_host_memory() -> None:
    """Slots past the device's are held in host memory: a ring saved there and seeded back is the same ring."""
    spec = WindowKVSpec(2, 16, WINDOW, slack=PAGE)
    state = StateCache([spec, spec], 2, torch.float32, "cpu", num_host=2)
    assert all(t.shape[0] == 2 for layer in state.host_layers for t in layer)
    for layer in state.layers:
        for t in layer:
            t.normal_()
    before = [t[0].clone() for layer in state.layers for t in layer]
    state.copy([0, 3, 1], [3, 1, 0])  # slot 0 to host slot 3, back into slot 1; slot 1's old state into slot 0
    assert all(torch.equal(t[1], b) for t, b in zip((t for layer in state.layers for t in layer), before, strict=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_small_card_keeps_snapshots_in_host_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A card with room for the running requests' rings only: the snapshots go to host memory, and a new session
    still resumes at the shared prefix with the answer of a cold run."""
    hf = save_gemma4(configs()["dense"], tmp_path)
    ring = 2 * 2 * (WINDOW + PAGE) * 2 * 16 * 4
    free = torch.cuda.mem_get_info()[0]
    monkeypatch.setattr(memory_budget, "GPU_STATE_SHARE", 2.5 * ring / free)  # two rings' room: the rows, no snapshot
    config = EngineConfig(model=str(tmp_path), device="cuda", dtype="float32", page_size=PAGE, attention="torch",
                          num_pages=128, host_cache_gb=0.0, max_num_seqs=2, state_snapshots=8,
                          host_state_snapshots=0)
    with LLM(config) as llm:
        state = llm.core.runner.state_cache
        assert state is not None and state.num_slots == 2 and state.num_host == 8
        assert state.host_layers[0][0].is_pinned()
        prompts = [PREFIX + [(seed * 37 + k * 11) % 256 for k in range(20)] for seed in range(3)]
        outs = [llm.generate([p], SP, session_ids=[f"agent{i}"])[0] for i, p in enumerate(prompts)]
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]  # transformers on the CPU
    assert [o.num_cached_tokens for o in outs] == [0, 0, 96]
