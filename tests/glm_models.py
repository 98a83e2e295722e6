"""A tiny random GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`) built with transformers' own config class and saved
with save_pretrained: 3 layers (one dense, two MoE with a shared expert), MLA with a q low-rank pair, grouped
"noaux_tc" routing with a random correction bias. Shared by the model, engine and GGUF tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import Glm4MoeLiteConfig

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=12,
    v_head_dim=16, max_position_embeddings=512, routed_scaling_factor=1.8,
)


def tiny_config(**overrides: object) -> Glm4MoeLiteConfig:
    return Glm4MoeLiteConfig(**{**TINY, **overrides}, architectures=["Glm4MoeLiteForCausalLM"])


def save_glm(config: Glm4MoeLiteConfig, path: Path, seed: int = 0, mtp: bool = False) -> torch.nn.Module:
    """The transformers model, every weight random, saved with save_pretrained. mtp: the checkpoint also
    carries a multi-token-prediction layer after the last decoder layer, as the release does."""
    torch.manual_seed(seed)
    hf = transformers.Glm4MoeLiteForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            if "inv_freq" in name:
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "e_score_correction_bias" in name:
                p.copy_(0.5 * torch.randn_like(p))  # large enough to change which experts are chosen
            else:
                p.copy_(0.08 * torch.randn_like(p))
    hf.save_pretrained(path)
    if mtp:
        from safetensors.torch import load_file, save_file

        file = path / "model.safetensors"
        tensors = load_file(file)
        n = config.num_hidden_layers
        tensors |= {
            f"model.layers.{n}.eh_proj.weight": torch.zeros(config.hidden_size, 2 * config.hidden_size),
            f"model.layers.{n}.self_attn.kv_b_proj.weight": torch.zeros(4, 4),
        }
        save_file(tensors, file, metadata={"format": "pt"})
    return hf
