"""The GPU check's hybrid block (scripts/gpu_check.sh): one JSON object.

A random model of Qwen3.6-35B-A3B's shape (`Qwen3_5MoeForConditionalGeneration`: hidden 2048, 256 experts of
512, 8 routed + 1 shared, Gated DeltaNet with 16 key / 32 value heads of 128, gated attention with 16 query /
2 KV heads of 256, vocab 248,320) with 4 of its 40 layers (3 Gated DeltaNet + 1 attention, the released
pattern), built by transformers on the GPU, saved, and loaded by our loader like a download:
- logits: ours in bf16 against transformers' torch path (the reference: its delta rule falls back to torch
  without flash-linear-attention) in fp32 and in bf16, last position of a 64- and a 300-token prompt (the
  delta rule's chunked form over several chunks): max |diff| against the logits' scale, top tokens agree;
- decode: tokens/s at batch 1 and 8 through the engine (prompts of 128, 64 new tokens).
Imports no HTTP stack. `python -m agentbox.bench.gpu_hybrid`; about 9 GB of bf16 weights on the GPU and disk.
"""

from __future__ import annotations

import json
import tempfile
import time
from typing import Any

import torch
from transformers import PretrainedConfig, Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

from agentbox.bench.throughput import built, compare_logits, engine_rates, random_prompts
from agentbox.config import GPU_PAGE_SIZE, EngineConfig
from agentbox.engine.llm import LLM

BATCHES = (1, 8)


def qwen3_6_35b_a3b_config(layers: int = 4) -> PretrainedConfig:
    """Qwen3.6-35B-A3B's text shape with fewer layers (every 4th one attention), a one-block vision tower."""
    text = dict(
        hidden_size=2048, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, vocab_size=248320, max_position_embeddings=4096, rms_norm_eps=1e-6,
    )
    vision = dict(depth=1, hidden_size=64, intermediate_size=64, num_heads=2, out_hidden_size=2048, patch_size=2,
                  temporal_patch_size=2, spatial_merge_size=1)
    return Qwen3_5MoeConfig(text_config=text, vision_config=vision,
                            architectures=["Qwen3_5MoeForConditionalGeneration"])


def _random_hf(config: PretrainedConfig, device: str) -> torch.nn.Module:
    """transformers' model built in place on the GPU in bf16, every weight drawn like tests/hybrid_models.py."""
    torch.manual_seed(0)
    hf = built(Qwen3_5MoeForConditionalGeneration, config, torch.bfloat16, device)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-4.0, -2.0)  # decays of 0.9 to 0.99 a token: the state matters for many tokens
            elif "norm" in name:
                p.copy_(0.1 * torch.randn_like(p) + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.normal_(0.0, 0.02)
    return hf.eval()


def report(device: str = "cuda") -> dict[str, Any]:
    config = qwen3_6_35b_a3b_config()
    vocab = config.text_config.vocab_size
    short, long = random_prompts(1, 64, vocab, seed=7)[0], random_prompts(1, 300, vocab, seed=8)[0]
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0), "layers": config.text_config.num_hidden_layers}
    with tempfile.TemporaryDirectory(prefix="agentbox-hybrid-") as tmp:
        t0 = time.perf_counter()
        hf = _random_hf(config, device)
        hf.save_pretrained(tmp)
        out["build_and_save_s"] = round(time.perf_counter() - t0, 1)
        with torch.inference_mode():
            ref = {"bf16": [hf(torch.tensor([p], device=device)).logits[0, -1].float() for p in (short, long)]}
            hf.float()
            ref["fp32"] = [hf(torch.tensor([p], device=device)).logits[0, -1].float() for p in (short, long)]
        del hf
        torch.cuda.empty_cache()
        pages = max(BATCHES) * -(-(128 + 64) // GPU_PAGE_SIZE) + 64
        llm = LLM(EngineConfig(model=tmp, device=device, dtype="bfloat16", num_pages=pages, max_num_seqs=max(BATCHES),
                               cache_policy="none"))
        got = [llm.logits(short), llm.logits(long)]
        out["logits_bf16"] = {f"vs_transformers_{kind}": {"prompt_64": compare_logits(got[0], r[0]),
                                                        "prompt_300": compare_logits(got[1], r[1])}
                              for kind, r in ref.items()}
        out["params_b"] = sum(p.numel() for p in llm.loaded.model.parameters()) / 1e9
        out["attention_backend"] = llm.core.runner.backend.name
        engine_rates(llm, random_prompts(1, 8, vocab, 0), 4)  # warm-up (Triton compiles here)
        for i, b in enumerate(BATCHES):
            out[f"decode_batch_{b}"] = engine_rates(llm, random_prompts(b, 128, vocab, i + 1), 64).as_dict()
    return out


if __name__ == "__main__":  # python -m agentbox.bench.gpu_hybrid (scripts/gpu_check.sh's hybrid block)
    print(json.dumps(report(), indent=2))
