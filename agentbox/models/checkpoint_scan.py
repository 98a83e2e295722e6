"""Which linears an FP8 safetensors checkpoint leaves unquantised, read off its tensors rather than listed.

DeepSeek-V4's release keeps some projections in bf16 or fp32 beside its FP8 ones (the compressors' wkv and
wgate, the indexer's weights_proj; transformers lists them in `_keep_in_fp32_modules`) and its config names none
of them (no `modules_to_not_convert`). What the files say is exact: a weight stored FP8 has a scale beside it
(`weight_scale_inv`, or the release's `scale`), one that is not has none. So a 2-D `.weight` that is not FP8
and has no scale names a linear the loader builds unquantised (`QuantConfig.unquantised`), under our module
name (the model class's renames and fused modules applied). Only the headers are read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from agentbox.models.base import CausalLM

FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})  # safetensors' names
SCALE_SUFFIXES = (".weight_scale_inv", ".scale")


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors' dtype name: "BF16", "F8_E4M3", "I8", "F8_E8M0", ...
    ndim: int


def tensor_infos(paths: Iterable[Path]) -> dict[str, TensorInfo]:
    out = {}
    for path in paths:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                s = f.get_slice(name)
                out[name] = TensorInfo(s.get_dtype(), len(s.get_shape()))
    return out


def our_module_name(name: str, cls: type[CausalLM]) -> str:
    """A checkpoint module's name as the model class builds it: its renames, then its fused modules."""
    for pattern, replacement in cls.checkpoint_renames:
        name = re.sub(pattern, replacement, name)
    for hf_key, (ours, _) in cls.packed_modules_mapping.items():
        if name.endswith(f".{hf_key}"):
            return name.removesuffix(hf_key) + ours
    return name


def unquantised_linears(infos: Mapping[str, TensorInfo], cls: type[CausalLM]) -> frozenset[str]:
    """Our names of the modules whose weight is stored unquantised: 2-D, not FP8, no scale beside it (MoE
    experts aside: their format is the expert method's)."""
    out = set()
    for name, info in infos.items():
        if not name.endswith(".weight") or info.ndim != 2 or info.dtype in FP8_DTYPES or ".experts." in name:
            continue
        module = name.removesuffix(".weight")
        if not any(module + s in infos for s in SCALE_SUFFIXES):
            out.add(our_module_name(module, cls))
    return frozenset(out)
