"""The hybrid Qwen models (Qwen3.5/3.6 dense and MoE, Qwen3-Next) against transformers with the same random
weights, loaded by our loader from save_pretrained output: prefill, chunked prefill (chunks that cut the delta
rule's 64-token chunks anywhere), step-by-step decode, a batch mixing all of them, and greedy through the engine."""

from __future__ import annotations

import logging

import pytest
import torch
from hybrid_models import configs, hf_greedy, hf_logits, save_hybrid
from model_harness import PagedRunner

from agentbox.layers import delta_rule
from agentbox.layers.gated_deltanet import GatedDeltaNet
from agentbox.layers.quant import int4
from agentbox.models.loader import load_model

PROMPT = [5, 17, 200, 3, 99, 42, 7, 128, 64, 1, 250, 33, 8]
DECODE = [77, 12, 190, 4, 61]
LONG = [(i * 37 + 11) % 256 for i in range(150)]  # three delta-rule chunks, the last one partial
ATOL = 2e-4


@pytest.fixture(scope="module", params=list(configs()))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_hybrid(configs()[request.param], path)
    return path, hf, load_model(str(path), torch.float32, "cpu")


def test_delta_rule_chunked_equals_recurrent() -> None:
    torch.manual_seed(0)
    h, length, dk, dv = 3, 100, 8, 6
    q, k = delta_rule.prepare_qk(torch.randn(h, length, dk), torch.randn(h, length, dk))
    v, beta = torch.randn(h, length, dv), torch.rand(h, length)
    g = -torch.rand(h, length)
    state = torch.randn(h, dk, dv)
    ref, ref_state = delta_rule.recurrent(q[None], k[None], v[None], g[None], beta[None], state[None])
    out, out_state = delta_rule.chunked(q, k, v, g, beta, state, chunk=16)
    torch.testing.assert_close(out, ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out_state, ref_state[0], atol=1e-4, rtol=1e-4)
    # split in two at a point inside a chunk: the state carries the rest
    a, s1 = delta_rule.chunked(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], state, chunk=16)
    b, s2 = delta_rule.chunked(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], s1, chunk=16)
    torch.testing.assert_close(torch.cat([a, b], dim=1), ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s2, ref_state[0], atol=1e-4, rtol=1e-4)


def test_layer_kinds_follow_layer_types(tiny) -> None:  # noqa: ANN001
    _, hf, ours = tiny
    kinds = [isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet) for layer in ours.model.language_model.layers]
    text = hf.config.get_text_config()
    assert kinds == [t == "linear_attention" for t in text.layer_types] == [True, True, True, False]
    assert ours.num_layers == 1  # KV pages only for the one attention layer
    assert ours.layout.state is not None and len(ours.layout.state.specs) == 3


def test_prefill_and_decode_match_transformers(tiny) -> None:  # noqa: ANN001
    _, hf, ours = tiny
    runner = PagedRunner(ours, page_size=4)
    out = [runner.step({0: PROMPT})[0]] + [runner.step({0: [t]})[0] for t in DECODE]
    torch.testing.assert_close(torch.cat(out), hf_logits(hf, PROMPT + DECODE), atol=ATOL, rtol=ATOL)


def test_chunked_prefill_matches_transformers(tiny) -> None:  # noqa: ANN001
    _, hf, ours = tiny
    runner = PagedRunner(ours, num_pages=64, page_size=4)
    cuts = [0, 1, 30, 64, 101, 150]  # chunks of 1, 29, 34, 37 and 49 tokens
    out = [runner.step({0: LONG[a:b]})[0] for a, b in zip(cuts, cuts[1:], strict=False)]
    out += [runner.step({0: [t]})[0] for t in DECODE]
    torch.testing.assert_close(torch.cat(out), hf_logits(hf, LONG + DECODE), atol=ATOL, rtol=ATOL)


def test_mixed_batch_equals_each_alone(tiny) -> None:  # noqa: ANN001
    """Prefill chunks and decodes of four sequences in the same steps: each one's state stays its own."""
    _, hf, ours = tiny
    seqs = {0: PROMPT, 1: LONG[:70], 2: [100, 101], 3: list(range(30, 47))}
    runner = PagedRunner(ours, num_pages=64, page_size=4)
    plan = [
        {0: PROMPT[:10], 1: seqs[1][:5], 2: seqs[2][:1], 3: seqs[3][:3]},
        {0: PROMPT[10:11], 1: seqs[1][5:69], 2: seqs[2][1:2], 3: seqs[3][3:12]},
        {0: PROMPT[11:], 1: seqs[1][69:], 2: [7], 3: seqs[3][12:]},
        {0: [9], 1: [8], 2: [6], 3: [5]},
    ]
    pieces: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}
    full = {s: list(t) for s, t in seqs.items()}
    full[2].append(7)
    for s, t in ((0, 9), (1, 8), (2, 6), (3, 5)):
        full[s].append(t)
    for chunks in plan:
        for s, logits in runner.step(chunks).items():
            pieces[s].append(logits)
    for s in seqs:
        torch.testing.assert_close(torch.cat(pieces[s]), hf_logits(hf, full[s]), atol=ATOL, rtol=ATOL)


