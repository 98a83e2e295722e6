"""GGUF checkpoints: a transformers config from the file's metadata, and HF-named dequantised weights.

llama.cpp's converter permutes the rows of Q and K for llama-arch models (it stores rope as interleaved
pairs); our rotary is neox style like the HF checkpoints, so those rows are permuted back here. Qwen2/Qwen3
GGUFs are stored unpermuted, and so are Qwen3-MoE ones (its converter derives from Qwen2's, not Llama's).

MoE (qwen3moe): each layer's experts are three 3-D tensors, `ffn_{gate,up}_exps` [E, I, H] and
`ffn_down_exps` [E, H, I], one tensor holding all experts; `ffn_gate_inp` [E, H] is the router. They are
yielded per expert under the HF names (`mlp.experts.{e}.gate_proj.weight`), each a row view of the file.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from agentbox.layers.quant import QuantConfig, QuantMethod
from agentbox.layers.quant.gguf import FLOAT_TYPES, GGUFBlocks
from agentbox.models.gguf_gemma4 import GEMMA4_ARCH, gemma4_config, gemma4_tensor_name, gemma4_weights
from agentbox.models.gguf_hybrid import HYBRID_ARCHS, hybrid_config, hybrid_tensor_name, hybrid_weights
from agentbox.models.gguf_mla import MLA_ARCHS, mla_config, mla_tensor_name, mla_weights
from agentbox.models.gguf_reader import GGUFFile, GGUFTensor

# GGUF general.architecture -> (config class, HF architectures name)
GGUF_ARCHS: dict[str, tuple[type[PretrainedConfig], str]] = {
    "llama": (LlamaConfig, "LlamaForCausalLM"),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM"),
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM"),
    "qwen3moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
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
}
# All experts of a layer in one tensor -> the per-expert HF name ({e}: the expert index)
_EXPERT_NAMES = {
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_SKIPPED = {"rope_freqs.weight"}  # llama3 rope factors: carried by the config's rope scaling instead


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int) -> GGUFFile:
    # Config, eos lookup and weights read the same file; parse its header once.
    return GGUFFile(Path(path))


def open_gguf(path: Path) -> GGUFFile:
    return _open(str(path), path.stat().st_mtime_ns)


def gguf_metadata(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor (with `{e}` for a tensor of stacked experts), or None for
    tensors we do not load."""
    if gguf_name in _SKIPPED:
        return None
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    module = None if m is None else _BLOCK_NAMES.get(m.group(2), _EXPERT_NAMES.get(m.group(2)))
    if m is None or module is None:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent we know")
    return f"model.layers.{m.group(1)}.{module}.{m.group(3)}"


def _stacked_experts(name: str) -> bool:
    return "{e}" in name


