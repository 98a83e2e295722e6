"""Random GGUFs of real width for the agent workload against llama.cpp's llama-server (issue 52): a Qwen3-MoE
(Qwen3-30B-A3B's layer), a GLM-4.7-Flash-shaped MLA MoE and a Gemma 4-shaped model, a few layers each, written
by transformers in the released layout with SmolLM2's tokenizer (its 49,152-token vocabulary keeps the tables
small) and converted by llama.cpp's own converter, so both engines load the same file.

    python bench/arch_ggufs.py qwen3_moe /tmp/arch-qwen3moe --gguf /tmp/qwen3moe-q8_0.gguf
    agentbox bench llamacpp --server --model /tmp/qwen3moe-q8_0.gguf --threads 2 --sessions 1

Widths: Qwen3-MoE is transformers' Qwen3MoeConfig defaults (Qwen3-30B-A3B: hidden 2048, 32 query / 4 KV heads
of 128, 128 experts of 768, top 8, normalised top-k as the release), every layer MoE. GLM-4.7-Flash is
Glm4MoeLiteConfig's defaults (hidden 2048, 20 heads, kv_lora_rank 512, q_lora_rank 768, nope 192 + rope 64,
v 256, 64 experts of 1536 top 4 and one shared, the first layer dense of 10240). Gemma 4 is Gemma4TextConfig's
defaults (hidden 2304, 8 query / 4 KV heads of 256, global layers' heads of 512, MLP 9216, per-layer inputs of
256, a 512-token window; the last layer global). Random weights: the answers are noise, which the workload does
not read (every answer has the recorded length), so the timings are those of the real layer shapes.

The tokenizer steps (agentbox.bench.llama_server.convert_hf): the pre-tokenizer named "smollm"; GLM's
converter looks up four GLM special tokens by name, added to the tokenizer here; Gemma 4's vocabulary step
reads a SentencePiece-style byte-fallback tokenizer, so the converter writes SmolLM2's byte-level BPE
vocabulary as it does for GPT-2-style models (the tensors and every other key are still the converter's).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from agentbox.bench.llama_server import convert_hf, converter_tokenizer
from agentbox.bench.tiny_models import smollm2_tokenizer

CONTEXT = 32768  # past the workload's longest history (~5k tokens) with room for llama-server's slots


def _qwen3_moe(layers: int, vocab: int) -> Any:
    return transformers.Qwen3MoeConfig(vocab_size=vocab, num_hidden_layers=layers, head_dim=128, norm_topk_prob=True,
                                       max_position_embeddings=CONTEXT, architectures=["Qwen3MoeForCausalLM"])


def _glm4_7_flash(layers: int, vocab: int) -> Any:
    # first_k_dense_replace: transformers says it as mlp_layer_types, the converter reads only this key (as the
    # release's config.json has it); without it the file claims no dense layer and neither engine loads it.
    return transformers.Glm4MoeLiteConfig(vocab_size=vocab, num_hidden_layers=layers, first_k_dense_replace=1,
                                          max_position_embeddings=CONTEXT, architectures=["Glm4MoeLiteForCausalLM"])


def _gemma4(layers: int, vocab: int) -> Any:
    return transformers.Gemma4TextConfig(vocab_size=vocab, vocab_size_per_layer_input=vocab, num_hidden_layers=layers,
                                         max_position_embeddings=CONTEXT, architectures=["Gemma4ForCausalLM"])


SHAPES: dict[str, Callable[[int, int], Any]] = {"qwen3_moe": _qwen3_moe, "glm4_7_flash": _glm4_7_flash,
                                                "gemma4": _gemma4}
DEFAULT_LAYERS = {"qwen3_moe": 2, "glm4_7_flash": 3, "gemma4": 4}


def write(arch: str, out: Path, layers: int, seed: int = 0) -> Path:
    """The random `arch` checkpoint (bf16: 1-3 GB at these widths) with its tokenizer, saved into `out`."""
    cfg = SHAPES[arch](layers, 0)
    tokenizer = converter_tokenizer(smollm2_tokenizer(), cfg.architectures[0])
    cfg = SHAPES[arch](layers, len(tokenizer))
    cfg.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # half the host memory of fp32 while it is built and saved
    try:
        model = getattr(transformers, cfg.architectures[0])(cfg)  # transformers' own init: random, of its scale
    finally:
        torch.set_default_dtype(previous)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("arch", choices=sorted(SHAPES))
    ap.add_argument("out", type=Path, help="the HF checkpoint folder to write")
    ap.add_argument("--layers", type=int, help="decoder layers (default: 2 for qwen3_moe, 3 for glm4_7_flash, 4 for gemma4)")
    ap.add_argument("--gguf", type=Path, help="also convert it to this GGUF with llama.cpp's converter")
    ap.add_argument("--outtype", default="q8_0", help="the converter's --outtype (q8_0, f16, bf16)")
    args = ap.parse_args()
    print(write(args.arch, args.out, args.layers or DEFAULT_LAYERS[args.arch]))
    if args.gguf:
        print(convert_hf(args.out, args.gguf, args.outtype, bpe_vocab=args.arch == "gemma4"))
