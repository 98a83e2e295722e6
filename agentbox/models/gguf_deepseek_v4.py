"""GGUF files of DeepSeek-V4 as llama.cpp's converter writes them (`deepseek4`; llama-cpp-python 0.3.36's vendored
convert_hf_to_gguf.py, conversion/deepseek.py).

What the converter changed, undone here:
- names: `blk.N.attn_q_a` for `layers.N.attn.wq_a`, `attn_compressor_kv` / `indexer_compressor_kv` for the two
  compressors' wkv, `indexer.proj` for the indexer's weights_proj, `output_hc_*` for the final hyper-connection
  collapse, `exp_probs_b.bias` for the router's correction bias, `ffn_gate_tid2eid` (I32) for a hash layer's
  token -> experts table; the routed experts stacked per projection (MXFP4 from the release's FP4: the GGUF
  expert method reads them), the MTP layer's `nextn.*` not loaded.
- config: `compress_ratios` per layer (0 sliding; the layers holding indexer tensors are CSA, the other
  compressed ones HCA), `hash_layer_count` leading hash layers, `expert_gating_func` 4 for sqrt(softplus),
  `swiglu_clamp_exp` per layer, YaRN's keys for the compressed layers' rope (the sliding layers' is plain,
  `rope.freq_base`; the compressed ones turn at `attention.compress_rope_freq_base`).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from transformers import DeepseekV4Config, PretrainedConfig

from agentbox.layers.quant.gguf import FLOAT_TYPES
from agentbox.models.gguf_family import GGUFFamily, Weights, blocks, dense, stacked_experts
from agentbox.models.gguf_reader import GGUFFile

_GLOBAL = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "head.weight",
    "output_hc_fn.weight": "hc_head.fn",
    "output_hc_base.weight": "hc_head.base",
    "output_hc_scale.weight": "hc_head.scale",
}
_BLOCK = {
    "attn_norm.weight": "attn_norm.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "attn_sinks.weight": "attn.attn_sink",
    "attn_q_a.weight": "attn.wq_a.weight",
    "attn_q_a_norm.weight": "attn.q_norm.weight",
    "attn_q_b.weight": "attn.wq_b.weight",
    "attn_kv.weight": "attn.wkv.weight",
    "attn_kv_a_norm.weight": "attn.kv_norm.weight",
    "attn_output_a.weight": "attn.wo_a.weight",
    "attn_output_b.weight": "attn.wo_b.weight",
    **{f"hc_{part}_{w}.weight": f"hc_{part}.{w}" for part in ("attn", "ffn") for w in ("fn", "base", "scale")},
    **{f"{src}_{kind}.weight": f"{dst}.{ours}.weight" for src, dst in (("attn_compressor", "attn.compressor"),
                                                                    ("indexer_compressor", "attn.indexer.compressor"))
       for kind, ours in (("kv", "wkv"), ("gate", "wgate"), ("norm", "norm"))},
    "attn_compressor_ape.weight": "attn.compressor.ape",
    "indexer_compressor_ape.weight": "attn.indexer.compressor.ape",
    "indexer.proj.weight": "attn.indexer.weights_proj.weight",
    "indexer.attn_q_b.weight": "attn.indexer.wq_b.weight",
    "ffn_gate_inp.weight": "ffn.gate.weight",
    "exp_probs_b.bias": "ffn.gate.bias",
    "ffn_gate_tid2eid.weight": "ffn.gate.tid2eid",
    "ffn_gate_shexp.weight": "ffn.shared_experts.w1.weight",
    "ffn_up_shexp.weight": "ffn.shared_experts.w3.weight",
    "ffn_down_shexp.weight": "ffn.shared_experts.w2.weight",
    "ffn_gate_exps.weight": "ffn.experts.{e}.w1.weight",
    "ffn_up_exps.weight": "ffn.experts.{e}.w3.weight",
    "ffn_down_exps.weight": "ffn.experts.{e}.w2.weight",
}
# Linear layers: kept as the file's blocks when quantised (the rest is read dense)
_LINEAR = re.compile(r"\.(wq_a|wq_b|wkv|wgate|wo_a|wo_b|weights_proj|w1|w2|w3)\.weight$")
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")
_SCORING = {1: "softmax", 2: "sigmoid", 4: "sqrtsoftplus"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*
CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def deepseek_v4_config(reader: GGUFFile, arch: str) -> PretrainedConfig:
    def meta(key: str, default: Any = None) -> Any:
        return reader.metadata.get(f"{arch}.{key}", default)

    gating = int(meta("expert_gating_func", 4))
    if gating not in _SCORING:
        raise ValueError(f"GGUF {arch}: expert gating function {gating} is not one agentbox runs ({_SCORING})")
    nextn = int(meta("nextn_predict_layers", 0) or 0)
    layers = int(meta("block_count")) - nextn
    names = {t.name for t in reader.tensors}
    ratios = [int(r) for r in meta("attention.compress_ratios")][:layers]
    csa = {i for i in range(layers) if f"blk.{i}.indexer.proj.weight" in names}
    types = [SLIDING if r == 0 else CSA if i in csa else HCA for i, r in enumerate(ratios)]
    rates = {kind: next((r for r, t in zip(ratios, types, strict=True) if t == kind), default)
             for kind, default in ((CSA, 4), (HCA, 128))}
    hashed = int(meta("hash_layer_count", 0))
    rope: dict[str, Any] = {"rope_type": "default"}
    if meta("rope.scaling.type") == "yarn":
        rope = {"rope_type": "yarn", "factor": float(meta("rope.scaling.factor")),
                "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
                "beta_fast": float(meta("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(meta("rope.scaling.yarn_beta_slow", 1.0))}
    elif meta("rope.scaling.type") not in (None, "none"):
        raise ValueError(f"GGUF {arch}: rope scaling {meta('rope.scaling.type')!r} is not supported")
    clamp = meta("swiglu_clamp_exp", [10.0])
    vocab = meta("vocab_size") or len(reader.metadata["tokenizer.ggml.tokens"])
    return DeepseekV4Config(
        vocab_size=int(vocab),
        hidden_size=int(meta("embedding_length")),
        moe_intermediate_size=int(meta("expert_feed_forward_length")),
        num_hidden_layers=layers,
        num_attention_heads=int(meta("attention.head_count")),
        num_key_value_heads=int(meta("attention.head_count_kv", 1)),
        head_dim=int(meta("attention.key_length")),
        qk_rope_head_dim=int(meta("rope.dimension_count")),
        q_lora_rank=int(meta("attention.q_lora_rank")),
        num_experts_per_tok=int(meta("expert_used_count")),
        n_routed_experts=int(meta("expert_count")),
        n_shared_experts=int(meta("expert_shared_count", 1)),
        scoring_func=_SCORING[gating],
        norm_topk_prob=bool(meta("expert_weights_norm", True)),
        routed_scaling_factor=float(meta("expert_weights_scale", 1.0)),
        max_position_embeddings=int(meta("context_length")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_parameters=rope,
        layer_types=types,
        compress_rates=rates,
        compress_rope_theta=float(meta("attention.compress_rope_freq_base", 160000.0)),
        hc_mult=int(meta("hyper_connection.count")),
        hc_sinkhorn_iters=int(meta("hyper_connection.sinkhorn_iterations")),
        hc_eps=float(meta("hyper_connection.epsilon")),
        mlp_layer_types=["hash_moe" if i < hashed else "moe" for i in range(layers)],
        swiglu_limit=float(clamp[0] if isinstance(clamp, list) else clamp),
        sliding_window=int(meta("attention.sliding_window")),
        o_groups=int(meta("attention.output_group_count")),
        o_lora_rank=int(meta("attention.output_lora_rank")),
        index_n_heads=int(meta("attention.indexer.head_count")),
        index_head_dim=int(meta("attention.indexer.key_length")),
        index_topk=int(meta("attention.indexer.top_k")),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        num_nextn_predict_layers=nextn,
        tie_word_embeddings=False,
        bos_token_id=reader.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=reader.metadata.get("tokenizer.ggml.eos_token_id"),
        architectures=["DeepseekV4ForCausalLM"],
    )


def deepseek_v4_tensor_name(gguf_name: str) -> str | None:
    """Our name of a GGUF tensor (`{e}` for stacked experts); None for the MTP layer's `nextn.*`."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m is None:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not one of DeepSeek-V4's")
    block, rest = m.groups()
    if rest.startswith("nextn."):
        return None
    if rest not in _BLOCK:
        raise ValueError(f"GGUF tensor {gguf_name!r} is not one of DeepSeek-V4's")
    return f"layers.{block}.{_BLOCK[rest]}"


def deepseek_v4_weights(reader: GGUFFile, config: PretrainedConfig, keep_quantised: bool) -> Weights:
    layers = config.num_hidden_layers
    for tensor in reader.tensors:
        name = deepseek_v4_tensor_name(tensor.name)
        m = _BLOCK_RE.match(tensor.name)
        if name is None or (m is not None and int(m.group(1)) >= layers):
            continue  # the MTP layer (a draft model, unused)
        if "{e}" in name:
            yield from stacked_experts(reader, tensor, name, keep_quantised)
        elif name.endswith("tid2eid"):
            table = np.asarray(reader.raw(tensor)).view(np.int32).reshape(tensor.shape)
            yield name, torch.from_numpy(table.astype(np.int64))
        elif keep_quantised and _LINEAR.search(name) and tensor.qtype not in FLOAT_TYPES:
            yield name, blocks(tensor, reader.raw(tensor))
        else:
            yield name, dense(reader, tensor)


DEEPSEEK_V4 = GGUFFamily(("deepseek4",), deepseek_v4_config, deepseek_v4_tensor_name, deepseek_v4_weights)
