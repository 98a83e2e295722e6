"""The GPU check's MoE block (scripts/gpu_check.sh): one JSON object.

- logits: tiny random Qwen3-MoE and gpt-oss checkpoints (saved, loaded by our loader) against transformers
  in bf16 on the GPU: max |diff| and whether the top token agrees.
- fused_moe: the Triton grouped GEMM against its torch twin (a per-expert loop) at Qwen3-30B-A3B's MoE shape
  (128 experts, top 8, 2048 -> 768), bf16, at 1 and 16 tokens: max |diff| and time per call, with the
  twin as the baseline in the same run (speedup = twin time / kernel time).
- decode: tokens/s at batch 1 and 16 of a random-weight model of Qwen3-30B-A3B's shape with 4 of its 48
  layers, built in place (no download), through the engine.
Runs in about a minute on one GPU; imports no HTTP stack.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch
from transformers import GptOssConfig, PretrainedConfig, Qwen3MoeConfig

from agentbox.bench.throughput import cuda_time, engine_rates, logits_check, random_model, random_prompts
from agentbox.config import GPU_PAGE_SIZE, EngineConfig
from agentbox.engine.llm import LLM


def qwen3_30b_a3b_config(layers: int = 4) -> PretrainedConfig:
    """Qwen3-30B-A3B's shape (and Qwen3-Coder-30B-A3B's) with fewer layers."""
    return Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
    )


def tiny_configs() -> dict[str, PretrainedConfig]:
    common = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  vocab_size=512, max_position_embeddings=512)
    return {
        "qwen3_moe": Qwen3MoeConfig(**common, architectures=["Qwen3MoeForCausalLM"], intermediate_size=256,
                                    moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True),
        "gpt_oss": GptOssConfig(**common, architectures=["GptOssForCausalLM"], intermediate_size=64, num_local_experts=8,
                                num_experts_per_tok=2, sliding_window=8,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                 "truncate": False, "original_max_position_embeddings": 128,
                                                 "rope_theta": 150000.0}),
    }


def fused_moe_check(tokens: int, device: str = "cuda") -> dict[str, Any]:
    from agentbox.kernels.fused_moe import fused_moe, fused_moe_ref

    e, k, h, inter = 128, 8, 2048, 768
    g = torch.Generator(device=device).manual_seed(tokens)
    x = torch.randn(tokens, h, device=device, generator=g).bfloat16()
    w13 = (0.02 * torch.randn(e, 2 * inter, h, device=device, generator=g)).bfloat16()
    w2 = (0.02 * torch.randn(e, h, inter, device=device, generator=g)).bfloat16()
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, e, device=device, generator=g), -1), k, dim=-1)
    got = fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x, w13, w2, weights, ids)
    kernel_s = cuda_time(lambda: fused_moe(x, w13, w2, weights, ids))
    ref_s = cuda_time(lambda: fused_moe_ref(x, w13, w2, weights, ids))
    return {
        "tokens": tokens,
        "max_abs_diff": (got.float() - ref.float()).abs().max().item(),
        "max_abs_ref": ref.float().abs().max().item(),
        "kernel_us": kernel_s * 1e6,
        "torch_twin_us": ref_s * 1e6,
        "speedup_vs_twin": ref_s / kernel_s,
    }


def decode_check(batches: tuple[int, ...] = (1, 16), prompt_len: int = 128, new_tokens: int = 64) -> dict[str, Any]:
    config = qwen3_30b_a3b_config()
    t0 = time.perf_counter()
    loaded = random_model(config, torch.bfloat16, "cuda")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    pages = max(batches) * -(-(prompt_len + new_tokens) // GPU_PAGE_SIZE) + 8
    llm = LLM(
        EngineConfig(device="cuda", dtype="bfloat16", num_pages=pages, max_num_seqs=max(batches), cache_policy="none"),
        loaded=loaded,
    )
    engine_rates(llm, random_prompts(1, 8, config.vocab_size, 0), 4)  # warm-up (Triton compiles here)
    out: dict[str, Any] = {
        "layers": config.num_hidden_layers,
        "params_b": sum(p.numel() for p in loaded.model.parameters()) / 1e9,
        "build_s": build_s,
        "attention_backend": llm.core.runner.backend.name,
    }
    for i, b in enumerate(batches):
        r = engine_rates(llm, random_prompts(b, prompt_len, config.vocab_size, i + 1), new_tokens)
        out[f"batch_{b}"] = r.as_dict()
    return out


def report() -> dict[str, Any]:
    device = "cuda"
    return {
        "gpu": torch.cuda.get_device_name(0),
        "logits_bf16": {name: logits_check(c, device, torch.bfloat16) for name, c in tiny_configs().items()},
        "fused_moe_bf16": [fused_moe_check(t) for t in (1, 16)],
        "qwen3_30b_a3b_shape_4_layers_decode": decode_check(),
    }


if __name__ == "__main__":  # python -m agentbox.bench.gpu_moe (scripts/gpu_check.sh's moe block)
    print(json.dumps(report(), indent=2))