def test_vision_tower_and_mtp_skipped_in_log(tmp_path, caplog: pytest.LogCaptureFixture) -> None:  # noqa: ANN001
    save_hybrid(configs()["qwen3_5"], tmp_path)
    with caplog.at_level(logging.INFO, logger="agentbox.models.weight_loader"):
        load_model(str(tmp_path), torch.float32, "cpu")
    assert "'model.visual.'" in caplog.text and "vision tower" in caplog.text


def test_engine_greedy_matches_transformers(tiny) -> None:  # noqa: ANN001
    from agentbox.config import EngineConfig
    from agentbox.engine.llm import LLM
    from agentbox.engine.sampling import SamplingParams

    path, hf, ours = tiny
    llm = LLM(EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch"), loaded=ours)
    prompts = [PROMPT, LONG[:90], [3, 1, 4, 1, 5]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 10) for p in prompts]


def _turns(llm, hf, sessions: int, turns: int) -> list[list[tuple[int, int]]]:  # noqa: ANN001
    """`sessions` conversations interleaved, each turn its whole history + its last answer + 5 new tokens;
    every answer checked against transformers' cold greedy run. Returns (prompt, cached) per turn."""
    from agentbox.engine.sampling import SamplingParams

    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    history = {s: LONG[s * 7 : s * 7 + 30] for s in range(sessions)}
    seen: list[list[tuple[int, int]]] = [[] for _ in range(sessions)]
    for t in range(turns):
        for s in range(sessions):
            out = llm.generate([history[s]], sp, session_ids=[f"s{s}"])[0]
            assert out.token_ids == hf_greedy(hf, history[s], 6), (s, t)
            seen[s].append((len(history[s]), out.num_cached_tokens))
            history[s] = history[s] + out.token_ids + [(t * 13 + s * 5 + k) % 256 for k in range(5)]
    return seen


def test_cached_prefix_without_snapshot_recomputes(tiny) -> None:  # noqa: ANN001
    """With snapshots off, a later turn whose prefix is in the radix cache must not resume (the state would
    be from the wrong position): nothing is reported cached and every answer equals a cold run."""
    from agentbox.config import EngineConfig
    from agentbox.engine.llm import LLM

    path, hf, ours = tiny
    llm = LLM(EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch", state_snapshots=0),
              loaded=ours)
    seen = _turns(llm, hf, sessions=1, turns=3)
    assert all(cached == 0 for _, cached in seen[0])


def test_session_snapshots_resume_each_turn(tiny) -> None:  # noqa: ANN001
    """Each turn ends with a snapshot of the state at its last cached page: the next turn resumes there
    (its whole history but the last partial page is cached) and answers exactly as a cold run."""
    from agentbox.config import EngineConfig
    from agentbox.engine.llm import LLM

    path, hf, ours = tiny
    llm = LLM(EngineConfig(model=str(path), num_pages=128, page_size=4, attention="torch"), loaded=ours)
    seen = _turns(llm, hf, sessions=2, turns=3)
    for turns in seen:
        assert turns[0][1] == 0
        for (prompt, cached), (previous, _) in zip(turns[1:], turns, strict=False):
            assert cached >= (previous + 5) // 4 * 4 and prompt - cached < 4 + 6 + 5


def test_snapshot_store_full_drops_lru_and_stays_exact(tiny) -> None:  # noqa: ANN001
    """Three sessions, two snapshot slots: the least recently used session loses its snapshot and recomputes
    its history; no answer changes."""
    from agentbox.config import EngineConfig
    from agentbox.engine.llm import LLM

    path, hf, ours = tiny
    llm = LLM(EngineConfig(model=str(path), num_pages=128, page_size=4, attention="torch", state_snapshots=2),
              loaded=ours)
    seen = _turns(llm, hf, sessions=3, turns=2)
    assert [turns[1][1] > 0 for turns in seen].count(False) >= 1
    assert llm.core.cache.snapshot_stats().dropped >= 1


@pytest.mark.parametrize("kind", list(configs()))
def test_gguf_matches_transformers(kind: str, tmp_path) -> None:  # noqa: ANN001
    """The same model written as llama.cpp writes `qwen35` / `qwen35moe` / `qwen3next` (Q8_0 linear weights):
    logits of prefill, chunked prefill and decode match the transformers twin, greedy through the engine too."""
    from hybrid_gguf import write_hybrid_gguf

    from agentbox.config import EngineConfig
    from agentbox.engine.llm import LLM
    from agentbox.engine.sampling import SamplingParams

    config = configs()[kind]
    config.get_text_config().mlp_only_layers = []  # qwen3next files have no dense-MLP tensors
    hf = save_hybrid(config, tmp_path / "hf")
    path = write_hybrid_gguf(hf, kind, tmp_path / f"{kind}.gguf")
    with int4.cpu_kernel(int4.Int4Kernel.DENSE):  # compared with an fp32 twin: the exact CPU path
        ours = load_model(str(path), torch.float32, "cpu")
    runner = PagedRunner(ours, page_size=4)
    out = [runner.step({0: LONG[:70]})[0], runner.step({0: LONG[70:100]})[0]]
    out += [runner.step({0: [t]})[0] for t in DECODE]
    torch.testing.assert_close(torch.cat(out), hf_logits(hf, LONG[:100] + DECODE), atol=ATOL, rtol=ATOL)
    llm = LLM(EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch"), loaded=ours)
    got = llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert got.token_ids == hf_greedy(hf, PROMPT, 8)
