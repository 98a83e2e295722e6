"""A reference NVFP4 quantiser written from the format's definition (not from agentbox's code), and the tiny
random checkpoints it writes in both published layouts, each with its dequantised twin for transformers.

NVFP4: a tensor's values in blocks of 16 consecutive input columns; each block has an FP8 e4m3 scale, the
tensor one fp32 global scale; each value is an FP4 e2m1 code (1 sign, 2 exponent, 1 mantissa bit: magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6). x ~ e2m1 * block_scale * global, where global = amax / (6 * 448) so the largest
block scale is e4m3's largest (448) and the largest value e2m1's (6).

Layouts (tensor names and config keys as vLLM's and SGLang's loaders read them):
- ModelOpt: `weight` uint8 [out, in / 2] (two codes a byte, column 2j in the low nibble), `weight_scale`
  float8_e4m3fn [out, in / 16], `weight_scale_2` float32 scalar (the global, a multiplier), `input_scale`
  float32 scalar; hf_quant_config.json {producer, quantization: {quant_algo: NVFP4, group_size: 16,
  exclude_modules}} beside a config.json without quantization_config (older exports), or config.json's
  quantization_config {quant_method: modelopt, quant_algo: NVFP4, ...} (newer ones).
- compressed-tensors `nvfp4-pack-quantized`: `weight_packed` (the same bytes), `weight_scale` (the same),
  `weight_global_scale` float32 [1] and `input_global_scale` [1], both the reciprocal (a divisor).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3_MAX, E2M1_MAX, BLOCK = 448.0, 6.0, 16
INPUT_AMAX = 4.0  # a calibrated activation amax stands in for the one ModelOpt would measure


def quantise(w: torch.Tensor, layout: str) -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
    """w [out, in] -> (codes uint8 [out, in] (sign bit 8 | magnitude index), e4m3 scales [out, in / 16],
    the global as the layout stores it, the dequantised twin fp32 [out, in])."""
    w = w.float()
    out, inp = w.shape
    assert inp % BLOCK == 0, inp
    amax = float(w.abs().max())
    if layout == "modelopt":
        stored = float(torch.tensor(amax / (E2M1_MAX * E4M3_MAX), dtype=torch.float32))
        multiplier = stored
    else:  # compressed-tensors stores the divisor; the multiplier is its reciprocal, in fp32
        stored = float(torch.tensor(E2M1_MAX * E4M3_MAX / amax, dtype=torch.float32))
        multiplier = float(torch.tensor(1.0 / stored, dtype=torch.float32))
    blocks = w.reshape(out, inp // BLOCK, BLOCK)
    scale = (blocks.abs().amax(-1) / E2M1_MAX / multiplier).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    s = scale.float()[..., None]
    scaled = torch.where(s > 0, blocks / (s * multiplier), torch.zeros_like(blocks))
    magnitude = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)  # nearest e2m1 magnitude
    codes = magnitude | torch.where((scaled < 0) & (magnitude > 0), 8, 0)
    value = E2M1[magnitude] * torch.where(codes >= 8, -1.0, 1.0)
    twin = (value * s) * multiplier  # e2m1 x e4m3 is exact; the global rounds once
    return codes.reshape(out, inp).to(torch.uint8), scale, stored, twin.reshape(out, inp)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] -> bytes [out, in / 2]: column 2j low nibble, 2j + 1 high nibble."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def quantise_state(
    state: dict[str, torch.Tensor], layout: str, skip: tuple[str, ...]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the checkpoint's tensors, the twin's): every `*_proj.weight` (experts included) but those whose module
    name ends with an entry of `skip`, quantised; the rest, and every other tensor, bf16."""
    out: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, p in state.items():
        base = name.removesuffix(".weight")
        if not name.endswith("_proj.weight") or base.endswith(skip):
            out[name] = p.bfloat16()
            twin[name] = out[name].float()
            continue
        codes, scale, stored, twin[name] = quantise(p.bfloat16().float(), layout)
        packed = pack(codes)
        if layout == "modelopt":
            out[name] = packed
            out[f"{base}.weight_scale_2"] = torch.tensor(stored, dtype=torch.float32)
            out[f"{base}.input_scale"] = torch.tensor(INPUT_AMAX / (E2M1_MAX * E4M3_MAX), dtype=torch.float32)
        else:
            out[f"{base}.weight_packed"] = packed
            out[f"{base}.weight_global_scale"] = torch.tensor([stored], dtype=torch.float32)
            out[f"{base}.input_global_scale"] = torch.tensor([E2M1_MAX * E4M3_MAX / INPUT_AMAX], dtype=torch.float32)
        out[f"{base}.weight_scale"] = scale
    return out, twin


def modelopt_config(exclude: list[str]) -> dict[str, object]:
    return {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": exclude}


def compressed_tensors_config(ignore: list[str]) -> dict[str, object]:
    """quantization_config as llm-compressor writes it for its NVFP4 (W4A4) scheme."""
    fp4 = {"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16, "strategy": "tensor_group",
           "dynamic": False, "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
    return {
        "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": fp4,
                                      "input_activations": {**fp4, "dynamic": "local"},
                                      "output_activations": None, "format": "nvfp4-pack-quantized"}},
        "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {}, "version": "0.12.2",
    }


# The modules the tiny checkpoints leave unquantised, as each layout names them (the router `mlp.gate` is never
# a `*_proj`; one attention output projection is excluded to test the exclusion lists).
SKIPPED = ("layers.1.self_attn.o_proj",)
EXCLUDE = {
    "modelopt": ["lm_head", "*.mlp.gate", "model.layers.1.self_attn.o_proj"],
    "modelopt-config": ["lm_head", "*.mlp.gate", "model.layers.1.self_attn.o_proj"],
    "compressed-tensors": ["lm_head", "re:.*mlp\\.gate$", "re:.*layers\\.1\\.self_attn\\.o_proj$"],
}
LAYOUTS = tuple(EXCLUDE)  # modelopt: hf_quant_config.json; modelopt-config: config.json's quantization_config


def quantise_saved(path: Path, layout: str) -> torch.nn.Module:
    """Rewrite a save_pretrained directory (one safetensors file) into NVFP4 in `layout` in place; returns
    transformers' model of the dequantised twin, loaded from its own directory beside it."""
    state = load_file(str(path / "model.safetensors"))
    out, twin = quantise_state(state, "compressed-tensors" if layout == "compressed-tensors" else "modelopt", SKIPPED)
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config", None)
    twin_dir = path.with_name(path.name + "-twin")
    twin_dir.mkdir(parents=True, exist_ok=True)
    save_file(twin, str(twin_dir / "model.safetensors"))
    (twin_dir / "config.json").write_text(json.dumps(config))
    save_file(out, str(path / "model.safetensors"))
    if layout == "modelopt":
        producer = {"name": "modelopt", "version": "0.33.0"}
        (path / "hf_quant_config.json").write_text(json.dumps({"producer": producer, "quantization": modelopt_config(EXCLUDE[layout])}))
    elif layout == "modelopt-config":
        config["quantization_config"] = {"quant_method": "modelopt", **modelopt_config(EXCLUDE[layout])}
    else:
        config["quantization_config"] = compressed_tensors_config(EXCLUDE[layout])
    (path / "config.json").write_text(json.dumps(config))
    return AutoModelForCausalLM.from_pretrained(twin_dir, attn_implementation="eager", dtype=torch.float32).eval()
