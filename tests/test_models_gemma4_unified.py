"""Gemma 4 12B (`gemma4_unified`, tests/gemma4_models.py `unified_config`) against transformers with the same random
weights, loaded by our loader from save_pretrained output of the unified audio / vision / text checkpoint: the
embedders are skipped and named, the text model is Gemma 4's (sliding rings, K=V global layers in pages): prefill,
chunked prefill and decode past the 8-token window, a ragged batch, greedy through the engine at tp 1 and 2, and a
session resumed past the window."""

from __future__ import annotations

import logging

import pytest
import torch
from gemma4_models import WINDOW, save_gemma4, unified_config
from hybrid_models import hf_greedy, hf_logits
from model_harness import PagedRunner

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.layers.backends.base import KVLayerSpec
from agentbox.layers.cache_layout import StateGroup
from agentbox.layers.window_kv import WindowKVSpec
from agentbox.models.loader import load_model

LONG = [(i * 37 + 11) % 256 for i in range(40)]
PROMPT = [5, 17, 200, 3, 99, 42, 7, 128, 64, 1, 250, 33, 8]
ATOL = 2e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("gemma4-unified")
    hf = save_gemma4(unified_config(), path)
    return path, hf, load_model(str(path), torch.float32, "cpu")


def test_prefill_chunks_and_decode_past_window(tiny) -> None:  # noqa: ANN001
    _, hf, ours = tiny
    expected = hf_logits(hf, LONG)
    torch.testing.assert_close(PagedRunner(ours, page_size=4).step({0: LONG})[0], expected, atol=ATOL, rtol=ATOL)
    runner = PagedRunner(ours, page_size=4)
    out = [runner.step({0: LONG[:13]})[0], runner.step({0: LONG[13:30]})[0]]
    out += [runner.step({0: [t]})[0] for t in LONG[30:]]
    torch.testing.assert_close(torch.cat(out), expected, atol=ATOL, rtol=ATOL)


def test_ragged_batch_and_layout(tiny) -> None:  # noqa: ANN001
    _, hf, ours = tiny
    assert ours.kv_specs == [KVLayerSpec(1, 32)] * 2
    assert ours.layout.state == StateGroup((WindowKVSpec(2, 16, WINDOW),) * 2)
    runner = PagedRunner(ours, page_size=4)
    runner.step({0: LONG[:20]})
    got = runner.step({0: LONG[20:21], 1: PROMPT})
    torch.testing.assert_close(got[0], hf_logits(hf, LONG[:21])[20:], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got[1], hf_logits(hf, PROMPT), atol=ATOL, rtol=ATOL)


def test_embedders_skipped_and_named(tmp_path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    save_gemma4(unified_config(), tmp_path)
    with caplog.at_level(logging.INFO, logger="agentbox.models.weight_loader"):
        load_model(str(tmp_path), torch.float32, "cpu")
    for name in ("'model.vision_embedder.'", "'model.embed_vision.'", "'model.embed_audio.'"):
        assert name in caplog.text, name


def test_engine_greedy_and_session_past_window(tiny) -> None:  # noqa: ANN001
    path, hf, ours = tiny
    llm = LLM(EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch"), loaded=ours)
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [PROMPT, LONG[:30]]
    assert [o.token_ids for o in llm.generate(prompts, sp)] == [hf_greedy(hf, p, 8) for p in prompts]
    history, previous = LONG[:24], 0
    for turn in range(3):
        out = llm.generate([history], sp, session_ids=["s"])[0]
        assert out.token_ids == hf_greedy(hf, history, 8), turn
        if turn:
            assert out.num_cached_tokens >= 0.9 * previous, (turn, out.num_cached_tokens, previous)
        previous = len(history) + 8
        history = history + out.token_ids + [(turn * 13 + k) % 256 for k in range(5)]


@pytest.mark.slow
def test_tp2_greedy_matches_transformers(tiny) -> None:  # noqa: ANN001
    path, hf, _ = tiny
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", num_pages=64, page_size=4,
                          tensor_parallel_size=2, cpu_threads=1, max_num_batched_tokens=16)
    with LLM(config) as llm:
        out = llm.generate([LONG[:30]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(hf, LONG[:30], 6)
