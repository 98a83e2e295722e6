"""Laguna against transformers with the same random weights (tests/laguna_models.py), loaded by our loader from
save_pretrained output: prefill, chunked prefill and decode past the 8-token window, a ragged batch, the pool
holding the global layer only (sliding layers in rings), both checkpoint layouts of the experts, greedy through
the engine at tp 1 and a session resumed past the window."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from laguna_models import WINDOW, configs, hf_greedy, hf_logits, save_laguna, tiny_config
from model_harness import PagedRunner
from safetensors.torch import load_file, save_file

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
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=list(configs()))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(f"laguna-{request.param}")
    hf = save_laguna(path, configs()[request.param])
    return request.param, path, hf, load_model(str(path), torch.float32, "cpu")


def test_prefill_chunks_and_decode_past_window(tiny) -> None:  # noqa: ANN001
    """One prefill, then chunks of 13 and 17 (both cut the window) and decodes to 3 windows past the start."""
    _, _, hf, ours = tiny
    expected = hf_logits(hf, LONG)
    torch.testing.assert_close(PagedRunner(ours, page_size=4).step({0: LONG})[0], expected, atol=ATOL, rtol=ATOL)
    runner = PagedRunner(ours, page_size=4)
    out = [runner.step({0: LONG[:13]})[0], runner.step({0: LONG[13:30]})[0]]
    out += [runner.step({0: [t]})[0] for t in LONG[30:]]
    torch.testing.assert_close(torch.cat(out), expected, atol=ATOL, rtol=ATOL)


def test_ragged_batch_equals_each_alone(tiny) -> None:  # noqa: ANN001
    """A decode past the window, a short prompt and a prompt inside the window in the same step."""
    _, _, hf, ours = tiny
    runner = PagedRunner(ours, page_size=4)
    runner.step({0: LONG[:20]})
    got = runner.step({0: LONG[20:21], 1: PROMPT, 2: LONG[5:8]})
    torch.testing.assert_close(got[0], hf_logits(hf, LONG[:21])[20:], atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got[1], hf_logits(hf, PROMPT), atol=ATOL, rtol=ATOL)
    torch.testing.assert_close(got[2], hf_logits(hf, LONG[5:8]), atol=ATOL, rtol=ATOL)


def test_pool_holds_the_global_layer_rings_the_sliding_ones(tiny) -> None:  # noqa: ANN001
    """The global layer keeps 2 KV heads x 16 per token in pages; the three sliding layers a ring of the window's
    8 positions each, outside the pool; the backend's shape is the global layer's 4 query heads."""
    _, _, _, ours = tiny
    assert ours.kv_specs == [KVLayerSpec(2, 16)]
    assert ours.layout.state == StateGroup((WindowKVSpec(2, 16, WINDOW),) * 3)
    assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (4, 2, 16)


def test_stacked_expert_layout_loads_the_same(tmp_path: Path) -> None:
    """transformers' in-memory names (experts stacked in one tensor, `mlp.gate.e_score_correction_bias`,
    `mlp.shared_experts.`) load into the same logits as the saved per-expert layout."""
    hf = save_laguna(tmp_path, tiny_config("head"))
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state and "model.layers.1.mlp.shared_experts.up_proj.weight" in state
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in saved and "model.layers.1.mlp.experts.e_score_correction_bias" in saved
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ours = load_model(str(tmp_path), torch.float32, "cpu")
    torch.testing.assert_close(PagedRunner(ours, page_size=4).step({0: LONG[:20]})[0], hf_logits(hf, LONG[:20]),
                               atol=ATOL, rtol=ATOL)


def test_engine_greedy_matches_transformers(tiny) -> None:  # noqa: ANN001
    _, path, hf, ours = tiny
    llm = LLM(EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch", max_num_batched_tokens=16),
              loaded=ours)
    prompts = [PROMPT, LONG[:30], [3, 1, 4, 1, 5]]
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]


def test_session_turns_past_window_resume(tiny) -> None:  # noqa: ANN001
    """Three turns of one session, each far past the window: turn N+1 resumes turn N (>= 90 % cached: the global
    layer's pages from the radix cache, the rings from the session's snapshot); every answer equals
    transformers' cold run."""
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


@pytest.mark.slow
def test_tp2_greedy_matches_transformers_and_resumes(tiny) -> None:  # noqa: ANN001
    """Two gloo ranks: each takes one KV head and half of every layer's query heads (and their gates), half of
    each expert and of the shared expert. Chunked prompts beside decodes past the window, then a session's later
    turn resumed from its snapshot on both ranks."""
    _, path, hf, _ = tiny
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", num_pages=64, page_size=4,
                          tensor_parallel_size=2, cpu_threads=1, max_num_batched_tokens=16)
    prompts = [PROMPT, LONG[:30]]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(config) as llm:
        outs = llm.generate(prompts, sp)
        history = LONG[:24]
        first = llm.generate([history], sp, session_ids=["s"])[0]
        history = history + first.token_ids + [7, 9, 11]
        second = llm.generate([history], sp, session_ids=["s"])[0]
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
    assert second.token_ids == hf_greedy(hf, history, 6)
    assert second.num_cached_tokens >= 24 + 6 - 4, second.num_cached_tokens
