"""Qwen3.8-Flash-Next through the engine at tensor parallel 2 (two gloo ranks on CPU): attention and delta-net
heads, the experts and the shared expert split; the QSA indexer, the PLE layers (each rank maps the same n-gram
table file: one copy in the page cache) and the gated residuals are replicated, so each rank keeps its heads' K and
V, every indexer key, its heads' delta-net state and the whole PLE rings. Greedy tokens of prompts past the QSA
budget, prefilled in chunks beside decodes, equal transformers' causal computation (and so tp 1's); a session's
later turns resume from their snapshots on both ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_reference import hf_causal_greedy
from qwen4_exp_models import EOS, save_qwen4_exp

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams

PROMPTS = [[(5 * i + 11 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([3, 21, 30, 44])]
PROMPTS[3][12] = EOS


@pytest.mark.slow
def test_tp2_greedy_equals_transformers_and_resumes_sessions(tmp_path: Path) -> None:
    hf = save_qwen4_exp(tmp_path)
    engine = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", num_pages=256, page_size=8,
                          tensor_parallel_size=2, cpu_threads=1, max_num_batched_tokens=24, speculative="off")
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(engine) as llm:
        outs = llm.generate(PROMPTS, greedy)
        history, cached, answers = list(PROMPTS[3]), [], []
        for turn in range(3):
            out = llm.generate([history], greedy, session_ids=["agent"])[0]
            answers.append((list(history), out.token_ids))
            cached.append(out.num_cached_tokens)
            history += out.token_ids + [(turn * 7 + k) % 250 + 3 for k in range(3)]
    assert [o.token_ids for o in outs] == [hf_causal_greedy(hf, p, 6) for p in PROMPTS]
    assert all(got == hf_causal_greedy(hf, prompt, 6) for prompt, got in answers[1:])
    assert all(c >= len(p) - 8 - 3 for c, (p, _) in zip(cached[1:], answers[1:], strict=True)), cached
