"""A tiny random Qwen3.8-Flash-Next (`qwen4_exp`, `Qwen4ExpForConditionalGeneration`) built with transformers' own
config classes and saved with save_pretrained in the released image-text layout (`model.language_model.`, a
one-block vision tower the loader skips, the n-gram tables in `split_ngram_parts` shards): Gated DeltaNet layers
(two of them with a PLE n-gram layer), QSA attention layers, 4 hyper-connection streams, a shared-expert MoE
everywhere. QSA blocks of 4 tokens and a budget of 8 tokens (2 blocks), so prompts past 12 tokens make the
indexer drop blocks. Token 2 is the end of text: the n-gram context resets after it. Shared by the model, engine
and session tests.

The reference for a prompt is transformers' token-by-token decode (`hf_causal_logits`), the computation
generate() continues with; the model tests check its full forward agrees where they say so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import Qwen4ExpConfig, Qwen4ExpTextConfig

LINEAR, INDEXED = "linear_attention", "indexed_attention"
EOS = 2
TEXT: dict[str, Any] = dict(
    vocab_size=256, hidden_size=32, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
    num_experts_per_tok=2, hc_count=4, hc_lowrank=16, ple_layer_ids=[1, 4], ple_embed_dim=16, ngram_size=3,
    heads_per_ngram=2, ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=128, split_ngram_parts=3,
    indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=4,
    output_gate_type="sigmoid", max_position_embeddings=4096, eos_token_id=EOS, pad_token_id=0,
    layer_types=[LINEAR, INDEXED, LINEAR, LINEAR, INDEXED],
    # the release's partial rope (a quarter of each head), in the multimodal form transformers keeps for text
    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[1, 1, 0],
                         mrope_interleaved=True),
)
VISION: dict[str, Any] = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=32,
                              patch_size=2, temporal_patch_size=2, spatial_merge_size=1)


def tiny_config(**text: Any) -> Qwen4ExpConfig:
    return Qwen4ExpConfig(text_config={**TEXT, **text}, vision_config=VISION,
                          architectures=["Qwen4ExpForConditionalGeneration"])


def text_only_config(**text: Any) -> Qwen4ExpTextConfig:
    """The text-only layout (`Qwen4ExpForCausalLM`: the text model under `model.`)."""
    return Qwen4ExpTextConfig(**{**TEXT, **text}, architectures=["Qwen4ExpForCausalLM"])


def randomize(hf: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every weight random, in place: zero-centred norms near zero (they store w - 1), the delta net's gated norm
    near one, slow decays (a state resumed from the wrong place shows for many tokens), the rest small."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(-2.0 - 2.0 * torch.rand(p.shape, generator=g))
            elif "linear_attn.norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return hf


def save_qwen4_exp(path: Path, config: Qwen4ExpConfig | None = None, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    hf = transformers.Qwen4ExpForConditionalGeneration(config or tiny_config()).float().eval()
    randomize(hf, seed)
    hf.save_pretrained(path)
    return hf

