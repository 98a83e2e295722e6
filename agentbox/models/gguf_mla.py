"""GGUF files of MLA models: llama.cpp stores GLM-4.7-Flash (and the DeepSeek-V3 layout) as `deepseek2`.

What the converter changed, undone here:
- kv_b_proj is split per head into `attn_k_b` [H, kv_lora_rank, qk_nope] (transposed, for llama.cpp's absorbed
  decode) and `attn_v_b` [H, v_head_dim, kv_lora_rank]; they are joined back into kv_b_proj's rows, per head
  [k_nope rows | v rows] (older files carry `attn_kv_b` whole, mapped as is).
- The router's correction bias is `exp_probs_b.bias`, the shared expert `ffn_*_shexp`.
- The multi-token-prediction layer is the last block (`nextn_predict_layers`); its tensors keep HF names
  under `model.layers.{n}.`, which the model skips at load and names in the log.
Rope: the converter does not permute rows for this architecture; llama.cpp rotates adjacent pairs, which is
HF's `rope_interleave`.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from transformers import Glm4MoeLiteConfig, PretrainedConfig

from agentbox.models.gguf_family import (
    GLOBAL_NAMES,
    GGUFFamily,
    Weights,
    blocks,
    dense,
    kept_quantised,
    stacked_experts,
)
from agentbox.models.gguf_reader import GGUFFile, GGUFTensor

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
_SPLIT_KV_B = ("attn_k_b", "attn_v_b")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_.]+)\.(weight|bias)$")
SIGMOID_GATING = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def mla_config(reader: GGUFFile, arch: str) -> PretrainedConfig:
    def meta(key: str, default: Any = None) -> Any:
        return reader.metadata.get(f"{arch}.{key}", default)

    gating = int(meta("expert_gating_func", SIGMOID_GATING))
    if gating != SIGMOID_GATING:
        raise ValueError(
            f"GGUF {arch}: expert gating function {gating} (softmax: DeepSeek-V2) is not supported; "
            "agentbox runs the sigmoid noaux_tc routing of GLM-4.7-Flash and DeepSeek-V3"
        )
    if meta("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"GGUF {arch}: rope scaling {meta('rope.scaling.type')!r} is not supported for MLA yet")
    nextn = int(meta("nextn_predict_layers", 0) or 0)
    layers = int(meta("block_count")) - nextn
    names = {t.name for t in reader.tensors}
    kv_rank, rope = int(meta("attention.kv_lora_rank")), int(meta("rope.dimension_count"))
    heads = int(meta("attention.head_count"))
    # MLA files may store the per-head key / value sizes under *_mla (the plain keys then describe the latent).
    key_len = int(meta("attention.key_length_mla", meta("attention.key_length")))
    vocab = meta("vocab_size") or len(reader.metadata["tokenizer.ggml.tokens"])
    dense = int(meta("leading_dense_block_count", 0))
    return Glm4MoeLiteConfig(
        vocab_size=int(vocab),
        hidden_size=int(meta("embedding_length")),
        intermediate_size=int(meta("feed_forward_length")),
        moe_intermediate_size=int(meta("expert_feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        n_shared_experts=int(meta("expert_shared_count", 0)),
        n_routed_experts=int(meta("expert_count")),
        num_experts_per_tok=int(meta("expert_used_count")),
        routed_scaling_factor=float(meta("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(meta("expert_weights_norm", True)),
        n_group=int(meta("expert_group_count", 1) or 1),
        topk_group=int(meta("expert_group_used_count", 1) or 1),
        kv_lora_rank=kv_rank,
        q_lora_rank=int(meta("attention.q_lora_rank", 0)) or None,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=key_len - rope,
        v_head_dim=int(meta("attention.value_length_mla", meta("attention.value_length"))),
        mlp_layer_types=["dense" if i < dense else "sparse" for i in range(layers)],
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(meta("context_length", 4096)),
        rope_parameters={"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0))},
        rope_interleave=True,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=reader.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=reader.metadata.get("tokenizer.ggml.eos_token_id"),
        num_nextn_predict_layers=nextn,
        architectures=["Glm4MoeLiteForCausalLM"],
    )


def mla_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor (`{e}` for stacked experts); None for the split kv_b halves, which
    `mla_weights` joins. A tensor of a block we do not know keeps its GGUF suffix under the block's HF
    prefix (the MTP layer's `nextn.*`: skipped by the model, named in the log)."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    if gguf_name == "rope_freqs.weight":
        return None
    m = _BLOCK_RE.match(gguf_name)
    if m is None:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent we know")
    block, kind, suffix = m.groups()
    if kind in _SPLIT_KV_B:
        return None
    if kind == "exp_probs_b":  # the router's correction bias, stored as `.bias`
        return f"model.layers.{block}.mlp.gate.e_score_correction_bias"
    return f"model.layers.{block}.{_BLOCK_NAMES.get(kind, kind)}.{suffix}"


def mla_weights(reader: GGUFFile, config: PretrainedConfig, keep_quantised: bool) -> Weights:
    """HF-named weights, kv_b_proj joined back from its halves last."""
    split: dict[str, dict[str, GGUFTensor]] = {}
    for tensor in reader.tensors:
        m = _BLOCK_RE.match(tensor.name)
        if m is not None and m.group(2) in _SPLIT_KV_B:
            split.setdefault(m.group(1), {})[m.group(2)] = tensor
            continue
        name = mla_tensor_name(tensor.name)
        if name is None:
            continue
        if "{e}" in name:
            yield from stacked_experts(reader, tensor, name, keep_quantised)
        elif keep_quantised and kept_quantised(name, tensor):
            yield name, blocks(tensor, reader.raw(tensor))
        else:
            yield name, dense(reader, tensor)
    for block, halves in split.items():
        if set(halves) != set(_SPLIT_KV_B):
            raise ValueError(f"GGUF block {block}: attn_k_b and attn_v_b must both be present, found {sorted(halves)}")
        k_b = dense(reader, halves["attn_k_b"])  # [H, kv_lora_rank, nope]
        v_b = dense(reader, halves["attn_v_b"])  # [H, v_head_dim, kv_lora_rank]
        kv_b = torch.cat([k_b.transpose(1, 2), v_b], dim=1)  # [H, nope + v, kv_lora_rank]
        yield f"model.layers.{block}.self_attn.kv_b_proj.weight", kv_b.reshape(-1, kv_b.shape[-1]).contiguous()


MLA = GGUFFamily(("deepseek2",), mla_config, mla_tensor_name, mla_weights)
