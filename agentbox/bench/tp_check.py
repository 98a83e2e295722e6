"""The GPU check's tensor-parallel part (scripts/gpu_check.sh, machines with two or more GPUs): a tiny
random Qwen3 at tp 1 and tp 2 over NCCL must give the same logits (fp32) and the same greedy tokens; then
the tp 2 / tp 1 decode step-time ratio and the per-step broadcast cost, as JSON."""

from __future__ import annotations

import json
import tempfile
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

from agentbox.bench.throughput import tp_comparison
from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams

TINY = Qwen3Config(
    hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    head_dim=32, vocab_size=1024, max_position_embeddings=2048, architectures=["Qwen3ForCausalLM"],
)


def tp_check(device: str = "cuda") -> dict[str, Any]:
    path = tempfile.mkdtemp(prefix="agentbox-tp-")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(TINY).save_pretrained(path)
    ids = [(13 * i) % 1000 + 7 for i in range(57)]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    got = {}
    for tp in (1, 2):
        config = EngineConfig(model=path, device=device, dtype="float32", num_pages=256, tensor_parallel_size=tp)
        with LLM(config) as llm:
            got[tp] = (llm.logits(ids).cpu(), llm.generate([ids], greedy)[0].token_ids)
    diff = float((got[1][0] - got[2][0]).abs().max())
    if diff > 1e-3 or got[1][1] != got[2][1]:
        raise AssertionError(f"tp 2 differs from tp 1: max logit diff {diff}, tokens {got[1][1]} vs {got[2][1]}")
    return {"max_logit_diff": diff, "greedy_equal": True,
            **tp_comparison(path, 2, 32, 128, (1, 8), device=device, dtype="float32")}


if __name__ == "__main__":
    print(json.dumps(tp_check(), indent=2))