def gguf_config(path: Path) -> PretrainedConfig:
    reader = open_gguf(path)
    arch = gguf_metadata(reader, "general.architecture")
    if arch in HYBRID_ARCHS:
        return hybrid_config(reader, arch)
    if arch in MLA_ARCHS:
        return mla_config(reader, arch)
    if arch == GEMMA4_ARCH:
        return gemma4_config(reader)
    if arch not in GGUF_ARCHS:
        supported = ", ".join([*GGUF_ARCHS, *HYBRID_ARCHS, *MLA_ARCHS, GEMMA4_ARCH])
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {supported}")
    config_cls, hf_arch = GGUF_ARCHS[arch]

    def meta(key: str, default: Any = None) -> Any:
        return gguf_metadata(reader, f"{arch}.{key}", default)

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
        bos_token_id=gguf_metadata(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_metadata(reader, "tokenizer.ggml.eos_token_id"),
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
    kind = gguf_metadata(reader, f"{arch}.rope.scaling.type")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(gguf_metadata(reader, f"{arch}.rope.scaling.factor"))}
    if kind == "yarn":  # Qwen3 long-context files (factor 4 over 32k, or over 256k for Qwen3-Coder)
        return {
            "rope_type": "yarn",
            "factor": float(gguf_metadata(reader, f"{arch}.rope.scaling.factor")),
            "original_max_position_embeddings": int(
                gguf_metadata(reader, f"{arch}.rope.scaling.original_context_length")
            ),
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


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's permute: rows stored per head as interleaved (half, 2) pairs go back to HF's
    (2, half) order."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


VOCAB_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


def _kept_quantised(name: str, tensor: GGUFTensor) -> bool:
    """Linear-layer weights and the vocabulary tables stay as the file's blocks (the embedding decides what
    to keep, layers/quant/quant_rows.py); norms and float tensors are dense."""
    linear = name.endswith("_proj.weight") or name in VOCAB_TABLES
    return linear and tensor.qtype not in FLOAT_TYPES and len(tensor.shape) == 2


def gguf_quant_config(path: Path) -> QuantConfig:
    """The file's tensor types choose: any quantised linear weight makes it the GGUF method. So do stacked
    experts of any type: they arrive as blocks, which only the GGUF expert method reads (its float linears
    are then held dense by the GGUF linear method, as in any GGUF file)."""
    reader = open_gguf(path)
    arch = gguf_metadata(reader, "general.architecture")
    to_hf = (hybrid_tensor_name if arch in HYBRID_ARCHS else mla_tensor_name if arch in MLA_ARCHS
             else gemma4_tensor_name if arch == GEMMA4_ARCH else hf_tensor_name)
    names = [(name, t) for t in reader.tensors if (name := to_hf(t.name)) is not None]
    if any(_stacked_experts(name) for name, _ in names):
        return QuantConfig(QuantMethod.GGUF)  # the MoE layer's registry maps it to GGUFExperts (layers/experts/)
    quantised = any(_kept_quantised(name, t) and t.qtype not in FLOAT_TYPES for name, t in names)
    return QuantConfig(QuantMethod.GGUF) if quantised else QuantConfig()


def _unpermute_rows(raw: np.ndarray, n_head: int) -> np.ndarray:
    """`_unpermute` on whole stored rows (each row is its blocks' bytes, so rows move as units)."""
    dim = raw.shape[0] // n_head // 2
    return raw.reshape(n_head, dim, 2, -1).swapaxes(2, 1).reshape(raw.shape)


def gguf_weights(
    path: Path, config: PretrainedConfig, keep_quantised: bool = False
) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """HF-named weights; with `keep_quantised`, linear weights come as GGUFBlocks (views of the file)."""
    reader = open_gguf(path)
    if gguf_metadata(reader, "general.architecture") in HYBRID_ARCHS:
        yield from hybrid_weights(reader, config, keep_quantised, _experts)
        return
    if gguf_metadata(reader, "general.architecture") in MLA_ARCHS:
        yield from mla_weights(reader, config, keep_quantised, _experts)
        return
    if gguf_metadata(reader, "general.architecture") == GEMMA4_ARCH:
        yield from gemma4_weights(reader, keep_quantised, _experts)
        return
    permuted = gguf_metadata(reader, "general.architecture") == "llama"
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        if name is None:
            continue
        if _stacked_experts(name):
            yield from _experts(reader, tensor, name, keep_quantised)
            continue
        if keep_quantised and _kept_quantised(name, tensor):
            raw = reader.raw(tensor)
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            if permuted and (".q_proj." in name or ".k_proj." in name):
                raw = _unpermute_rows(raw, heads)
            yield name, GGUFBlocks(tensor.qtype, (tensor.shape[0], tensor.shape[1]), raw)
            continue
        data = gguf.quants.dequantize(reader.raw(tensor), tensor.qtype).reshape(tensor.shape)
        if not data.flags.writeable:  # F32 tensors come back as a view of the read-only file map
            data = data.copy()
        w = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
        if permuted and ".q_proj." in name:
            w = _unpermute(w, config.num_attention_heads)
        elif permuted and ".k_proj." in name:
            w = _unpermute(w, config.num_key_value_heads)
        yield name, w


def _experts(
    reader: GGUFFile, tensor: GGUFTensor, name: str, keep_quantised: bool
) -> Iterator[tuple[str, torch.Tensor | GGUFBlocks]]:
    """One [out, in] weight per expert of a stacked [E, out, in] tensor: row views of the file, or (not
    `keep_quantised`) dequantised to fp32. Engine-bound experts are blocks whatever their type (F16/F32
    too): the expert method reads them once it knows the whole layer's types, so nothing is read or
    copied before then."""
    experts, rows, cols = tensor.shape
    raw = reader.raw(tensor).reshape(experts, rows, -1)
    for e in range(experts):
        blocks = GGUFBlocks(tensor.qtype, (rows, cols), raw[e])
        if keep_quantised:
            yield name.format(e=e), blocks
        else:  # a copy: dequantize returns F32 data as a read-only view of the file map
            data = gguf.quants.dequantize(raw[e], tensor.qtype).reshape(rows, cols)
            yield name.format(e=e), torch.from_numpy(np.array(data, dtype=np.float32))
