"""GLM-5.3-Flash through the engine at tensor parallel 2 (two gloo ranks on CPU): attention and KDA heads, the
experts and the MLPs split; the latents, the indexer and the hyper-connections are replicated, so each rank keeps
the whole paged cache and its own heads' KDA state. Greedy tokens of prompts past index_topk x index_kpool,
prefilled in chunks beside decodes, equal transformers' causal computation (and so tp 1's); a session's later turn
resumes from its snapshot on both ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from glm5_next_models import hf_causal_greedy, save_glm5_next

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams

PROMPTS = [[(5 * i + 11 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([3, 29, 45, 70])]


@pytest.mark.slow
def test_tp2_greedy_equals_transformers_and_resumes_sessions(tmp_path: Path) -> None:
    hf = save_glm5_next(tmp_path)
    engine = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", num_pages=256, page_size=8,
                          tensor_parallel_size=2, cpu_threads=1, max_num_batched_tokens=48, speculative="off",
                          kv_dtype="float32")  # transformers' greedy tokens: not the default fp16 CPU pool
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(engine) as llm:
        outs = llm.generate(PROMPTS, greedy)
        history, cached, answers = list(PROMPTS[3]), [], []
        for turn in range(3):
            out = llm.generate([history], greedy, session_ids=["agent"])[0]
            answers.append((list(history), out.token_ids))
            cached.append(out.num_cached_tokens)
            history += out.token_ids + [(turn * 7 + k) % 250 + 1 for k in range(3)]
    assert [o.token_ids for o in outs] == [hf_causal_greedy(hf, p, 8) for p in PROMPTS]
    assert all(got == hf_causal_greedy(hf, prompt, 8) for prompt, got in answers)
    assert all(c >= len(p) - 8 - 3 for c, (p, _) in zip(cached[1:], answers[1:], strict=True)), cached
