"""A tiny random gpt-oss served in-process with `--attention triton` (under Triton's interpreter on CPU) gives
transformers' greedy tokens (fp32): attention sinks on every layer and a 4-token sliding window on the first,
through the prefix-extend kernel (two ragged prompts in one step, both longer than the window) and the paged
decode kernel (decodes crossing page boundaries, every decode past the window)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_harness import save_random
from transformers import GptOssConfig

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.models.loader import load_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONFIG = GptOssConfig(
    hidden_size=64, intermediate_size=64, num_hidden_layers=2,  # layer 0 sliding, layer 1 full
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
    num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128, sliding_window=4,
    rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 32, "rope_theta": 150000.0,
    },
    architectures=["GptOssForCausalLM"],
)
PROMPTS = [[5, 17, 200, 3, 99, 42, 7, 128, 64, 1, 250, 33, 8], [9, 8, 7, 6, 5, 4, 3]]


def test_gpt_oss_triton_greedy_matches_transformers(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    hf = save_random(CONFIG, tmp_path)
    n = 6
    expected = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None)
            expected.append(ref[0, len(prompt) :].tolist())
    loaded = load_model(str(tmp_path), torch.float32, DEVICE)
    attns = [layer.self_attn.attn for layer in loaded.model.model.layers]
    assert [a.sliding_window for a in attns] == [4, None] and all(a.sinks is not None for a in attns)
    config = EngineConfig(
        model=str(tmp_path), device=DEVICE, dtype="float32", attention="triton", num_pages=16, page_size=4,
        cache_policy="none",
    )
    llm = LLM(config, loaded=loaded)
    assert llm.core.runner.backend.name == "triton"
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
