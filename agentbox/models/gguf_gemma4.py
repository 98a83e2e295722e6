"""GGUF files of Gemma 4 (`gemma4`), as llama.cpp's converter writes them, loaded into models/gemma4.py.

What the converter wrote, read back here:
- per-layer shapes as metadata: `attention.key_length` is the global layers' head size, `key_length_swa` the
  sliding layers'; `head_count_kv` is one value per layer; `sliding_window_pattern` marks the sliding layers;
- the global layers' "proportional" rope (a quarter of the frequencies turned over the whole head) as a
  `rope_freqs` tensor: 1 for each turned frequency, 1e30 for the rest, so its count of ones gives the share;
- K=V global layers (`attention_k_eq_v`) have no `attn_v`;
- norms are stored as the checkpoint has them (Gemma 4's norm multiplies by w, not 1 + w), `layer_scalar` as
  `layer_output_scale`, the router's input scale as `ffn_gate_inp.scale` and its per-expert scale as
  `ffn_down_exps.scale`; experts are stacked, gate and up either fused (`ffn_gate_up_exps`, gate rows first)
  or apart.
The config is a text-only Gemma4TextConfig; the model is `Gemma4ForCausalLM`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from transformers import Gemma4TextConfig, PretrainedConfig

from agentbox.layers.quant.gguf import GGUFBlocks
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

_GLOBAL = {
    **GLOBAL_NAMES,
    "per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight",
    "per_layer_proj_norm.weight": "model.per_layer_projection_norm.weight",
    "rope_freqs.weight": None,  # the global layers' partial rotary, read into the config instead
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "layer_output_scale.weight": "layer_scalar",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "ffn_gate_exps.weight": "experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "experts.{e}.down_proj.weight",
    "ffn_gate_up_exps.weight": "experts.{e}.gate_up.weight",  # split into gate_proj and up_proj per expert
    "inp_gate.weight": "per_layer_input_gate.weight",
    "proj.weight": "per_layer_projection.weight",
    "post_norm.weight": "post_per_layer_input_norm.weight",
}


def gemma4_tensor_name(gguf_name: str) -> str | None:
    """Our checkpoint name of a gemma4 GGUF tensor (`{e}` for stacked experts), None for one not loaded."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Gemma 4 equivalent we know")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"


def _per_layer(value: Any, layers: int) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list | tuple | np.ndarray) else [int(value)] * layers


def gemma4_config(reader: GGUFFile, arch: str) -> PretrainedConfig:
    def meta(key: str, default: Any = None) -> Any:
        return reader.metadata.get(f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    layers, heads = int(meta("block_count")), int(meta("attention.head_count"))
    if int(meta("attention.shared_kv_layers", 0) or 0):
        raise ValueError("this Gemma 4 GGUF shares KV between layers (E2B/E4B), which agentbox does not run; "
                         "use a gemma-4-31b or gemma-4-26b-a4b GGUF")
    sliding = [bool(s) for s in meta("attention.sliding_window_pattern")]
    kv_heads = _per_layer(meta("attention.head_count_kv", heads), layers)
    global_ids = [i for i in range(layers) if not sliding[i]]
    swa_ids = [i for i in range(layers) if sliding[i]]
    head_dim = int(meta("attention.key_length"))
    freqs = tensors.get("rope_freqs.weight")
    ones = head_dim // 2 if freqs is None else int((dense(reader, freqs) == 1.0).sum())
    ple = int(meta("embedding_length_per_layer_input", 0) or 0)
    moe = "blk.0.ffn_gate_inp.weight" in tensors
    vocab = meta("vocab_size") or len(reader.metadata["tokenizer.ggml.tokens"])
    kwargs: dict[str, Any] = dict(
        vocab_size=int(vocab),
        hidden_size=int(meta("embedding_length")),
        intermediate_size=_per_layer(meta("feed_forward_length"), layers)[0],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads[swa_ids[0]] if swa_ids else kv_heads[0],
        num_global_key_value_heads=kv_heads[global_ids[0]] if global_ids else None,
        head_dim=int(meta("attention.key_length_swa", head_dim)),
        global_head_dim=head_dim,
        sliding_window=int(meta("attention.sliding_window")),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        attention_k_eq_v=bool(global_ids) and f"blk.{global_ids[0]}.attn_v.weight" not in tensors,
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(meta("context_length", 8192)),
        final_logit_softcapping=meta("final_logit_softcapping"),
        hidden_size_per_layer_input=ple,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": float(meta("rope.freq_base_swa", 10000.0))},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": ones / (head_dim // 2),
                               "rope_theta": float(meta("rope.freq_base", 1_000_000.0))},
        },
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=reader.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=reader.metadata.get("tokenizer.ggml.eos_token_id"),
        architectures=["Gemma4ForCausalLM"],
    )
    if ple:
        kwargs["vocab_size_per_layer_input"] = int(tensors["per_layer_token_embd.weight"].shape[0])
    if moe:
        kwargs.update(enable_moe_block=True, num_experts=int(meta("expert_count")),
                      top_k_experts=int(meta("expert_used_count")),
                      moe_intermediate_size=int(meta("expert_feed_forward_length")))
    return Gemma4TextConfig(**kwargs)


def gemma4_weights(reader: GGUFFile, config: PretrainedConfig, keep_quantised: bool) -> Weights:
    """Our checkpoint's names (the per-layer input tables, the router and the norms dense)."""
    for tensor in reader.tensors:
        name = gemma4_tensor_name(tensor.name)
        if name is None:
            continue
        if name.endswith("gate_up.weight"):  # fused [E, 2I, H]: gate rows, then up rows
            for sub, w in stacked_experts(reader, tensor, name, keep_quantised):
                half = w.shape[0] // 2
                gate, up = (w.narrow((0, half), None), w.narrow((half, half), None)) if isinstance(w, GGUFBlocks) else w.split(half)
                yield sub.replace("gate_up.", "gate_proj."), gate
                yield sub.replace("gate_up.", "up_proj."), up
            continue
        if "{e}" in name:
            yield from stacked_experts(reader, tensor, name, keep_quantised)
            continue
        if keep_quantised and kept_quantised(name, tensor):
            yield name, blocks(tensor, reader.raw(tensor))
            continue
        w = dense(reader, tensor)
        yield name, w.reshape(1) if name.endswith("layer_scalar") else w


GEMMA4 = GGUFFamily(("gemma4",), gemma4_config, gemma4_tensor_name, gemma4_weights)
