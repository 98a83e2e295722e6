"""GGUF files of the hybrid Qwen models (`qwen35`, `qwen35moe`, `qwen3next`), as llama.cpp's converter writes them.

What the converter changed, undone here so the tensors are the Hugging Face ones our layers load:
- zero-centred norms are stored as 1 + w (all but the delta net's gated norm): 1 is subtracted back;
- `A_log` is stored as `ssm_a` = -exp(A_log), `dt_bias` as `ssm_dt.bias`, the conv kernel squeezed to [C, K];
- Qwen3-Next's grouped `in_proj_qkvz` is split into `attn_qkv` ([q | k | v] of every head) and `attn_gate` (z):
  the Qwen3.5 layout, which our delta net loads as such; `ssm_ba` stays grouped by key head and is split here;
- Qwen3.5/3.6 files order value heads tiled ([k0 k1 .. k0 k1 ..], for ggml's broadcast) where the checkpoint
  groups them by key head ([k0 k0 .. k1 k1 ..]); rows go back by moving whole rows (quantised blocks stay as
  they are), out_proj's columns by dequantising it when the file quantised it (one matrix per layer).
The config is a text-only Qwen3-Next config; the model is the Qwen3.5 layout (`Qwen3HybridGGUF`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import PretrainedConfig, Qwen3NextConfig

from agentbox.models.gguf_family import (
    BLOCK_RE,
    GLOBAL_NAMES,
    VOCAB_TABLES,
    GGUFFamily,
    Weights,
    blocks,
    dense,
    kept_quantised,
    stacked_experts,
)
from agentbox.models.gguf_reader import GGUFFile

HYBRID_CLASS = "Qwen3HybridGGUF"  # registry name of the model class these files load into

_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm": "self_attn.q_norm.weight",
    "attn_k_norm": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}
_SHIFTED_NORMS = ("attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm", "output_norm")


def hybrid_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = BLOCK_RE.match(gguf_name)
    if m is None:
        return None
    key = m.group(2)
    name = _NAMES.get(key, _NAMES.get(key.removesuffix(".weight")))
    if name is None:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent we know")
    return f"model.layers.{m.group(1)}.{name}"


def hybrid_config(reader: GGUFFile, arch: str) -> PretrainedConfig:
    def meta(key: str, default: Any = None) -> Any:
        return reader.metadata.get(f"{arch}.{key}", default)

    names = {t.name for t in reader.tensors}
    layers, heads = int(meta("block_count")), int(meta("attention.head_count"))
    hidden = int(meta("embedding_length"))
    head_dim = int(meta("attention.key_length", hidden // heads))
    interval = int(meta("full_attention_interval", 4))
    hk, hv = int(meta("ssm.group_count")), int(meta("ssm.time_step_rank"))
    vocab = meta("vocab_size") or len(reader.metadata["tokenizer.ggml.tokens"])
    moe = "blk.0.ffn_gate_inp.weight" in names
    kwargs: dict[str, Any] = dict(
        vocab_size=int(vocab), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(meta("attention.head_count_kv", heads)), head_dim=head_dim,
        intermediate_size=int(meta("feed_forward_length", meta("expert_feed_forward_length", 1)) or 1),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(meta("context_length", 4096)),
        rope_parameters={"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 10000.0)),
                         "partial_rotary_factor": int(meta("rope.dimension_count", head_dim // 4)) / head_dim},
        layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)],
        linear_conv_kernel_dim=int(meta("ssm.conv_kernel")), linear_key_head_dim=int(meta("ssm.state_size")),
        linear_num_key_heads=hk, linear_num_value_heads=hv,
        linear_value_head_dim=int(meta("ssm.inner_size")) // hv,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=reader.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=reader.metadata.get("tokenizer.ggml.eos_token_id"),
        num_experts=int(meta("expert_count", 0)) if moe else 0,
        architectures=[HYBRID_CLASS],
    )
    if moe:
        kwargs.update(
            num_experts_per_tok=int(meta("expert_used_count")),
            moe_intermediate_size=int(meta("expert_feed_forward_length")),
            shared_expert_intermediate_size=int(meta("expert_shared_feed_forward_length")),
            norm_topk_prob=True, decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names],
        )
    return Qwen3NextConfig(**kwargs)


def _untile(x: np.ndarray | torch.Tensor, axis: int, hk: int, r: int) -> Any:
    """Value heads along `axis` from tiled ([r, hk] order) back to grouped by key head ([hk, r])."""
    shape = list(x.shape)
    rest = shape[axis] // (hk * r)
    split = [*shape[:axis], r, hk, rest, *shape[axis + 1 :]]
    if isinstance(x, torch.Tensor):
        return x.reshape(split).transpose(axis, axis + 1).reshape(shape)
    return np.ascontiguousarray(x.reshape(split).swapaxes(axis, axis + 1)).reshape(shape)


def hybrid_weights(reader: GGUFFile, config: PretrainedConfig, keep_quantised: bool) -> Weights:
    """HF-named weights (out_proj of tiled files and the grouped in_proj_ba dense: they are reordered by columns
    or split)."""
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    r = hv // hk
    tiled = reader.metadata.get("general.architecture") != "qwen3next" and r > 1  # Qwen3.5/3.6 tile value heads
    key_rows = 2 * hk * config.linear_key_head_dim
    for tensor in reader.tensors:
        name = hybrid_tensor_name(tensor.name)
        if name is None:
            continue
        if "{e}" in name:
            yield from stacked_experts(reader, tensor, name, keep_quantised)
            continue
        if (keep_quantised and kept_quantised(name, tensor) and not (tiled and "out_proj" in name)
                and "in_proj_ba" not in name):
            raw = reader.raw(tensor)
            if tiled and "in_proj_qkv" in name:
                raw = np.concatenate([raw[:key_rows], _untile(raw[key_rows:], 0, hk, r)])
            elif tiled and ("in_proj_z" in name or "in_proj_b" in name or "in_proj_a" in name):
                raw = _untile(raw, 0, hk, r)
            yield name, blocks(tensor, raw)
            continue
        w = dense(reader, tensor, keep_f16=name in VOCAB_TABLES or ("_proj" in name and name.endswith(".weight")))
        parts = tensor.name.split(".")
        if (parts[2] if parts[0] == "blk" else parts[0]) in _SHIFTED_NORMS:
            w = w - 1.0
        if name.endswith("A_log"):
            w = torch.log(-w)
        if name.endswith("conv1d.weight"):
            w = w.reshape(w.shape[0], 1, -1)
        if name.endswith("in_proj_ba.weight"):  # qwen3next: [hk, (b r, a r)] rows -> b and a
            ba = w.reshape(hk, 2, r, -1)
            base = name.removesuffix("in_proj_ba.weight")
            yield base + "in_proj_b.weight", ba[:, 0].reshape(hv, -1)
            yield base + "in_proj_a.weight", ba[:, 1].reshape(hv, -1)
            continue
        if tiled:
            if "in_proj_qkv" in name:
                w = torch.cat([w[:key_rows], _untile(w[key_rows:], 0, hk, r)])
            elif any(p in name for p in ("in_proj_z", "in_proj_b", "in_proj_a", "A_log", "dt_bias")):
                w = _untile(w, 0, hk, r)
            elif "conv1d" in name:
                w = torch.cat([w[:key_rows], _untile(w[key_rows:], 0, hk, r)])
            elif "out_proj" in name:
                w = _untile(w, 1, hk, r)
        yield name, w


HYBRID = GGUFFamily(("qwen35", "qwen35moe", "qwen3next"), hybrid_config, hybrid_tensor_name, hybrid_weights)
