"""GLM-4.7-Flash through the engine at tensor parallel 2 (two gloo ranks on CPU): the heads of q_b_proj,
kv_b_proj and o_proj split, every rank keeps the whole latent cache. Greedy tokens of prompts prefilled in
48-token chunks beside decodes equal transformers'; the pool's KV bytes per token equal the MLA formula; a
multi-turn session reuses each turn's history in the next."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from glm_models import save_glm, tiny_config
from hybrid_models import hf_greedy, hf_logits

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams

PROMPTS = [[(5 * i + 11 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([3, 17, 70, 100])]


@pytest.mark.slow
def test_tp2_greedy_stats_and_session_reuse(tmp_path: Path) -> None:
    config = tiny_config()
    hf = save_glm(config, tmp_path)
    engine = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", num_pages=256, page_size=4,
                          tensor_parallel_size=2, cpu_threads=1, max_num_batched_tokens=48,
                          kv_dtype="float32")  # transformers' logits to 2e-4: not the default fp16 CPU pool
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(engine) as llm:
        logits = llm.logits(PROMPTS[2])
        outs = llm.generate(PROMPTS, greedy)
        history, shares, answers = list(PROMPTS[3]), [], []
        for turn in range(3):
            out = llm.generate([history], greedy, session_ids=["agent"])[0]
            answers.append((list(history), out.token_ids))
            if turn:
                shares.append(out.num_cached_tokens / len(history))
            history += out.token_ids + [(turn * 7 + k) % 250 + 1 for k in range(3)]
        pool = llm.core.stats().pool
        per_rank = llm.core.runner.weight_bytes_per_rank
    torch.testing.assert_close(logits, hf_logits(hf, PROMPTS[2])[-1], atol=2e-4, rtol=2e-4)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in PROMPTS]
    assert all(got == hf_greedy(hf, prompt, 8) for prompt, got in answers)
    assert min(shares) >= 0.9, shares
    # latent (kv_lora_rank) + rope key per layer, fp32, the same on every rank (the latent is not split)
    assert pool.kv_bytes_per_token == 4 * config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim)
    assert len(per_rank) == 2
