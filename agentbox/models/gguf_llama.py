"""GGUF files of the Llama family (`llama`, `qwen2`, `qwen3`, `qwen3moe`), loaded into models/llama.py and qwen3_moe.py.

llama.cpp's converter permutes the rows of Q and K for llama-arch models (it stores rope as interleaved
pairs); our rotary is neox style like the HF checkpoints, so those rows are permuted back here. Qwen2/Qwen3
GGUFs are stored unpermuted, and so are Qwen3-MoE ones (its converter derives from Qwen2's, not Llama's).

MoE (qwen3moe): each layer's experts are three 3-D tensors, `ffn_{gate,up}_exps` [E, I, H] and
`ffn_down_exps` [E, H, I], one tensor holding all experts; `ffn_gate_inp` [E, H] is the router. They are
yielded per expert under the HF names (`mlp.experts.{e}.gate_proj.weight`), each a row view of the file.
"""

from __future__ import annotations

import re
from typing import Any

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from agentbox.models.gguf_family import (
    GLOBAL_NAMES,
    GGUFFamily,
    Weights,
    blocks,
    dense,
    kept_quantised,
    stacked_experts,
)
from agentbox.models.gguf_reader import GGUFFile

# GGUF general.architecture -> (config class, HF architectures name)
CONFIGS: dict[str, tuple[type[PretrainedConfig], str]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
    "qwen3moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
}

_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # the MoE router [E, H]
    # All experts of a layer in one tensor -> the per-expert HF name ({e}: the expert index)
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_SKIPPED = {"rope_freqs.weight"}  # llama3 rope factors: carried by the config's rope scaling instead


def llama_tensor_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor (with `{e}` for a tensor of stacked experts), or None for
    tensors we do not load."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    module = None if m is None else _BLOCK_NAMES.get(m.group(2))
    if m is None or module is None:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent we know")
    return f"model.layers.{m.group(1)}.{module}.{m.group(3)}"


def llama_config(reader: GGUFFile, arch: str) -> PretrainedConfig:
    config_cls, hf_arch = CONFIGS[arch]

    def meta(key: str, default: Any = None) -> Any:
        return reader.metadata.get(f"{arch}.{key}", default)

    hidden, num_heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = meta("vocab_size") or len(reader.metadata["tokenizer.ggml.tokens"])
    kwargs: dict[str, Any] = dict(
        vocab_size=int(vocab),
        hidden_size=hidden,
        # MoE files may omit it (every layer routed): the experts' size stands in for the unused dense MLP's
        intermediate_size=int(meta("feed_forward_length", meta("expert_feed_forward_length"))),
        num_hidden_layers=int(meta("block_count")),
        num_attention_heads=num_heads,
        num_key_value_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("attention.key_length", hidden // num_heads)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=reader.metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=reader.metadata.get("tokenizer.ggml.eos_token_id"),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        architectures=[hf_arch],
    )
    if arch in ("llama", "qwen3", "qwen3moe"):
        kwargs["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "qwen3moe":
        kwargs.update(_moe_config(meta, names, kwargs["num_hidden_layers"]))
    scaling = _rope_scaling(reader, arch)
    if scaling is not None:
        kwargs["rope_scaling"] = scaling
    return config_cls(**kwargs)


def _moe_config(meta: Any, names: set[str], layers: int) -> dict[str, Any]:
    return dict(
        num_experts=int(meta("expert_count")),
        num_experts_per_tok=int(meta("expert_used_count")),
        moe_intermediate_size=int(meta("expert_feed_forward_length")),
        # llama.cpp's qwen3moe graph always renormalises the top-k weights (Qwen3-30B-A3B's
        # norm_topk_prob is true); the key is read where a converter wrote it.
        norm_topk_prob=bool(meta("expert_weights_norm", True)),
        decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names],
    )


def _rope_scaling(reader: GGUFFile, arch: str) -> dict[str, Any] | None:
    kind = reader.metadata.get(f"{arch}.rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(reader.metadata[f"{arch}.rope.scaling.factor"])}
    if kind == "yarn":  # Qwen3 long-context files (factor 4 over 32k, or over 256k for Qwen3-Coder)
        return {
            "rope_type": "yarn",
            "factor": float(reader.metadata[f"{arch}.rope.scaling.factor"]),
            "original_max_position_embeddings": int(reader.metadata[f"{arch}.rope.scaling.original_context_length"]),
        }
    if kind not in (None, "none"):
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    # Llama 3.1/3.2 store their llama3 rope as per-frequency divisors; the largest divisor is the factor,
    # the other parameters are the published ones for that family.
    factor = float(gguf.quants.dequantize(reader.raw(freqs), freqs.qtype).max())
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def _unpermute(w: torch.Tensor | np.ndarray, n_head: int) -> Any:
    """Inverse of llama.cpp's permute: rows stored per head as interleaved (half, 2) pairs go back to HF's
    (2, half) order. On stored rows (each row its blocks' bytes) too: rows move as units."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, -1).swapaxes(2, 1).reshape(w.shape)


def llama_weights(reader: GGUFFile, config: PretrainedConfig, keep_quantised: bool) -> Weights:
    permuted = reader.metadata.get("general.architecture") == "llama"
    for tensor in reader.tensors:
        name = llama_tensor_name(tensor.name)
        if name is None:
            continue
        if "{e}" in name:
            yield from stacked_experts(reader, tensor, name, keep_quantised)
            continue
        heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
        unpermute = permuted and (".q_proj." in name or ".k_proj." in name)
        if keep_quantised and kept_quantised(name, tensor):
            raw = reader.raw(tensor)
            yield name, blocks(tensor, _unpermute(raw, heads) if unpermute else raw)
            continue
        w = dense(reader, tensor)
        yield name, _unpermute(w, heads) if unpermute else w


LLAMA = GGUFFamily(tuple(CONFIGS), llama_config, llama_tensor_name, llama_weights)
