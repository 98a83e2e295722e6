"""Tiny random Gemma 4 checkpoints built with transformers' own config classes: a dense image-text
`Gemma4ForConditionalGeneration` (tiny vision tower, per-layer input embeddings, tied K=V on global layers,
soft-capped logits) and a MoE `Gemma4ForCausalLM` (separate V). Both mix 16-wide sliding layers (window 8,
2 KV heads) with 32-wide global ones (1 KV head). Shared by the model, engine and cache tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import (
    Gemma4Config,
    Gemma4TextConfig,
    Gemma4UnifiedConfig,
    Gemma4VisionConfig,
    PretrainedConfig,
)

WINDOW = 8
TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    sliding_window=WINDOW,
    layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    vocab_size=256,
    max_position_embeddings=512,
)
DENSE = dict(TEXT, attention_k_eq_v=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=256,
             final_logit_softcapping=30.0)
MOE = dict(TEXT, attention_k_eq_v=False, hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=8,
           top_k_experts=2, moe_intermediate_size=32)
VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16)


def configs() -> dict[str, PretrainedConfig]:
    return {
        "dense": Gemma4Config(text_config=DENSE, vision_config=Gemma4VisionConfig(**VISION), audio_config=None,
                              architectures=["Gemma4ForConditionalGeneration"]),
        "moe": Gemma4TextConfig(**MOE, architectures=["Gemma4ForCausalLM"]),
    }


def unified_config(**text: object) -> Gemma4UnifiedConfig:
    """Gemma 4 12B's layout (`gemma4_unified`): the dense text model (K=V globals, soft-capped logits, no per-layer
    inputs) inside the unified checkpoint, with tiny audio and vision embedders the loader must skip; `text`
    overrides the text config (a real tokenizer's vocabulary, a longer context)."""
    text = dict(TEXT, attention_k_eq_v=True, final_logit_softcapping=30.0, **text)
    vision = dict(patch_size=4, pooling_kernel_size=2, mm_embed_dim=32, mm_posemb_size=16, output_proj_dims=64)
    return Gemma4UnifiedConfig(text_config=text, vision_config=vision, audio_config=dict(audio_embed_dim=16),
                               architectures=["Gemma4UnifiedForConditionalGeneration"])


def save_gemma4(config: PretrainedConfig, path: Path, seed: int = 0) -> torch.nn.Module:
    """The transformers model of config.architectures[0], every parameter random, saved with save_pretrained."""
    torch.manual_seed(seed)
    hf = getattr(transformers, config.architectures[0])(config).float().eval()
    with torch.no_grad():
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            if "embed_scale" in name or "inv_freq" in name or not p.is_floating_point():
                continue  # derived from the config, not saved
            if "layer_scalar" in name or "norm" in name or name.endswith("scale"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))  # stored as is (no w - 1)
            else:
                p.copy_(0.08 * torch.randn_like(p))
    hf.save_pretrained(path)
    return hf
