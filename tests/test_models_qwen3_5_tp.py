"""Tensor parallel 2 on the hybrid models: Gated DeltaNet key and value heads (and the conv channels that carry
them) split across two CPU ranks like attention heads; the engine's greedy tokens, prompts prefilled in 48-token
chunks beside decodes, equal transformers' (and so tp 1's, which test_models_qwen3_5.py checks); the same for
their GGUF files (Q8_0 linear weights, each rank narrowing the file's blocks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hybrid_gguf import write_hybrid_gguf
from hybrid_models import configs, hf_greedy, hf_logits, save_hybrid

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams

PROMPTS = [[(5 * i + 11 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([3, 17, 70, 130])]


@pytest.mark.slow
@pytest.mark.parametrize("gguf", [False, True], ids=["safetensors", "gguf"])
@pytest.mark.parametrize("name", list(configs()))
def test_tp2_greedy_matches_transformers(name: str, gguf: bool, tmp_path: Path) -> None:
    config = configs()[name]
    if gguf:
        config.get_text_config().mlp_only_layers = []  # qwen3next files have no dense-MLP tensors
    hf = save_hybrid(config, tmp_path / "hf")
    model = write_hybrid_gguf(hf, name, tmp_path / "m.gguf") if gguf else tmp_path / "hf"
    config = EngineConfig(model=str(model), device="cpu", dtype="float32", num_pages=256, page_size=4,
                          tensor_parallel_size=2, cpu_threads=1, max_num_batched_tokens=48, exact_cpu=True)
    with LLM(config) as llm:
        logits = llm.logits(PROMPTS[2])
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = llm.generate(PROMPTS, greedy)
        per_rank = llm.core.runner.weight_bytes_per_rank
        # a second turn of the longest prompt's session resumes from the snapshot every rank copied
        first = llm.generate([PROMPTS[3]], greedy, session_ids=["tp"])[0]
        again = PROMPTS[3] + first.token_ids + [1, 2, 3]
        second = llm.generate([again], greedy, session_ids=["tp"])[0]
    assert second.num_cached_tokens >= len(PROMPTS[3]) // 4 * 4
    assert second.token_ids == hf_greedy(hf, again, 8)
    torch.testing.assert_close(logits, hf_logits(hf, PROMPTS[2])[-1], atol=2e-4, rtol=2e-4)
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 8) for p in PROMPTS]
    assert len(per_rank) == 2
