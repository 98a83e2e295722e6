"""Gemma 4's sliding-window rings in the engine: what it allocates (one ring of window + a page per running
request and per snapshot, no page-aligned copies), a new session resuming at a prefix another session sent
(rings from a shared snapshot, global layers from the radix cache), answering as a cold run does."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from gemma4_models import WINDOW, configs, save_gemma4
from hybrid_models import hf_greedy

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams

PREFIX = [(i * 13 + 5) % 256 for i in range(100)]  # the shared system prompt + tools: 6 whole pages and 4 tokens
SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PAGE, ROWS, SNAPSHOTS = 16, 3, 8  # room for 4 sessions' snapshots and the shared prefix's (a full store drops it first)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LLM, torch.nn.Module]]:
    path: Path = tmp_path_factory.mktemp("gemma4-rings")
    hf = save_gemma4(configs()["dense"], path)
    config = EngineConfig(model=str(path), page_size=PAGE, attention="torch", num_pages=128, host_cache_gb=0.0,
                          max_num_seqs=ROWS, state_snapshots=SNAPSHOTS)
    with LLM(config) as llm:
        yield llm, hf


def test_one_ring_per_running_request_and_per_snapshot(gemma: tuple[LLM, torch.nn.Module]) -> None:
    """2 sliding layers x K and V x (window 8 + a page of 16) positions x 2 KV heads x 16, fp32: per slot; slots
    are the running requests (no extra row, no page-aligned copy) and the snapshots."""
    llm, _ = gemma
    state = llm.core.runner.state_cache
    assert state is not None
    ring = 2 * 2 * (WINDOW + PAGE) * 2 * 16 * 4
    assert state.slot_bytes() == ring and state.num_slots == ROWS + SNAPSHOTS
    assert sum(t.nbytes for layer in state.layers for t in layer) == (ROWS + SNAPSHOTS) * ring


def test_new_session_resumes_at_the_shared_prefix(gemma: tuple[LLM, torch.nn.Module]) -> None:
    llm, hf = gemma
    tails = [[(seed * 37 + k * 11) % 256 for k in range(20)] for seed in range(4)]
    prompts = {f"agent{i}": PREFIX + tail for i, tail in enumerate(tails)}
    outs = {name: llm.generate([p], SP, session_ids=[name])[0] for name, p in prompts.items()}
    for name, out in outs.items():
        assert out.token_ids == hf_greedy(hf, prompts[name], 6), name  # a resumed ring never changes an answer
    # agent0: nothing known. agent1: the tree knows agent0's 96 tokens of the prefix but no ring there, so it
    # computes them and keeps its rings at 96. agent2 and agent3 resume there.
    assert [outs[n].num_cached_tokens for n in prompts] == [0, 0, 96, 96]
    snaps = llm.core.stats().snapshots
    assert snaps is not None and snaps.hits == 2
    llm.core.check_integrity()
