"""Gemma 4 against transformers with the same random weights (tests/gemma4_models.py), loaded by our loader
from save_pretrained output: prefill, chunked prefill and decode past the 8-token window, a ragged batch,
per-layer KV shapes in the pool, greedy through the engine at tp 1 and tp 2."""

from __future__ import annotations

import logging

import pytest
import torch
from gemma4_models import WINDOW, configs, save_gemma4
from hybrid_models import hf_greedy, hf_logits
from model_harness import PagedRunner

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.layers.backends.base import KVCache, KVLayerSpec
from agentbox.layers.cache_layout import StateGroup
from agentbox.layers.window_kv import WindowKVSpec
from agentbox.models.loader import load_model

LONG = [(i * 37 + 11) % 256 for i in range(40)]
PROMPT = [5, 17, 200, 3, 99, 42, 7, 128, 64, 1, 250, 33, 8]
ATOL = 2e-4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(configs()))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(f"gemma4-{request.param}")
    hf = save_gemma4(configs()[request.param], path)
    return request.param, path, hf, load_model(str(path), torch.float32, "cpu")


def test_prefill_chunks_and_decode_past_window(tiny) -> None:  # noqa: ANN001
    """Chunks of 13 and 17 (both cut the window), then decodes to 3 windows past the start."""
    _, _, hf, ours = tiny
    runner = PagedRunner(ours, page_size=4)
    out = [runner.step({0: LONG[:13]})[0], runner.step({0: LONG[13:30]})[0]]
    out += [runner.step({0: [t]})[0] for t in LONG[30:]]
    torch.testing.assert_close(torch.cat(out), hf_logits(hf, LONG), atol=ATOL, rtol=ATOL)


def test_ragged_batch_equals_each_alone(tiny) -> None:  # noqa: ANN001
    """A prefill chunk, a short prompt and a decode past the window in the same steps (padded keys, windows
    and the global layers' own head size in one gather)."""
    _, _, hf, ours = tiny
    runner = PagedRunner(ours, page_size=4)
    runner.step({0: LONG[:20]})
    got = runner.step({0: LONG[20:21], 1: PROMPT, 2: LONG[5:8]})
    torch.testing.assert_close(got[0], hf_logits(hf, LONG[:21])[20:], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got[1], hf_logits(hf, PROMPT), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got[2], hf_logits(hf, LONG[5:8]), atol=ATOL, rtol=ATOL)


def test_pool_holds_global_layers_rings_hold_sliding(tiny) -> None:  # noqa: ANN001
    """Global layers: pages of 1 KV head x 32 (K=V projection, dense) or 2 (MoE); sliding layers: a ring of the
    window's 8 positions x 2 KV heads x 16 per sequence, outside the pool."""
    kind, _, _, ours = tiny
    assert ours.num_layers == 2 and ours.kv_specs == [KVLayerSpec(1 if kind == "dense" else 2, 32)] * 2
    assert ours.layout.state == StateGroup((WindowKVSpec(2, 16, WINDOW),) * 2)  # the runner adds a page of slack


def test_towers_skipped_and_named(tmp_path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    save_gemma4(configs()["dense"], tmp_path)
    with caplog.at_level(logging.INFO, logger="agentbox.models.weight_loader"):
        load_model(str(tmp_path), torch.float32, "cpu")
    assert "'model.vision_tower.'" in caplog.text and "vision tower" in caplog.text


def test_engine_greedy_matches_transformers(tiny) -> None:  # noqa: ANN001
    _, path, hf, ours = tiny
    llm = LLM(EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch"), loaded=ours)
    prompts = [PROMPT, LONG[:30], [3, 1, 4, 1, 5]]
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


def test_session_turns_past_window_reuse_and_pool_bytes(tiny) -> None:  # noqa: ANN001
    """Three turns of one session, each far past the window: turn N+1 resumes turn N (>= 90 % cached: the global
    layers' pages from the radix cache, the sliding rings from the session's snapshot), every answer equals
    transformers' cold run, and the KV in use (stats: used pages x page bytes) has no sliding layer in it."""
    _, path, hf, ours = tiny
    llm = LLM(EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch"), loaded=ours)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    history, previous = LONG[:24], 0
    for turn in range(3):
        out = llm.generate([history], sp, session_ids=["s"])[0]
        assert out.token_ids == hf_greedy(hf, history, 6), turn
        if turn:
            assert out.num_cached_tokens >= 0.9 * previous, (turn, out.num_cached_tokens, previous)
        previous = len(history) + 6
        history = history + out.token_ids + [(turn * 13 + k) % 256 for k in range(5)]
    # The pool's pages hold the global layers only: every layer in pages would take the sliding share more.
    pool = llm.core.stats().pool
    assert ours.layout.state is not None
    rings = ours.layout.state.specs
    kv_dtype = llm.core.runner.kv_dtype  # fp16: the default CPU pool
    sliding = KVCache.bytes_per_page([KVLayerSpec(s.num_kv_heads, s.head_dim) for s in rings], 4, kv_dtype)
    every_layer = KVCache.bytes_per_page(ours.kv_specs, 4, kv_dtype) + sliding
    assert pool.used_pages > 0 and pool.page_bytes == every_layer - sliding


@pytest.mark.slow
def test_tp2_greedy_matches_transformers(tiny) -> None:  # noqa: ANN001
    """Two gloo ranks: sliding layers split their 2 KV heads, global ones replicate their 1 KV head (dense)."""
    kind, path, hf, _ = tiny
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", num_pages=64, page_size=4,
                          tensor_parallel_size=2, cpu_threads=1, max_num_batched_tokens=16)
    with LLM(config) as llm:  # 30 tokens in 16-token chunks, then decodes past the window
        out = llm.generate([LONG[:30]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, LONG[:30], 6)
