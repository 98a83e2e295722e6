"""Tiny random Nemotron-H checkpoints built with transformers' own config class (`NemotronHConfig`) and saved with
save_pretrained (`backbone.` names, one tensor per expert, as a download has them): Mamba-2, MoE, attention, Mamba-2,
MLP layers; 8 Mamba heads of 8 in 2 groups, a state of 16, a conv of 4 and scan chunks of 8 (prompts span several);
8 experts top 2 in 2 groups (one chosen) with a correction bias, routed scaling 1.5, a shared expert; "latent": the
experts inside a 32-wide latent projection. Shared by the model, engine and session tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from hybrid_models import hf_greedy, hf_logits
from transformers import NemotronHConfig

__all__ = ["configs", "hf_greedy", "hf_logits", "randomize", "save_nemotron_h", "tiny_config"]

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
TINY: dict[str, Any] = dict(
    vocab_size=256, hidden_size=64, layers_block_type=[MAMBA, MOE, ATTENTION, MAMBA, MLP], num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
    ssm_state_size=16, conv_kernel=4, chunk_size=8, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
    topk_group=1, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, routed_scaling_factor=1.5,
    max_position_embeddings=4096,
)
VARIANTS: dict[str, dict[str, Any]] = {"plain": {}, "latent": dict(moe_latent_size=32)}


def tiny_config(variant: str = "plain", **overrides: Any) -> NemotronHConfig:
    return NemotronHConfig(**{**TINY, **VARIANTS[variant], **overrides}, architectures=["NemotronHForCausalLM"])


def configs() -> dict[str, NemotronHConfig]:
    return {name: tiny_config(name) for name in VARIANTS}


def randomize(hf: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every weight random, in place: slow decays (A_log) so a state resumed from the wrong place shows for many
    tokens, norms near one, a correction bias large enough to change choices."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            if not p.is_floating_point():
                continue
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(-3.0, -1.0, generator=g))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-1.0, 0.5, generator=g))
            elif name.endswith(".D"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "e_score_correction_bias" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return hf


def save_nemotron_h(path: Path, config: NemotronHConfig | None = None, seed: int = 0) -> torch.nn.Module:
    hf = randomize(transformers.NemotronHForCausalLM(config or tiny_config()).float().eval(), seed)
    hf.save_pretrained(path)
    return hf
