"""Tensor parallel 2 on the hybrid models: Gated DeltaNet key and value heads (and the conv channels that carry
them) split across two CPU ranks like attention heads; the engine's greedy tokens, prompts prefilled in 48-token
chunks beside decodes, equal transformers' (and so tp 1's, which test_models_qwen3_5.py checks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hybrid_models import configs, hf_greedy, hf_logits, save_hybrid

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams

PROMPTS = [[(5 * i + 11 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([3, 17, 70, 130])]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(configs()))
def test_tp2_greedy_matches_transformers(name: str, tmp_path: Path) -> None:
    hf = save_hybrid(configs()[name], tmp_path)
    config = EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", num_pages=256, page_size=4,
                          tensor_parallel_size=2, cpu_threads=1, max_num_batched_tokens=48)
    with LLM(config) as llm:
        logits = llm.logits(PROMPTS[2])
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        per_rank = llm.core.runner.weight_bytes_per_rank
    torch.testing.assert_close(logits, hf_logits(hf, PROMPTS[2])[-1], atol=2e-4, rtol=2e-4)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in PROMPTS]
    assert len(per_rank) == 2
