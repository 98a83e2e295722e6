"""A tiny hybrid Qwen model written as llama.cpp's converter writes it (gguf's writer and its own tensor-name map):
zero-centred norms stored as 1 + w, `ssm_a` = -exp(A_log), dt_bias as `ssm_dt.bias`, the conv kernel squeezed,
Qwen3-Next's grouped qkvz split into `attn_qkv` + `attn_gate`, and Qwen3.5's value heads reordered from grouped to
tiled. Linear weights whose layout change moves whole rows are Q8_0 (the transformers twin gets the same rounded
values), the rest F32."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

ARCH = {"qwen3_5": gguf.MODEL_ARCH.QWEN35, "qwen3_5_moe": gguf.MODEL_ARCH.QWEN35MOE, "qwen3_next": gguf.MODEL_ARCH.QWEN3NEXT}


def _tile(x: torch.Tensor, axis: int, hk: int, r: int) -> torch.Tensor:
    """Value heads along `axis` from grouped by key head ([hk, r]) to tiled ([r, hk])."""
    shape = list(x.shape)
    split = [*shape[:axis], hk, r, shape[axis] // (hk * r), *shape[axis + 1 :]]
    return x.reshape(split).transpose(axis, axis + 1).reshape(shape)


def _q8(w: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    raw = gguf.quants.quantize(w.numpy().astype(np.float32), Q.Q8_0)
    return raw, torch.from_numpy(np.array(gguf.quants.dequantize(raw, Q.Q8_0), dtype=np.float32)).reshape(w.shape)


def write_hybrid_gguf(hf: torch.nn.Module, kind: str, path: Path) -> Path:
    """Writes hf's text model to `path` and rounds hf's Q8_0-stored weights in place to what the file holds."""
    text = hf.config.get_text_config()
    arch = ARCH[kind]
    layers = text.num_hidden_layers
    names = gguf.get_tensor_name_map(arch, layers)
    hk, hv, dk, dv = (text.linear_num_key_heads, text.linear_num_value_heads, text.linear_key_head_dim,
                      text.linear_value_head_dim)
    r, key_rows, tiled = hv // hk, 2 * hk * dk, kind != "qwen3_next"
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(layers)
    writer.add_context_length(text.max_position_embeddings)
    writer.add_embedding_length(text.hidden_size)
    writer.add_feed_forward_length(text.intermediate_size)
    writer.add_head_count(text.num_attention_heads)
    writer.add_head_count_kv(text.num_key_value_heads)
    writer.add_key_length(text.head_dim)
    writer.add_value_length(text.head_dim)
    writer.add_layer_norm_rms_eps(text.rms_norm_eps)
    writer.add_rope_freq_base(text.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(int(text.head_dim * text.rope_parameters["partial_rotary_factor"]))
    writer.add_ssm_conv_kernel(text.linear_conv_kernel_dim)
    writer.add_ssm_state_size(dk)
    writer.add_ssm_group_count(hk)
    writer.add_ssm_time_step_rank(hv)
    writer.add_ssm_inner_size(hv * dv)
    writer.add_full_attention_interval(4)
    writer.add_vocab_size(text.vocab_size)
    if getattr(text, "num_experts", 0):
        writer.add_expert_count(text.num_experts)
        writer.add_expert_used_count(text.num_experts_per_tok)
        writer.add_expert_feed_forward_length(text.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(text.shared_expert_intermediate_size)
    params = dict(hf.named_parameters())
    experts: dict[str, list[torch.Tensor]] = {}
    for full_name, p in params.items():
        if "visual" in full_name or full_name.startswith("mtp"):
            continue
        name = full_name.replace("model.language_model.", "model.")
        w = p.detach().float().clone()
        if ".mlp.experts." in name:  # transformers keeps experts stacked: gate_up [E, 2I, H], down [E, H, I]
            base = name.rsplit(".", 1)[0]
            if name.endswith("gate_up_proj"):
                gate, up = w.chunk(2, dim=1)
                experts[base + ".gate_proj"], experts[base + ".up_proj"] = [gate], [up]
            else:
                experts[base + ".down_proj"] = [w]
            continue
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w + 1.0
        if name.endswith("A_log"):
            w = -torch.exp(w)
        if name.endswith("dt_bias"):
            name = name.removesuffix("dt_bias") + "dt_proj.bias"
        if "conv1d" in name:
            w = w.squeeze(1)
        if _stored_q8(name, w, tiled and r > 1):
            w = _q8(w)[1]  # rounded before any row move: Q8_0 rounds each row on its own, so the file holds it
            with torch.no_grad():
                p.copy_(w.reshape(p.shape))
        out: list[tuple[str, torch.Tensor]] = [(name, w)]
        if name.endswith("in_proj_qkvz.weight"):  # [hk, (q k v z)] -> [q | k | v] and z
            groups = w.reshape(hk, 2 * dk + 2 * r * dv, -1)
            q, k, v, z = groups.split([dk, dk, r * dv, r * dv], dim=1)
            base = name.removesuffix("in_proj_qkvz.weight")
            cat = torch.cat([q.reshape(hk * dk, -1), k.reshape(hk * dk, -1), v.reshape(hv * dv, -1)])
            out = [(base + "in_proj_qkv.weight", cat), (base + "in_proj_z.weight", z.reshape(hv * dv, -1))]
        elif tiled and r > 1:
            if "in_proj_qkv" in name or "conv1d" in name:
                w = torch.cat([w[:key_rows], _tile(w[key_rows:], 0, hk, r)])
            elif any(s in name for s in ("in_proj_z", "in_proj_b", "in_proj_a", "A_log", "dt_proj")):
                w = _tile(w, 0, hk, r)
            elif "out_proj" in name:
                w = _tile(w, 1, hk, r)
            out = [(name, w)]
        for hf_name, t in out:
            _add(writer, names, hf_name, t, _stored_q8(hf_name, t, tiled and r > 1))
    for base, (w,) in experts.items():
        gname = names.get_name(base) + ".weight"
        raw, _ = _q8(w.reshape(-1, w.shape[-1]))
        writer.add_tensor(gname, raw.reshape(w.shape[0], w.shape[1], -1), raw_dtype=Q.Q8_0)
    for name, p in params.items():  # the twin's experts: what the Q8_0 file holds
        if ".mlp.experts." in name:
            with torch.no_grad():
                p.copy_(_q8(p.detach().reshape(-1, p.shape[-1]))[1].reshape(p.shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _stored_q8(name: str, w: torch.Tensor, tiled: bool) -> bool:
    """Q8_0 in the file: linear weights, except those whose layout change moves columns (out_proj when tiled)."""
    linear = w.dim() == 2 and w.shape[1] % 32 == 0 and name.endswith("proj.weight")
    return linear and "in_proj_ba" not in name and not (tiled and "out_proj" in name)


def _add(writer: gguf.GGUFWriter, names: gguf.TensorNameMap, name: str, w: torch.Tensor, q8: bool) -> None:
    gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if gname is None:
        raise KeyError(f"gguf has no name for {name}")
    if q8:
        writer.add_tensor(gname, _q8(w)[0], raw_dtype=Q.Q8_0)
    else:
        writer.add_tensor(gname, w.numpy().astype(np.float32))
