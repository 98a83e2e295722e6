"""A tiny Gemma 4 written as llama.cpp's converter writes a `gemma4` GGUF (gguf's writer and its own tensor-name
map): per-layer KV heads as an array, the global head size as key_length and the sliding one as key_length_swa,
the sliding pattern, the global layers' partial rotary as a `rope_freqs` tensor (1 per turned frequency, 1e30
for the rest), norms as stored, `layer_output_scale`, the router's scales as `ffn_gate_inp.scale` and
`ffn_down_exps.scale`, experts stacked with gate and up fused. Linear weights and the embedding are Q8_0 (the
transformers twin is rounded in place to what the file holds), the rest F32; the vision tower and the unified checkpoint's embedders are not written (llama.cpp's converter writes
Gemma 4 12B's `gemma4_unified` text model as `gemma4` too)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

ARCH = gguf.MODEL_ARCH.GEMMA4
# Checkpoint suffixes the converter renames itself before the tensor-name map (its Gemma4 modify_tensors)
_RENAMED = {"router.scale": "ffn_gate_inp.scale", "router.per_expert_scale": "ffn_down_exps.scale",
            "layer_scalar": "layer_output_scale.weight"}


def _q8(w: torch.Tensor) -> tuple[np.ndarray, torch.Tensor]:
    raw = gguf.quants.quantize(w.numpy().astype(np.float32), Q.Q8_0)
    return raw, torch.from_numpy(np.array(gguf.quants.dequantize(raw, Q.Q8_0), dtype=np.float32)).reshape(w.shape)


def _metadata(writer: gguf.GGUFWriter, text: object) -> None:
    t = text  # the text config (heterogeneous per layer: read the per-layer values)
    layers = t.num_hidden_layers
    sliding = [k == "sliding_attention" for k in t.layer_types]
    per = [t.per_layer_config[i] for i in range(layers)]
    writer.add_block_count(layers)
    writer.add_context_length(t.max_position_embeddings)
    writer.add_embedding_length(t.hidden_size)
    writer.add_feed_forward_length(t.intermediate_size)
    writer.add_head_count(t.num_attention_heads)
    writer.add_head_count_kv([int(p.num_key_value_heads) for p in per])
    glob = next(p for p, s in zip(per, sliding, strict=True) if not s)
    swa = next(p for p, s in zip(per, sliding, strict=True) if s)
    writer.add_key_length(int(glob.head_dim))
    writer.add_value_length(int(glob.head_dim))
    writer.add_key_length_swa(int(swa.head_dim))
    writer.add_value_length_swa(int(swa.head_dim))
    writer.add_layer_norm_rms_eps(t.rms_norm_eps)
    writer.add_sliding_window(t.sliding_window)
    writer.add_sliding_window_pattern(sliding)
    writer.add_shared_kv_layers(0)
    writer.add_embedding_length_per_layer_input(getattr(t, "hidden_size_per_layer_input", 0) or 0)
    writer.add_rope_freq_base(t.rope_parameters["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(t.rope_parameters["sliding_attention"]["rope_theta"])
    writer.add_rope_dimension_count(int(glob.head_dim))
    writer.add_rope_dimension_count_swa(int(swa.head_dim))
    if t.final_logit_softcapping:
        writer.add_final_logit_softcapping(t.final_logit_softcapping)
    writer.add_vocab_size(t.vocab_size)
    if getattr(t, "enable_moe_block", False):
        writer.add_expert_count(t.num_experts)
        writer.add_expert_used_count(t.top_k_experts)
        writer.add_expert_feed_forward_length(t.moe_intermediate_size)


def write_gemma4_gguf(hf: torch.nn.Module, path: Path) -> Path:
    """Writes hf's text model to `path`; rounds hf's Q8_0-stored weights in place to what the file holds."""
    text = hf.config.get_text_config()
    names = gguf.get_tensor_name_map(ARCH, text.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[ARCH])
    _metadata(writer, text)
    glob = next(i for i, k in enumerate(text.layer_types) if k == "full_attention")
    half = int(text.per_layer_config[glob].head_dim) // 2
    turned = int(half * text.rope_parameters["full_attention"]["partial_rotary_factor"])
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * turned + [1e30] * (half - turned), dtype=np.float32))
    for full_name, p in hf.state_dict().items():  # parameters and saved buffers (layer_scalar), sharing storage
        if "vision" in full_name or "embed_audio" in full_name or full_name == "lm_head.weight" or "inv_freq" in full_name or "embed_scale" in full_name:
            continue
        name = full_name.replace("model.language_model.", "model.")
        w = p.detach().float().clone()
        renamed = next((g for s, g in _RENAMED.items() if name.endswith(s)), None)
        if renamed is not None:
            layer = name.split(".")[2]
            writer.add_tensor(f"blk.{layer}.{renamed}", w.reshape(-1).numpy())
            continue
        base = name.removesuffix(".weight")
        gname = names.get_name(base)
        if gname is None:
            raise KeyError(f"gguf has no name for {name}")
        if w.dim() >= 2 and w.shape[-1] % 32 == 0 and ("proj" in name or "embed_tokens.weight" in name):
            raw, rounded = _q8(w.reshape(-1, w.shape[-1]))
            with torch.no_grad():
                p.copy_(rounded.reshape(p.shape))
            writer.add_tensor(gname + ".weight", raw.reshape(*w.shape[:-1], -1), raw_dtype=Q.Q8_0)
        else:
            writer.add_tensor(gname + ".weight", w.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
