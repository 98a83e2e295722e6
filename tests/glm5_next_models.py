"""A tiny random GLM-5.3-Flash (`Glm5NextForConditionalGeneration`) built with transformers' own config classes and
saved with save_pretrained in the released image-text layout (`model.language_model.`, a one-block vision tower
the loader skips): KDA layers, indexed-attention layers (one that runs its indexer and one after it that reuses
its top-k), 4 hyper-connection streams, a dense first MLP then shared-expert MoE. Pools of 4 tokens and a top-k of
8 tokens (2 pools), so prompts past 8 tokens make the indexer drop keys. Shared by the model, engine and session
tests.

The reference for a prompt is transformers' token-by-token decode (`hf_causal_logits`): on prompts where the
indexer drops keys its full forward disagrees with it (docs/models-and-formats.md), and the causal computation
is what generate() continues with and what the engine serves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import Glm5NextConfig

KDA, INDEXED = "linear_attention", "indexed_attention"
TEXT: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
    n_group=2, topk_group=1, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=16, index_topk=8,
    index_head_dim=16, index_n_heads=16, index_kpool=4, linear_head_dim=8, linear_num_heads=4, hc_mult=4,
    hc_sinkhorn_iters=5, routed_scaling_factor=2.5, swiglu_limit=0.5, pad_token_id=0,
    layer_types=[KDA, INDEXED, INDEXED, KDA, INDEXED], indexer_types=["full", "full", "shared", "full", "full"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"],
)
VISION: dict[str, Any] = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, intermediate_size=32,
                              projection_intermediate_size=32, patch_size=14, image_size=28)


def tiny_config(**text: Any) -> Glm5NextConfig:
    return Glm5NextConfig(text_config={**TEXT, **text}, vision_config=VISION,
                          architectures=["Glm5NextForConditionalGeneration"])


def randomize(hf: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every weight random (norms near one, a correction bias that changes choices, decays spread over their
    range), in place."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name or "A_log" in name or "dt_bias" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return hf


def save_glm5_next(path: Path, config: Glm5NextConfig | None = None, seed: int = 0,
                   random: bool = True) -> torch.nn.Module:
    """random=False keeps transformers' own initialisation (seeded): pooling logits all equal and small weights,
    where the indexer's ReLU'd scores tie exactly."""
    torch.manual_seed(seed)
    hf = transformers.Glm5NextForConditionalGeneration(config or tiny_config()).float().eval()
    if random:
        randomize(hf, seed)
    hf.save_pretrained(path)
    return hf

