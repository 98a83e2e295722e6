"""GGUF files of Nemotron-H (`nemotron_h`, `nemotron_h_moe`), as llama.cpp's converter writes them
(conversion/nemotron.py), loaded into models/nemotron_h.py.

What the converter wrote, read back here:
- which mixer each layer runs is not a key: it is read from the layer's tensors (`ssm_in` Mamba-2, `attn_q`
  attention, `ffn_up_exps` MoE, `ffn_up` MLP);
- Mamba-2: `ssm.inner_size` (heads x head size), `ssm.time_step_rank` (the heads), `ssm.group_count`,
  `ssm.state_size`, `ssm.conv_kernel`; `ssm_a` holds A = -exp(A_log) (read back as its log), `ssm_d` is D, `ssm_dt`
  the dt bias, the conv weight is [C, K] and the gated norm's weight [groups, group size];
- the scan's chunk size and dt limits are not written (the defaults; the scan's result does not depend on the chunk);
- MoE: `expert_weights_scale` the routed scaling, `expert_group_count` / `expert_group_used_count`, the correction
  bias `exp_probs_b.bias`, the shared expert `*_shexp`.
The experts are un-gated (`ffn_up_exps`, `ffn_down_exps`, no gate): they stay the file's blocks and the GGUF expert
method keeps them quantised as it does gated ones (layers/experts/gguf.py, up alone in w13).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers import NemotronHConfig, PretrainedConfig

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
    "token_embd.weight": "backbone.embeddings.weight",
    "output_norm.weight": "backbone.norm_f.weight",
    "output.weight": GLOBAL_NAMES["output.weight"],
}
_BLOCK = {
    "attn_norm.weight": "norm.weight",
    "ssm_in.weight": "mixer.in_proj.weight",
    "ssm_out.weight": "mixer.out_proj.weight",
    "ssm_conv1d.weight": "mixer.conv1d.weight",
    "ssm_conv1d.bias": "mixer.conv1d.bias",
    "ssm_a": "mixer.A_log",
    "ssm_d": "mixer.D",
    "ssm_dt.bias": "mixer.dt_bias",
    "ssm_norm.weight": "mixer.norm.weight",
    "attn_q.weight": "mixer.q_proj.weight",
    "attn_k.weight": "mixer.k_proj.weight",
    "attn_v.weight": "mixer.v_proj.weight",
    "attn_output.weight": "mixer.o_proj.weight",
    "ffn_up.weight": "mixer.up_proj.weight",
    "ffn_down.weight": "mixer.down_proj.weight",
    "ffn_gate_inp.weight": "mixer.gate.weight",
    "exp_probs_b.bias": "mixer.gate.e_score_correction_bias",
    "ffn_up_exps.weight": "mixer.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mixer.experts.{e}.down_proj.weight",
    "ffn_up_shexp.weight": "mixer.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mixer.shared_experts.down_proj.weight",
}
# A layer's mixer, from the tensor it alone has
_KIND_TENSORS = (("ssm_in.weight", "linear_attention"), ("attn_q.weight", "full_attention"),
                 ("ffn_up_exps.weight", "moe"), ("ffn_up.weight", "mlp"))


def nemotron_h_tensor_name(gguf_name: str) -> str | None:
    """Our checkpoint name of a nemotron_h GGUF tensor (`{e}` for stacked experts)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = BLOCK_RE.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Nemotron-H equivalent we know")
    return f"backbone.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"


def nemotron_h_config(reader: GGUFFile, arch: str) -> PretrainedConfig:
    def meta(key: str, default: Any = None) -> Any:
        return reader.metadata.get(f"{arch}.{key}", default)

    tensors = {t.name: t for t in reader.tensors}
    layers = int(meta("block_count"))
    kinds = []
    for i in range(layers):
        kind = next((k for suffix, k in _KIND_TENSORS if f"blk.{i}.{suffix}" in tensors), None)
        if kind is None:
            raise ValueError(f"Nemotron-H GGUF layer {i} has none of {[s for s, _ in _KIND_TENSORS]}")
        kinds.append(kind)
    if any(n.startswith("blk.") and "latent" in n for n in tensors):
        raise ValueError("this Nemotron-H GGUF has latent MoE projections, which are not read from GGUF yet")
    kv = meta("attention.head_count_kv", 0)  # one value per layer: 0 but on attention layers
    kv_heads = max(int(v) for v in kv) if isinstance(kv, list | tuple | np.ndarray) else int(kv)
    heads = int(meta("ssm.time_step_rank"))
    mlp = next((tensors[f"blk.{i}.ffn_up.weight"] for i, k in enumerate(kinds) if k == "mlp"), None)
    moe = "moe" in kinds
    kwargs: dict[str, Any] = dict(
        vocab_size=int(meta("vocab_size") or len(reader.metadata["tokenizer.ggml.tokens"])),
        hidden_size=int(meta("embedding_length")),
        layers_block_type=kinds,
        num_attention_heads=int(meta("attention.head_count")),
        num_key_value_heads=kv_heads,
        head_dim=int(meta("attention.key_length")),
        intermediate_size=int(mlp.shape[0]) if mlp is not None else 1,
        mamba_num_heads=heads,
        mamba_head_dim=int(meta("ssm.inner_size")) // heads,
        n_groups=int(meta("ssm.group_count")),
        ssm_state_size=int(meta("ssm.state_size")),
        conv_kernel=int(meta("ssm.conv_kernel")),
        use_conv_bias=any(n.endswith("ssm_conv1d.bias") for n in tensors),
        layer_norm_epsilon=float(meta("attention.layer_norm_epsilon", 1e-5)),
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=reader.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=reader.metadata.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=reader.metadata.get("tokenizer.ggml.padding_token_id"),
        architectures=["NemotronHForCausalLM"],
    )
    if moe:
        kwargs.update(
            n_routed_experts=int(meta("expert_count")), num_experts_per_tok=int(meta("expert_used_count")),
            moe_intermediate_size=int(meta("expert_feed_forward_length")),
            moe_shared_expert_intermediate_size=int(meta("expert_shared_feed_forward_length")),
            n_group=int(meta("expert_group_count", 1)), topk_group=int(meta("expert_group_used_count", 1)),
            norm_topk_prob=bool(meta("expert_weights_norm", True)),
            routed_scaling_factor=float(meta("expert_weights_scale", 1.0)),
        )
    return NemotronHConfig(**kwargs)


def nemotron_h_weights(reader: GGUFFile, config: PretrainedConfig, keep_quantised: bool) -> Weights:
    """Our checkpoint's names; the Mamba parameters back in the checkpoint's shapes."""
    for tensor in reader.tensors:
        name = nemotron_h_tensor_name(tensor.name)
        if name is None:
            continue
        if "{e}" in name:
            yield from stacked_experts(reader, tensor, name, keep_quantised)
            continue
        if keep_quantised and kept_quantised(name, tensor):
            yield name, blocks(tensor, reader.raw(tensor))
            continue
        w = dense(reader, tensor)
        if name.endswith("mixer.A_log"):
            w = torch.log(-w.reshape(-1))  # the file holds A = -exp(A_log)
        elif name.endswith(("mixer.D", "mixer.norm.weight")):
            w = w.reshape(-1)
        elif name.endswith("mixer.conv1d.weight"):
            w = w.unsqueeze(1)  # [C, K] -> the checkpoint's [C, 1, K]
        yield name, w


NEMOTRON_H = GGUFFamily(("nemotron_h", "nemotron_h_moe"), nemotron_h_config, nemotron_h_tensor_name, nemotron_h_weights)
