"""GGUF checkpoints: a transformers config from the file's metadata, and our checkpoint's tensors from its tensors.

Each architecture llama.cpp writes is read by its family (models/gguf_family.py `GGUFFamily`): the llama family
(gguf_llama.py), Gemma 4 (gguf_gemma4.py), the hybrid Qwens (gguf_hybrid.py), MLA (gguf_mla.py), DeepSeek-V4
(gguf_deepseek_v4.py), Laguna (gguf_laguna.py) and Nemotron-H (gguf_nemotron_h.py). This file keys them by
`general.architecture` and gives the loader one entry for each step: config, quantisation, weights.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from transformers import PretrainedConfig

from agentbox.layers.quant import QuantConfig, QuantMethod
from agentbox.models.gguf_deepseek_v4 import DEEPSEEK_V4
from agentbox.models.gguf_family import GGUFFamily, Weights, kept_quantised
from agentbox.models.gguf_gemma4 import GEMMA4
from agentbox.models.gguf_hybrid import HYBRID
from agentbox.models.gguf_laguna import LAGUNA
from agentbox.models.gguf_llama import LLAMA
from agentbox.models.gguf_mla import MLA
from agentbox.models.gguf_nemotron_h import NEMOTRON_H
from agentbox.models.gguf_reader import GGUFFile

GGUF_FAMILIES: dict[str, GGUFFamily] = {
    arch: f for f in (LLAMA, GEMMA4, HYBRID, MLA, DEEPSEEK_V4, LAGUNA, NEMOTRON_H) for arch in f.archs
}


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int) -> GGUFFile:
    # Config, eos lookup and weights read the same file; parse its header once.
    return GGUFFile(Path(path))


def open_gguf(path: Path) -> GGUFFile:
    return _open(str(path), path.stat().st_mtime_ns)


def gguf_metadata(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.metadata.get(key, default)


def gguf_family(reader: GGUFFile) -> tuple[str, GGUFFamily]:
    """The file's architecture and the family that reads it; an unsupported one is refused by name."""
    arch = gguf_metadata(reader, "general.architecture")
    if arch not in GGUF_FAMILIES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(GGUF_FAMILIES)}")
    return arch, GGUF_FAMILIES[arch]


def gguf_config(path: Path) -> PretrainedConfig:
    reader = open_gguf(path)
    arch, family = gguf_family(reader)
    return family.config(reader, arch)


def gguf_quant_config(path: Path) -> QuantConfig:
    """The file's tensor types choose: any quantised linear weight makes it the GGUF method. So do stacked
    experts of any type: they arrive as blocks, which only the GGUF expert method reads (its float linears
    are then held dense by the GGUF linear method, as in any GGUF file)."""
    reader = open_gguf(path)
    _, family = gguf_family(reader)
    names = [(name, t) for t in reader.tensors if (name := family.tensor_name(t.name)) is not None]
    if any("{e}" in name for name, _ in names):
        return QuantConfig(QuantMethod.GGUF)  # the MoE layer's registry maps it to GGUFExperts (layers/experts/)
    quantised = any(kept_quantised(name, t) for name, t in names)
    return QuantConfig(QuantMethod.GGUF) if quantised else QuantConfig()


def gguf_weights(path: Path, config: PretrainedConfig, keep_quantised: bool = False) -> Weights:
    """Our checkpoint's names and tensors; with `keep_quantised`, linear weights come as GGUFBlocks (views of the
    file) and stacked experts as one block view per expert, else everything dense in fp32."""
    reader = open_gguf(path)
    _, family = gguf_family(reader)
    return family.weights(reader, config, keep_quantised)
