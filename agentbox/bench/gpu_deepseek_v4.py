"""The GPU check's DeepSeek-V4 block (scripts/gpu_check.sh): one JSON object.

A random model of DeepSeek-V4-Flash's shape (`DeepseekV4ForCausalLM`: hidden 4096, 64 query heads of 512 with one
K=V head, q rank 1024, 8 output groups of rank 1024, a 128-token window, CSA entries per 4 tokens with a 64-head
indexer keeping the top 512, HCA entries per 128, 4 hyper-connection streams, experts of 2048 with 6 routed + 1
shared, sqrt(softplus) routing, vocab 129,280) with 4 of its 43 layers (HCA, CSA, HCA, CSA; the first hash-routed)
and 16 routed experts instead of 256 (the 256 of 4 layers alone are 26B parameters: a token reads 6 either way),
built by transformers on the GPU, saved and loaded by our loader like a download:
- logits: ours in bf16 against transformers' (the torch reference, eager) in fp32 and in bf16, last position of a
  64- and a 600-token prompt (the second completes 150 CSA entries, more than the indexer keeps, and 4 HCA
  entries): max |diff| against the logits' scale, top tokens agree;
- decode: tokens/s at batch 1 through the engine (a 128-token prompt, 64 new tokens).
Imports no HTTP stack. `python -m agentbox.bench.gpu_deepseek_v4`; about 8 GB of bf16 weights on the GPU and disk.
tests/test_bench_gpu_deepseek_v4.py runs the same code at a tiny shape on the CPU.
"""

from __future__ import annotations

import json
import tempfile
import time
from typing import Any

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from agentbox.bench.throughput import built, compare_logits, engine_rates, random_prompts
from agentbox.config import GPU_PAGE_SIZE, EngineConfig
from agentbox.engine.llm import LLM

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
PROMPTS = (64, 600)


def flash_config(layers: int = 4, experts: int = 16) -> DeepseekV4Config:
    """DeepSeek-V4-Flash's shape (transformers' defaults are it) with fewer layers and routed experts."""
    return DeepseekV4Config(
        num_hidden_layers=layers, n_routed_experts=experts, layer_types=[HCA, CSA] * (layers // 2),
        mlp_layer_types=["hash_moe"] + ["moe"] * (layers - 1), max_position_embeddings=4096,
        architectures=["DeepseekV4ForCausalLM"],
    )


def _random_hf(config: DeepseekV4Config, device: str) -> torch.nn.Module:
    """transformers' model built in place in bf16, every weight random (hash table: distinct experts a token)."""
    torch.manual_seed(0)
    hf = built(DeepseekV4ForCausalLM, config, torch.bfloat16, device)
    with torch.no_grad():
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                p.copy_(torch.rand(p.shape[0], config.n_routed_experts, device=device).argsort(-1)[:, : p.shape[1]])
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.is_floating_point():
                p.normal_(0.0, 0.02)
    return hf.eval()


def report(device: str = "cuda", dtype: str = "bfloat16", config: DeepseekV4Config | None = None,
           prompts: tuple[int, ...] = PROMPTS, new_tokens: int = 64) -> dict[str, Any]:
    config = config or flash_config()
    vocab = config.vocab_size
    texts = [random_prompts(1, n, vocab, seed=7 + i)[0] for i, n in enumerate(prompts)]
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                           "layers": config.num_hidden_layers, "routed_experts": config.n_routed_experts}
    with tempfile.TemporaryDirectory(prefix="agentbox-deepseek-v4-") as tmp:
        t0 = time.perf_counter()
        hf = _random_hf(config, device)
        hf.save_pretrained(tmp)
        out["build_and_save_s"] = round(time.perf_counter() - t0, 1)
        with torch.inference_mode():
            ref = {"bf16": [hf(torch.tensor([p], device=device)).logits[0, -1].float() for p in texts]}
            hf.float()
            ref["fp32"] = [hf(torch.tensor([p], device=device)).logits[0, -1].float() for p in texts]
        del hf
        if device == "cuda":
            torch.cuda.empty_cache()
        pages = -(-(max(prompts) + new_tokens) // GPU_PAGE_SIZE) + 64
        llm = LLM(EngineConfig(model=tmp, device=device, dtype=dtype, num_pages=pages, max_num_seqs=1,
                               cache_policy="none", speculative="off"))
        with llm:
            got = [llm.logits(p) for p in texts]
            out[f"logits_{dtype}"] = {f"vs_transformers_{kind}": {f"prompt_{n}": compare_logits(g.to(r[i].device), r[i])
                                                                for i, (n, g) in enumerate(zip(prompts, got, strict=True))}
                                      for kind, r in ref.items()}
            out["params_b"] = sum(p.numel() for p in llm.loaded.model.parameters()) / 1e9
            engine_rates(llm, random_prompts(1, 8, vocab, 0), 4)  # warm-up
            out["decode_batch_1"] = engine_rates(llm, random_prompts(1, 128, vocab, 1), new_tokens).as_dict()
    return out


if __name__ == "__main__":  # python -m agentbox.bench.gpu_deepseek_v4 (scripts/gpu_check.sh's deepseek_v4 block)
    print(json.dumps(report(), indent=2))
