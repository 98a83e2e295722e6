"""The tiny GLM-4.7-Flash written as llama.cpp's converter writes it (`deepseek2`, gguf's writer and its own
tensor-name map): kv_b_proj split per head into `attn_k_b` (transposed) and `attn_v_b`, the router's correction
bias as `exp_probs_b.bias`, experts stacked. Linear weights and the vocabulary tables whose input is a multiple of 32,
and the experts, are Q8_0 (the transformers twin is rounded in place to what the file holds), the rest F32."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from agentbox.models.gguf_family import VOCAB_TABLES  # Q8_0 as the converter writes them


def _q8(w: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    raw = gguf.quants.quantize(w.numpy().astype(np.float32), Q.Q8_0)
    return raw, torch.from_numpy(np.array(gguf.quants.dequantize(raw, Q.Q8_0), dtype=np.float32)).reshape(w.shape)


def _metadata(writer: gguf.GGUFWriter, c) -> None:  # noqa: ANN001
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(1)  # MLA: one latent "head"
    writer.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    writer.add_value_length(c.kv_lora_rank)
    writer.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    writer.add_value_length_mla(c.v_head_dim)
    writer.add_q_lora_rank(c.q_lora_rank)
    writer.add_kv_lora_rank(c.kv_lora_rank)
    writer.add_rope_dimension_count(c.qk_rope_head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_leading_dense_block_count(c.mlp_layer_types.count("dense"))
    writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    writer.add_expert_count(c.n_routed_experts)
    writer.add_expert_shared_count(c.n_shared_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_weights_scale(c.routed_scaling_factor)
    writer.add_expert_weights_norm(c.norm_topk_prob)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_group_count(c.n_group)
    writer.add_expert_group_used_count(c.topk_group)
    writer.add_vocab_size(c.vocab_size)


def write_glm_gguf(hf: torch.nn.Module, path: Path) -> Path:
    c = hf.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, c.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2])
    _metadata(writer, c)
    tensors = {**dict(hf.named_parameters()), **{n: b for n, b in hf.named_buffers() if "correction" in n}}
    for name, p in tensors.items():
        w = p.detach().float().clone()
        if ".mlp.experts." in name:  # stacked: gate_up [E, 2I, H], down [E, H, I]
            base = name.rsplit(".", 1)[0]
            parts = zip(("gate_proj", "up_proj"), w.chunk(2, dim=1), strict=True) if "gate_up" in name else [("down_proj", w)]
            rounded = []
            for proj, part in parts:
                raw, back = _q8(part.reshape(-1, part.shape[-1]))
                writer.add_tensor(names.get_name(f"{base}.{proj}") + ".weight", raw.reshape(part.shape[0], part.shape[1], -1),
                                  raw_dtype=Q.Q8_0)
                rounded.append(back.reshape(part.shape))
            with torch.no_grad():
                p.copy_(torch.cat(rounded, dim=1))
            continue
        if name.endswith("kv_b_proj.weight"):  # the converter's split for llama.cpp's absorbed decode
            kv_b = w.view(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, c.kv_lora_rank)
            k_b, v_b = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
            base = name.removesuffix("kv_b_proj.weight")
            writer.add_tensor(names.get_name(base + "k_b_proj.weight", try_suffixes=(".weight",)), k_b.transpose(1, 2).contiguous().numpy())
            writer.add_tensor(names.get_name(base + "v_b_proj.weight", try_suffixes=(".weight",)), v_b.contiguous().numpy())
            continue
        if name.endswith("e_score_correction_bias"):
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise KeyError(f"gguf has no name for {name}")
        if w.dim() == 2 and w.shape[1] % 32 == 0 and (name.endswith("proj.weight") or name in VOCAB_TABLES):
            raw, back = _q8(w)
            writer.add_tensor(gname, raw, raw_dtype=Q.Q8_0)
            with torch.no_grad():
                p.copy_(back)
        else:
            writer.add_tensor(gname, w.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
