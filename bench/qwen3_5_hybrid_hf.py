"""A random Qwen3.5-architecture hybrid (3 Gated DeltaNet layers : 1 gated attention, hidden 512, 12 layers) in the
released image-text layout, with SmolLM2's tokenizer (the embedded GGUF's), for the agent workload against
llama.cpp's llama-server (issue 52): llama.cpp's own converter writes it as an f16 GGUF that both engines load.

    python bench/qwen3_5_hybrid_hf.py /tmp/q35-hybrid --gguf /tmp/q35-hybrid-f16.gguf
    agentbox bench llamacpp --server --model /tmp/q35-hybrid-f16.gguf --threads 2 --json-out hybrid.json

The tokenizer is SmolLM2's as agentbox reads it from the embedded GGUF, named "smollm" to the converter
(agentbox.bench.llama_server.convert_hf says why): both engines then tokenize as each does for SmolLM2.
Everything else is the converter's own work.

Random weights: the answers are noise, which the workload does not read (every turn's answer has the recorded
length: ignore_eos with max_tokens), so the timings are those of the real layer shapes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from agentbox.bench.llama_server import convert_hf
from agentbox.bench.tiny_models import smollm2_tokenizer

TEXT = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=2,
            head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
            linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=4,
            max_position_embeddings=32768)
VISION = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=512, patch_size=2,
              temporal_patch_size=2, spatial_merge_size=1)


def write(out: Path, seed: int = 0) -> Path:
    tokenizer = smollm2_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    cfg = Qwen3_5Config(text_config={**TEXT, "vocab_size": len(tokenizer), "eos_token_id": eos},
                        vision_config=VISION, architectures=["Qwen3_5ForConditionalGeneration"])
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and "A_log" not in name:
                p.normal_(0, 0.04)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--gguf", type=Path, help="also convert it to this f16 GGUF with llama.cpp's converter")
    args = ap.parse_args()
    print(write(args.out))
    if args.gguf:
        print(convert_hf(args.out, args.gguf, no_mtp=True))
