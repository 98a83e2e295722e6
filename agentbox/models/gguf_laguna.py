"""GGUF files of Laguna (`laguna`), as llama.cpp's converter writes them (conversion/laguna.py), loaded into
models/laguna.py.

What the converter wrote, read back here:
- `attention.head_count` is one value per layer (the per-layer query heads); KV heads and `key_length` are shared;
- which layers slide is not written: llama.cpp takes XS.2's pattern (a global layer every 4, the first one
  global) when `attention.sliding_window` is set, and reads `attention.sliding_window_pattern` when a file has it;
  so does this;
- rope: `rope.freq_base` and `rope.dimension_count` (the rotated channels: the partial rotary) for the global
  layers, with their YaRN scaling keys; `rope.freq_base_swa` and `rope.dimension_count_swa` for the sliding ones;
- `leading_dense_block_count`: the first layers' MLP is dense, the rest MoE; `expert_weights_scale` is the routed
  scaling; experts are stacked, the router's correction bias is `exp_probs_b.bias`, the shared expert `*_shexp`;
- the gate's granularity is the width of `attn_gate` (one per head, or head_dim per head);
- the router's logit soft cap is not written (llama.cpp's graph has none): a file gives 0, as llama.cpp computes.
The rest is the llama family's names (no q/k row permutation: the converter's Laguna is not its Llama).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from transformers import LagunaConfig, PretrainedConfig

from agentbox.models.gguf_family import (
    BLOCK_RE,
    GLOBAL_NAMES,
    GGUFFamily,
    Weights,
    blocks,
    dense,
    kept_quantised,
    stacked_experts,
)
from agentbox.models.gguf_reader import GGUFFile

_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_gate.weight": "self_attn.g_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
SLIDING, GLOBAL = "sliding_attention", "full_attention"
PATTERN_PERIOD = 4  # llama.cpp's Laguna: a global layer at every 4th, starting with the first


def laguna_tensor_name(gguf_name: str) -> str | None:
    """Our checkpoint name of a laguna GGUF tensor (`{e}` for stacked experts)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Laguna equivalent we know")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"


def _per_layer(value: Any, layers: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list | tuple | np.ndarray) else [int(value)] * layers


def _rope(meta: Any, suffix: str, head_dim: int, theta_default: float) -> dict[str, Any]:
    rotated = int(meta(f"rope.dimension_count{suffix}", head_dim))
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta(f"rope.freq_base{suffix}", theta_default)),
                              "partial_rotary_factor": rotated / head_dim}
    if suffix or meta("rope.scaling.type") != "yarn":
        return params  # the sliding layers run plain rope (llama.cpp zeroes YaRN there)
    params.update(rope_type="yarn", factor=float(meta("rope.scaling.factor")),
                  original_max_position_embeddings=int(meta("rope.scaling.original_context_length")))
    for key, name in (("beta_fast", "rope.scaling.yarn_beta_fast"), ("beta_slow", "rope.scaling.yarn_beta_slow"),
                      ("attention_factor", "rope.scaling.yarn_attn_factor")):
        if meta(name) is not None:
            params[key] = float(meta(name))
    return params


def laguna_config(reader: GGUFFile, arch: str) -> PretrainedConfig:
    def meta(key: str, default: Any = None) -> Any:
        return reader.metadata.get(f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    layers = int(meta("block_count"))
    heads = _per_layer(meta("attention.head_count"), layers)
    head_dim = int(meta("attention.key_length"))
    window = int(meta("attention.sliding_window", 0) or 0)
    pattern = meta("attention.sliding_window_pattern")
    if not window:
        sliding = [False] * layers
    elif pattern is not None:
        sliding = [bool(s) for s in pattern]
    else:
        sliding = [i % PATTERN_PERIOD != 0 for i in range(layers)]
    dense_lead = int(meta("leading_dense_block_count", 0))
    gate_width = int(tensors["blk.0.attn_gate.weight"].shape[0])
    vocab = meta("vocab_size") or len(reader.metadata["tokenizer.ggml.tokens"])
    eos = reader.metadata.get("tokenizer.ggml.eos_token_id")
    eot = reader.metadata.get("tokenizer.ggml.eot_token_id")
    rope = {GLOBAL: _rope(meta, "", head_dim, 500000.0)}
    if window:
        rope[SLIDING] = _rope(meta, "_swa", head_dim, 10000.0)
    return LagunaConfig(
        vocab_size=int(vocab),
        hidden_size=int(meta("embedding_length")),
        intermediate_size=int(meta("feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads[0],
        num_attention_heads_per_layer=heads,
        num_key_value_heads=_per_layer(meta("attention.head_count_kv"), layers)[0],
        head_dim=head_dim,
        sliding_window=window or 4096,  # unused without sliding layers
        layer_types=[SLIDING if s else GLOBAL for s in sliding],
        mlp_layer_types=["dense" if i < dense_lead else "sparse" for i in range(layers)],
        gating=True if gate_width == heads[0] else "per-element",
        num_experts=int(meta("expert_count")),
        num_experts_per_tok=int(meta("expert_used_count")),
        moe_intermediate_size=int(meta("expert_feed_forward_length")),
        shared_expert_intermediate_size=int(meta("expert_shared_feed_forward_length")),
        moe_routed_scaling_factor=float(meta("expert_weights_scale", 1.0)),
        moe_router_logit_softcapping=0.0,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(meta("context_length", 131072)),
        rope_parameters=rope,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=reader.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=[eos, eot] if eot is not None and eot != eos else eos,
        architectures=["LagunaForCausalLM"],
    )


def laguna_weights(reader: GGUFFile, config: PretrainedConfig, keep_quantised: bool) -> Weights:
    """Our checkpoint's names (the router, its bias and the norms dense)."""
    for tensor in reader.tensors:
        name = laguna_tensor_name(tensor.name)
        if name is None:
            continue
        if "{e}" in name:
            yield from stacked_experts(reader, tensor, name, keep_quantised)
        elif keep_quantised and kept_quantised(name, tensor):
            yield name, blocks(tensor, reader.raw(tensor))
        else:
            yield name, dense(reader, tensor)


LAGUNA = GGUFFamily(("laguna",), laguna_config, laguna_tensor_name, laguna_weights)
