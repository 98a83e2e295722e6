"""Tiny random hybrid checkpoints (Gated DeltaNet + gated attention) built with transformers' own config classes
and saved in the released layout: Qwen3.5 dense and MoE as image-text `ForConditionalGeneration` with a tiny
vision tower, Qwen3-Next as a causal LM. Shared by the hybrid model, engine and session tests."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from transformers import PretrainedConfig, Qwen3_5Config, Qwen3_5MoeConfig, Qwen3NextConfig

TEXT = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,  # 3 Gated DeltaNet layers, then 1 gated attention layer
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)
# experts of 64: at tp 2 each rank holds 32 columns, one Q8_0 block, of a GGUF expert
MOE = dict(TEXT, moe_intermediate_size=64, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2)
VISION = dict(
    depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=2,
    temporal_patch_size=2, spatial_merge_size=1,
)


def configs() -> dict[str, PretrainedConfig]:
    return {
        "qwen3_5": Qwen3_5Config(text_config=TEXT, vision_config=VISION, architectures=["Qwen3_5ForConditionalGeneration"]),
        "qwen3_5_moe": Qwen3_5MoeConfig(
            text_config=MOE, vision_config=VISION, architectures=["Qwen3_5MoeForConditionalGeneration"]
        ),
        # layer 1 dense (mlp_only_layers) so both MLP kinds are exercised
        "qwen3_next": Qwen3NextConfig(**MOE, mlp_only_layers=[1], architectures=["Qwen3NextForCausalLM"]),
    }


def save_hybrid(config: PretrainedConfig, path: Path, seed: int = 0) -> torch.nn.Module:
    """The transformers model of config.architectures[0], every parameter random, saved with save_pretrained."""
    torch.manual_seed(seed)
    cls = getattr(transformers, config.architectures[0])
    hf = cls(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                # slow decays (0.9 to 0.99 a token): a state resumed from the wrong place shows for many tokens
                p.copy_(torch.empty_like(p).uniform_(-4.0, -2.0))
            elif "norm" in name:
                # zero-centred norms store w - 1: small values; the delta net's gated norm stores w
                p.copy_(0.1 * torch.randn_like(p) + (1.0 if "linear_attn.norm" in name else 0.0))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    hf.save_pretrained(path)
    return hf


def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] float32 from one full forward (no cache): the reference for every path."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: generate would otherwise take token 0 (the pad id) for padding
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()
