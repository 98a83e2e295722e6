"""A tiny DeepSeek-V4 GGUF made by llama.cpp's own converter: convert_hf_to_gguf.py of the llama.cpp that the
llama-cpp-python 0.3.36 sdist vendors, run from the unpacked sdist (never copied here).

The converter reads DeepSeek's release layout (`layers.0.attn.wq_a.weight`, `embed.weight`, `hc_head_fn`, FP4
experts as packed nibbles with an E8M0 scale per 32 values) and config keys the release has (`compress_ratios`,
`num_hash_layers`, `rope_scaling`). So the tiny transformers model is written that way too: its experts rounded in
place to values FP4 holds exactly (the converter only repacks their bits into MXFP4 blocks), every other tensor
fp32 (written F32). The twin's logits are then the reference for the GGUF, as for the safetensors checkpoint.

`write_release(..., fp8=True)` writes the release as DeepSeek ships it for agentbox's own loader: the weights the
release quantises (`FP8_RELEASE`) as e4m3 with an E8M0 `scale` per 128 x 128 block, and its quantization_config;
`round_fp8` first rounds the twin's same weights in place to those values, as `round_experts` does for FP4.

The sdist: `AGENTBOX_LLAMA_CPP_SDIST` (a .tar.gz or an unpacked directory), else a cached copy, else `pip download`
into the cache; with none of those (no network) the GGUF tests skip, naming what they need.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from agentbox.bench.llama_server import vendored_tree

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def converter_dir(cache: Path) -> Path | None:
    """The vendored llama.cpp directory of the sdist (holding convert_hf_to_gguf.py), or None."""
    return vendored_tree(cache, converter_only=True)


def fp4_round(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] as DeepSeek's FP4 experts store it: (codes packed two a byte, element 2i in the low nibble,
    uint8 [out, in / 2]; E8M0 exponents, uint8 [out, in / 32]; the values they hold, fp32)."""
    out, cols = w.shape
    blocks = w.float().reshape(out, cols // 32, 32)
    amax = blocks.abs().amax(-1).clamp(min=2**-20)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # the block's largest value fits 6 x 2^exp
    scaled = blocks / torch.exp2(exp)[..., None]
    codes = (scaled[..., None] - E2M1).abs().argmin(-1)  # nearest E2M1 value (+0 before -0)
    values = E2M1[codes] * torch.exp2(exp)[..., None]
    flat = codes.reshape(out, cols).to(torch.uint8)
    packed = flat[:, 0::2] | (flat[:, 1::2] << 4)
    return packed, (exp + 127).to(torch.uint8), values.reshape(out, cols)


FP8_MAX = 448.0  # e4m3's largest value
FP8_BLOCK = 128
# The weights DeepSeek's release stores FP8, by its names and by transformers' (the rest stay bf16 or fp32: the
# compressors' and the indexer's own projections, the router, the embedding and head, the norms)
FP8_RELEASE = re.compile(r"attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|shared_experts\.w[123]\.weight$")
FP8_TWIN = re.compile(r"self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj|compressor\.indexer\.q_b_proj)\.weight$"
                      r"|shared_experts\.(gate|up|down)_proj\.weight$")
RELEASE_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                        "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def fp8_round(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] as the release stores an FP8 weight: (e4m3 [out, in]; E8M0 exponents, uint8
    [ceil(out / 128), ceil(in / 128)], each block's power of two that brings its largest value within 448; the
    values they hold, fp32). Rounding those values again gives the same values."""
    out, cols = w.shape
    bo, bi = -(-out // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = torch.zeros(bo * FP8_BLOCK, bi * FP8_BLOCK)
    padded[:out, :cols] = w.float()
    amax = padded.view(bo, FP8_BLOCK, bi, FP8_BLOCK).abs().amax((1, 3)).clamp(min=2**-100)
    exp = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(-127, 127)
    scale = torch.exp2(exp).repeat_interleave(FP8_BLOCK, 0)[:out].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    codes = (w.float() / scale).to(torch.float8_e4m3fn)  # a power of two apart: only the e4m3 rounding
    return codes, (exp + 127).to(torch.uint8), codes.float() * scale


def round_fp8(hf: torch.nn.Module) -> int:
    """The twin's weights the release stores FP8 replaced, in place, by the values `fp8_round` stores; how many."""
    n = 0
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if FP8_TWIN.search(name):
                p.copy_(fp8_round(p)[2])
                n += 1
    return n


RELEASE_RENAMES = (
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.norm.weight", "norm.weight"),
    ("model.hc_head.hc_fn", "hc_head_fn"),
    ("model.hc_head.hc_base", "hc_head_base"),
    ("model.hc_head.hc_scale", "hc_head_scale"),
)


def write_release(hf: torch.nn.Module, hf_dir: Path, out: Path, tokenizer=None, fp4: bool = True,  # noqa: ANN001
                  fp8: bool = False) -> Path:
    """The release layout of the checkpoint transformers saved in hf_dir, with the config keys the converter reads,
    and the tokenizer if given. fp4: the experts as the release stores them (already FP4-exact: `round_experts`),
    else as they are. fp8: the FP8 weights too (already FP8-exact: `round_fp8`) and the release's
    quantization_config, `expert_dtype` beside it as V4 has it."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in load_file(hf_dir / "model.safetensors").items():
        name = dict(RELEASE_RENAMES).get(name, name).removeprefix("model.")
        name = name.replace(".attn.norm.weight", ".attn.kv_norm.weight")
        if ".ffn.experts." in name and fp4:
            packed, scale, _ = fp4_round(t)
            tensors[name] = packed.view(torch.int8)  # the release's dtype (transformers reads it as int8 too)
            tensors[name.removesuffix(".weight") + ".scale"] = scale
            continue
        if fp8 and FP8_RELEASE.search(name):
            codes, scale, _ = fp8_round(t)  # the scale as transformers keeps ue8m0 (F8_E8M0; the experts' stay U8)
            tensors[name], tensors[name.removesuffix(".weight") + ".scale"] = codes, scale.view(torch.float8_e8m0fnu)
            continue
        tensors[name] = t.contiguous()
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    c = hf.config
    rates = {"compressed_sparse_attention": c.compress_rates["compressed_sparse_attention"],
             "heavily_compressed_attention": c.compress_rates["heavily_compressed_attention"], "sliding_attention": 0}
    compress = c.rope_parameters["compress"]
    config = {**json.loads((hf_dir / "config.json").read_text()),
              "compress_ratios": [rates[t] for t in c.layer_types],
              "num_hash_layers": c.mlp_layer_types.count("hash_moe"),
              "rope_scaling": {k: compress[k] for k in ("factor", "original_max_position_embeddings", "beta_fast",
                                                        "beta_slow")} | {"type": compress["rope_type"]}}
    if fp8:
        config |= {"quantization_config": RELEASE_QUANTIZATION, "expert_dtype": "fp4" if fp4 else "fp8"}
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def round_experts(hf: torch.nn.Module) -> None:
    """Every routed expert's weights replaced, in place, by the FP4 values `fp4_round` stores for them."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".experts." in name:
                for e in range(p.shape[0]):
                    p[e] = fp4_round(p[e])[2]


def convert(release: Path, gguf_file: Path, llama_cpp: Path, outtype: str = "f32") -> Path:
    r = subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(release), "--outfile",
                        str(gguf_file), "--outtype", outtype], capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{r.stderr[-4000:]}")
    return gguf_file
