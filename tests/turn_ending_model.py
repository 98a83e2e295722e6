"""A tiny random Qwen3 that ends every turn at once, for real clients and routers that must see turns finish.

A random model never emits end-of-turn, so a client's turn never ends. Here the residual stream stays the
embedding (attention and MLP write nothing) and dimension 0 is a constant that only the end-of-turn row of
the head reads: every turn ends after its first token."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_turn_ending_qwen3(d: Path, tokenizer: Any, max_positions: int) -> Path:
    """Saves the model with `tokenizer` (SmolLM2's: its chat template and `<|im_end|>`) in the released layout."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      max_position_embeddings=max_positions, eos_token_id=eot, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 4.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[eot, 0] = 30.0
    model.save_pretrained(d, safe_serialization=True)
    tokenizer.save_pretrained(d)
    return d
