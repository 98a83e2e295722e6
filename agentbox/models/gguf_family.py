"""What a family of GGUF architectures declares, and the tensor helpers the families share.

llama.cpp's converter writes each architecture its own way (metadata keys, tensor names, rows permuted or split).
A family file (gguf_llama.py, gguf_gemma4.py, gguf_hybrid.py, gguf_mla.py) declares one `GGUFFamily`: how its
metadata becomes a transformers config, its tensors' names in our checkpoint, and its weights under those names.
models/gguf_file.py keys them by `general.architecture`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from transformers import PretrainedConfig

from agentbox.layers.quant.gguf import FLOAT_TYPES, GGUFBlocks
from agentbox.models.gguf_reader import GGUFFile, GGUFTensor

Weights = Iterator[tuple[str, torch.Tensor | GGUFBlocks]]

# Every family's tensors outside the blocks (Gemma 4 has a few more)
GLOBAL_NAMES: dict[str, str | None] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")  # (layer, the rest of the name)
VOCAB_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class GGUFFamily:
    archs: tuple[str, ...]  # the `general.architecture` values it reads
    # (file, its architecture) -> a transformers config whose `architectures` names our model class
    config: Callable[[GGUFFile, str], PretrainedConfig]
    # a GGUF tensor's name in our checkpoint (`{e}` for experts stacked in one tensor); None: not loaded as such
    tensor_name: Callable[[str], str | None]
    # (file, its config, keep_quantised) -> our checkpoint's tensors: with keep_quantised, linear weights stay as
    # the file's blocks (GGUFBlocks, views of the file) and stacked experts come as one block view per expert
    weights: Callable[[GGUFFile, PretrainedConfig, bool], Weights]


def kept_quantised(name: str, tensor: GGUFTensor) -> bool:
    """Linear-layer weights and the vocabulary tables stay as the file's blocks (the embedding decides what to
    keep, layers/quant/quant_rows.py); norms, routers and float tensors are dense."""
    linear = name.endswith("_proj.weight") or name in VOCAB_TABLES
    return linear and tensor.qtype not in FLOAT_TYPES and len(tensor.shape) == 2


def blocks(tensor: GGUFTensor, raw: np.ndarray) -> GGUFBlocks:
    """A 2-D tensor's rows as stored (`raw`: the file's bytes of it, rows possibly reordered)."""
    return GGUFBlocks(tensor.qtype, (tensor.shape[0], tensor.shape[1]), raw)


def dense(reader: GGUFFile, tensor: GGUFTensor, keep_f16: bool = False) -> torch.Tensor:
    """The tensor dequantised to fp32, in its own memory; an F16 one stays fp16 with `keep_f16` (a linear's weight:
    the CPU reads it as fp16, layers/quant/unquantized.py; any other method widens it as it copies)."""
    if keep_f16 and tensor.qtype == gguf.GGMLQuantizationType.F16:
        return torch.from_numpy(np.array(reader.raw(tensor)).view(np.float16).reshape(tensor.shape))
    data = gguf.quants.dequantize(reader.raw(tensor), tensor.qtype).reshape(tensor.shape)
    if not data.flags.writeable:  # F32 tensors come back as a view of the read-only file map
        data = data.copy()
    return torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))


def stacked_experts(reader: GGUFFile, tensor: GGUFTensor, name: str, keep_quantised: bool) -> Weights:
    """One [out, in] weight per expert of a stacked [E, out, in] tensor, under `name` with `{e}` filled: row views
    of the file, or (not `keep_quantised`) dequantised to fp32. Engine-bound experts are blocks whatever their type
    (F16/F32 too): the expert method reads them once it knows the whole layer's types, so nothing is read or copied
    before then."""
    experts, rows, cols = tensor.shape
    raw = reader.raw(tensor).reshape(experts, rows, -1)
    for e in range(experts):
        if keep_quantised:
            yield name.format(e=e), GGUFBlocks(tensor.qtype, (rows, cols), raw[e])
        else:  # a copy: dequantize returns F32 data as a read-only view of the file map
            data = gguf.quants.dequantize(raw[e], tensor.qtype).reshape(rows, cols)
            yield name.format(e=e), torch.from_numpy(np.array(data, dtype=np.float32))
