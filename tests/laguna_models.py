"""Tiny random Laguna checkpoints built with transformers' own config class (`LagunaConfig`) and saved with
save_pretrained (one tensor per expert, the router's bias under `mlp.experts.`, `mlp.shared_expert.`, as
transformers writes a download): XS.2's pattern at 4 layers, one global layer then three sliding ones (window 8),
per-layer query heads (4 global, 8 sliding, on 2 KV heads of 16), the first layer's MLP dense and the others 8
experts top 2 with a shared expert; YaRN partial rope on the global layer (half of each head), plain rope with
another theta on the sliding ones. "head": one softplus
gate per head, soft-capped router logits, routed scaling 2.5; "element": one gate per channel, no soft cap,
tied embeddings. Shared by the model, engine and session tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from hybrid_models import hf_greedy, hf_logits
from transformers import LagunaConfig

__all__ = ["WINDOW", "configs", "hf_greedy", "hf_logits", "randomize", "save_laguna", "tiny_config"]

WINDOW = 8
SLIDING, GLOBAL = "sliding_attention", "full_attention"
TINY: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_attention_heads_per_layer=[4, 8, 8, 8], sliding_window=WINDOW,
    layer_types=[GLOBAL, SLIDING, SLIDING, SLIDING], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    max_position_embeddings=1024,
    rope_parameters={GLOBAL: {"rope_type": "yarn", "rope_theta": 500000.0, "partial_rotary_factor": 0.5,
                             "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
                             "beta_slow": 1.0},
                     SLIDING: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}},
)
VARIANTS: dict[str, dict[str, Any]] = {
    "head": dict(gating=True, moe_router_logit_softcapping=1.5, moe_routed_scaling_factor=2.5),
    "element": dict(gating="per-element", moe_router_logit_softcapping=0.0, tie_word_embeddings=True),
}


def tiny_config(variant: str = "head", **overrides: Any) -> LagunaConfig:
    return LagunaConfig(**{**TINY, **VARIANTS[variant], **overrides}, architectures=["LagunaForCausalLM"])


def configs() -> dict[str, LagunaConfig]:
    return {name: tiny_config(name) for name in VARIANTS}


def randomize(hf: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every weight random, in place: norms near one, a correction bias large enough to change choices, router
    logits large enough that the soft cap bends them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            if "inv_freq" in name or not p.is_floating_point():
                continue
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return hf


def save_laguna(path: Path, config: LagunaConfig | None = None, seed: int = 0) -> torch.nn.Module:
    """The transformers model, random, saved with save_pretrained."""
    hf = randomize(transformers.LagunaForCausalLM(config or tiny_config()).float().eval(), seed)
    hf.save_pretrained(path)
    return hf
