"""A tiny Laguna GGUF made by llama.cpp's own converter (conversion/laguna.py of the llama.cpp the llama-cpp-python
0.3.36 sdist vendors, run from the unpacked sdist: tests/deepseek_v4_gguf.py finds or fetches it): the transformers
checkpoint as save_pretrained wrote it, SmolLM2's tokenizer (a pre-tokenizer the converter knows), and no router
soft cap (the converter does not write one and llama.cpp's graph has none)."""

from __future__ import annotations

from pathlib import Path

import torch
from deepseek_v4_gguf import convert
from laguna_models import save_laguna, tiny_config


def write_laguna_gguf(d: Path, llama_cpp: Path, tokenizer, gating: bool | str = True  # noqa: ANN001
                      ) -> tuple[Path, torch.nn.Module]:
    """(the F32 GGUF file, its transformers twin)."""
    config = tiny_config("head", vocab_size=len(tokenizer), gating=gating, moe_router_logit_softcapping=0.0)
    hf = save_laguna(d / "hf", config)
    tokenizer.save_pretrained(d / "hf")
    return convert(d / "hf", d / "laguna.gguf", llama_cpp), hf
