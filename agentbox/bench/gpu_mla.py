"""The GPU check's MLA block (scripts/gpu_check.sh): one JSON object.

- logits_bf16: a tiny random GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`, saved, loaded by our loader) against
  transformers in bf16, through the torch and the triton attention backends: max |diff|, top token agreement.
- decode_kernel_bf16: the Triton MLA decode kernel (kernels/mla_attention.py) against its torch twin at the
  real shape (20 heads, latent 512 + rope 64), bf16, batch 1 and 8 over 2,000 cached tokens: max |diff| and
  time per call with the twin as the baseline.
- decode: tokens/s at batch 1 and 8 of a random-weight model of GLM-4.7-Flash's shape with 4 of its 47 layers
  (one dense, three MoE), built in place (no download), through the engine, for each attention backend.
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Glm4MoeLiteConfig

from agentbox.bench.throughput import cuda_time, engine_rates, random_model, random_prompts
from agentbox.config import GPU_PAGE_SIZE, EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams

BACKENDS = ("torch", "triton")


def glm_flash_config(layers: int = 4) -> Glm4MoeLiteConfig:
    """GLM-4.7-Flash's shape (transformers' defaults are the released config) with fewer layers."""
    return Glm4MoeLiteConfig(num_hidden_layers=layers, max_position_embeddings=4096,
                             architectures=["Glm4MoeLiteForCausalLM"])


def tiny_config() -> Glm4MoeLiteConfig:
    return Glm4MoeLiteConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=64,
        q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=512,
        architectures=["Glm4MoeLiteForCausalLM"],
    )


def decode_kernel_check(batch: int, kv_len: int = 2000, heads: int = 20, rank: int = 512, rope: int = 64) -> dict[str, Any]:
    from agentbox.kernels.mla_attention import mla_attention_ref, mla_decode

    page = 16
    pages = -(-kv_len // page)
    g = torch.Generator(device="cuda").manual_seed(batch)
    cache = torch.randn(batch * pages * page, 1, rank + rope, device="cuda", generator=g).bfloat16()
    table = torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
    kv_lens = torch.full((batch,), kv_len, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, rank + rope, device="cuda", generator=g).bfloat16()
    starts = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    scale = 256**-0.5
    got = mla_decode(q, cache, table, kv_lens, rank=rank, page_size=page, scale=scale, block_n=64)
    ref = mla_attention_ref(q, cache, table, starts, kv_lens, rank=rank, page_size=page, scale=scale)
    kernel_s = cuda_time(lambda: mla_decode(q, cache, table, kv_lens, rank=rank, page_size=page, scale=scale, block_n=64))
    ref_s = cuda_time(lambda: mla_attention_ref(q, cache, table, starts, kv_lens, rank=rank, page_size=page, scale=scale), 3)
    return {"batch": batch, "kv_len": kv_len, "max_abs_diff": (got.float() - ref.float()).abs().max().item(),
            "max_abs_ref": ref.float().abs().max().item(), "kernel_us": kernel_s * 1e6, "torch_twin_us": ref_s * 1e6}


def decode_check(attention: str, batches: tuple[int, ...] = (1, 8), prompt_len: int = 128, new_tokens: int = 64) -> dict[str, Any]:
    config = glm_flash_config()
    loaded = random_model(config, torch.bfloat16, "cuda")
    pages = max(batches) * -(-(prompt_len + new_tokens) // GPU_PAGE_SIZE) + 8
    llm = LLM(EngineConfig(device="cuda", dtype="bfloat16", num_pages=pages, max_num_seqs=max(batches),
                           cache_policy="none", attention=attention), loaded=loaded)
    engine_rates(llm, random_prompts(1, 8, config.vocab_size, 0), 4)  # warm-up (Triton compiles here)
    out: dict[str, Any] = {"layers": config.num_hidden_layers, "attention_backend": llm.core.runner.backend.name,
                           "kv_bytes_per_token": llm.core.stats().pool.kv_bytes_per_token}
    for i, b in enumerate(batches):
        out[f"batch_{b}"] = engine_rates(llm, random_prompts(b, prompt_len, config.vocab_size, i + 1), new_tokens).as_dict()
    return out


def logits_check(attention: str) -> dict[str, Any]:
    """Our last-position logits against transformers' in bf16 for the tiny random GLM, through `attention`."""
    config = tiny_config()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            if "inv_freq" not in name:
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    prompt = random_prompts(1, 40, config.vocab_size, seed=7)[0]
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        hf = hf.to(device="cuda", dtype=torch.bfloat16)
        with torch.inference_mode():
            ids = torch.tensor([prompt], device="cuda")
            expected = hf(ids).logits[0, -1].float()
            after_30 = hf(ids[:, :30]).logits[0, -1].float()  # what the first decoded token is read from
        llm = LLM(EngineConfig(model=tmp, device="cuda", dtype="bfloat16", num_pages=16, attention=attention))
        got = llm.logits(prompt)
        # decode steps (the absorbed form) after a 30-token prefill, against transformers' full forwards
        greedy = llm.generate([prompt[:30]], SamplingParams(max_tokens=1, temperature=0.0))[0]
    return {
        "attention": attention,
        "max_abs_diff": (got - expected).abs().max().item(),
        "max_abs_logit": expected.abs().max().item(),
        "top1_match": int(got.argmax()) == int(expected.argmax()),
        "first_decode_token_match": greedy.token_ids[0] == int(after_30.argmax()),
    }


def report() -> dict[str, Any]:
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "logits_bf16": {}, "decode": {}}
    for attention in BACKENDS:
        out["logits_bf16"][attention] = logits_check(attention)
    out["decode_kernel_bf16"] = [decode_kernel_check(b) for b in (1, 8)]
    for attention in BACKENDS:
        out["decode"][attention] = decode_check(attention)
    return out


if __name__ == "__main__":  # python -m agentbox.bench.gpu_mla (scripts/gpu_check.sh's mla block)
    print(json.dumps(report(), indent=2))
