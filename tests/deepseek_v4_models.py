"""A tiny random DeepSeek-V4 (`DeepseekV4ForCausalLM`) built with transformers' own config class and saved with
save_pretrained: two CSA layers (one entry per 4 tokens, a lightning indexer picking the top 3), one HCA layer (one
entry per 32 tokens here, so short prompts complete several and each spans pages of 8 or 16 tokens; 128 in the
release, which the session tests use), one sliding-only layer; a window of 6 raw tokens; 2 hyper-connection streams; a hash-routed first MLP layer; YaRN on
the compressed layers' rope, as the release has. Shared by the model, engine, GGUF and session tests.

The indexer has 16 heads: its score of an entry is a sum of ReLUs, and with few heads all of them are zero often
enough that two entries tie at the top-k boundary, which any two implementations (or one run chunked two ways)
may break differently; 16 heads make that a 2^-16 event per (query, entry).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from hybrid_models import hf_greedy, hf_logits
from transformers import DeepseekV4Config

__all__ = ["CSA", "HCA", "SLIDING", "hf_greedy", "hf_logits", "randomize", "save_deepseek_v4", "tiny_config"]

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
TINY: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    head_dim=32, qk_rope_head_dim=8, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=4,
    layer_types=[CSA, HCA, CSA, SLIDING], compress_rates={CSA: 4, HCA: 32}, sliding_window=6, o_groups=2,
    o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=3, hc_mult=2, hc_sinkhorn_iters=5,
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"], swiglu_limit=0.5, routed_scaling_factor=1.5,
    rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 1024,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=8192,
)


def tiny_config(**overrides: Any) -> DeepseekV4Config:
    return DeepseekV4Config(**{**TINY, **overrides}, architectures=["DeepseekV4ForCausalLM"])


def randomize(hf: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every weight random (norms near one, a correction bias large enough to change choices, a hash table of
    distinct experts per token), in place."""
    config = hf.config
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                table = [torch.randperm(config.n_routed_experts, generator=g)[: config.num_experts_per_tok]
                         for _ in range(config.vocab_size)]
                p.copy_(torch.stack(table))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return hf


def save_deepseek_v4(path: Path, config: DeepseekV4Config | None = None, seed: int = 0) -> torch.nn.Module:
    """The transformers model, random, saved with save_pretrained (transformers' layout of the checkpoint)."""
    hf = randomize(transformers.DeepseekV4ForCausalLM(config or tiny_config()).float().eval(), seed)
    hf.save_pretrained(path)
    return hf
