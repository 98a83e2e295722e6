"""Nemotron-H against transformers (its torch fallback: the chunked scan and the recurrent step) with the same
random weights (tests/nemotron_h_models.py), loaded by our loader from save_pretrained output: a prefill, a chunked
prefill across scan chunks and decodes, a ragged batch, the layout (attention KV paged, Mamba state per sequence),
greedy through the engine at tp 1 and 2, and a session resumed from its turn-end snapshot."""

from __future__ import annotations

import pytest
import torch
from model_harness import PagedRunner
from nemotron_h_models import configs, hf_greedy, hf_logits, save_nemotron_h

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.layers.backends.base import KVLayerSpec
from agentbox.layers.cache_layout import StateGroup
from agentbox.layers.mamba2 import Mamba2StateSpec
from agentbox.models.loader import load_model

LONG = [(i * 37 + 11) % 256 for i in range(40)]
PROMPT = [5, 17, 200, 3, 99, 42, 7, 128, 64, 1, 250, 33, 8]
ATOL = 2e-4


@pytest.fixture(scope="module", params=list(configs()))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(f"nemotron-h-{request.param}")
    hf = save_nemotron_h(path, configs()[request.param])
    return request.param, path, hf, load_model(str(path), torch.float32, "cpu")


def test_prefill_chunks_and_decode(tiny) -> None:  # noqa: ANN001
    """One prefill (5 scan chunks), then chunks of 13 and 17 (neither on a scan chunk's edge) and decodes."""
    _, _, hf, ours = tiny
    expected = hf_logits(hf, LONG)
    torch.testing.assert_close(PagedRunner(ours, page_size=4).step({0: LONG})[0], expected, atol=ATOL, rtol=ATOL)
    runner = PagedRunner(ours, page_size=4)
    out = [runner.step({0: LONG[:13]})[0], runner.step({0: LONG[13:30]})[0]]
    out += [runner.step({0: [t]})[0] for t in LONG[30:]]
    torch.testing.assert_close(torch.cat(out), expected, atol=ATOL, rtol=ATOL)


def test_ragged_batch_equals_each_alone(tiny) -> None:  # noqa: ANN001
    _, _, hf, ours = tiny
    runner = PagedRunner(ours, page_size=4)
    runner.step({0: LONG[:20], 3: LONG[3:6]})
    got = runner.step({0: LONG[20:21], 1: PROMPT, 2: LONG[5:8], 3: LONG[6:7]})
    torch.testing.assert_close(got[0], hf_logits(hf, LONG[:21])[20:], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got[1], hf_logits(hf, PROMPT), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got[2], hf_logits(hf, LONG[5:8]), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got[3], hf_logits(hf, LONG[3:7])[3:], atol=ATOL, rtol=ATOL)


def test_layout_pages_attention_and_keeps_mamba_state(tiny) -> None:  # noqa: ANN001
    """The attention layer keeps 2 KV heads x 16 per token in pages; each Mamba layer its conv (the last 3 inputs
    of 64 + 2 x 2 x 16 channels) and a 16-wide state per head and head channel, per sequence."""
    _, _, _, ours = tiny
    assert ours.kv_specs == [KVLayerSpec(2, 16)]
    assert ours.layout.state == StateGroup((Mamba2StateSpec(128, 3, 8, 8, 16),) * 2)


def test_engine_greedy_and_session_resume(tiny) -> None:  # noqa: ANN001
    _, path, hf, ours = tiny
    llm = LLM(EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch", max_num_batched_tokens=16),
              loaded=ours)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [PROMPT, LONG[:30], [3, 1, 4, 1, 5]]
    assert [o.token_ids for o in llm.generate(prompts, sp)] == [hf_greedy(hf, p, 10) for p in prompts]
    history, previous = LONG[:24], 0
    for turn in range(3):
        out = llm.generate([history], sp, session_ids=["s"])[0]
        assert out.token_ids == hf_greedy(hf, history, 10), turn
        if turn:
            assert out.num_cached_tokens >= 0.9 * previous, (turn, out.num_cached_tokens, previous)
        previous = len(history) + 10
        history = history + out.token_ids + [(turn * 13 + k) % 256 for k in range(5)]


@pytest.mark.slow
def test_tp2_greedy_matches_transformers(tiny) -> None:  # noqa: ANN001
    """Two gloo ranks: each takes half the Mamba heads and one group, one KV head and half the query heads, half of
    every expert and MLP; chunked prompts beside decodes, and a session's later turn resumed on both ranks."""
    _, path, hf, _ = tiny
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", num_pages=64, page_size=4,
                          tensor_parallel_size=2, cpu_threads=1, max_num_batched_tokens=16)
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(config) as llm:
        outs = llm.generate([PROMPT, LONG[:30]], sp)
        history = LONG[:24]
        first = llm.generate([history], sp, session_ids=["s"])[0]
        history = history + first.token_ids + [7, 9, 11]
        second = llm.generate([history], sp, session_ids=["s"])[0]
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in (PROMPT, LONG[:30])]
    assert second.token_ids == hf_greedy(hf, history, 6)
    assert second.num_cached_tokens >= 24 + 6 - 4, second.num_cached_tokens
