"""Tiny random checkpoints quantised by the tests into published on-disk layouts (names, dtypes, shapes and
config keys as released checkpoints have them), each with its dequantised twin for transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen2Config

from agentbox.layers.quant.awq import awq_pack
from agentbox.layers.quant.int4 import pack_rows_int32

CONFIG = dict(
    architectures=["Qwen2ForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
    rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="float16",
)
# Linear weights as released checkpoints name them (MLA's kv_a_proj_with_mqa too: DeepSeek / GLM quantise it).
LINEAR_WEIGHTS = ("_proj.weight", "_proj_with_mqa.weight")
INPUT_OF = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
PROMPT = [5, 17, 100, 3, 99, 42, 7, 120, 64, 1, 33, 8]


def random_hf(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(Qwen2Config(**CONFIG), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_((1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p)).half().float())
    return hf


def _asym(
    w: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit over `rows` of w [in, out] (in-major): codes, scale [out] in `dtype`, zero [out]."""
    part = w[rows]
    lo, hi = part.min(0).values.clamp(max=0), part.max(0).values.clamp(min=0)
    scale = ((hi - lo) / 15).clamp(min=1e-6).to(dtype)
    zero = torch.round(-lo / scale.float()).clamp(0, 15)
    q = torch.clamp(torch.round(part / scale.float()) + zero, 0, 15)
    return q.to(torch.uint8), scale, zero.to(torch.uint8)


def _sym(
    w: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    part = w[rows]
    scale = (part.abs().max(0).values / 7).clamp(min=1e-6).to(dtype)
    q = torch.clamp(torch.round(part / scale.float()) + 8, 0, 15)
    return q.to(torch.uint8), scale, torch.full_like(scale, 8, dtype=torch.uint8)


def quantise_int4(
    w_out_in: torch.Tensor, group: int, sym: bool, g_idx: torch.Tensor, dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [in, out], scales [groups, out] in `dtype`, zeros [groups, out], dequantised [out, in] fp32)."""
    w = w_out_in.t().float()
    k, n = w.shape
    q = torch.empty(k, n, dtype=torch.uint8)
    groups = k // group
    scales, zeros = torch.empty(groups, n, dtype=dtype), torch.empty(groups, n, dtype=torch.uint8)
    for gi in range(groups):
        rows = (g_idx == gi).nonzero().flatten()
        q[rows], scales[gi], zeros[gi] = (_sym if sym else _asym)(w, rows, dtype)
    deq = (q.float() - zeros[g_idx].float()) * scales[g_idx].float()
    return q, scales, zeros, deq.t().contiguous()


def quantise_int4_state(
    state: dict[str, torch.Tensor], method: str, sym: bool, act_order: bool, group: int,
    suffixes: tuple[str, ...] = LINEAR_WEIGHTS,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the checkpoint's tensors in AWQ (AutoAWQ GEMM), GPTQ (v1) or compressed-tensors W4A16 (pack-quantized,
    bf16 scales) layout, the dequantised twin's tensors), both named as released: every `*_proj.weight`
    (or name ending in one of `suffixes`) quantised (MoE experts included), the rest fp16."""
    out: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(1)
    perms: dict[tuple[str, int], torch.Tensor] = {}
    for name, p in state.items():
        if not name.endswith(suffixes):
            out[name] = p.half()
            twin[name] = out[name].float()
            continue
        base = name.removesuffix(".weight")
        k = p.shape[1]
        g_idx = torch.arange(k) // group
        if act_order:  # the order follows the layer input's Hessian: q/k/v share one, gate/up another
            proj = base.rsplit(".", 1)[1]
            key = (base.rsplit(".", 2)[0], INPUT_OF.get(proj, proj))
            if key not in perms:
                perms[key] = torch.randperm(k, generator=gen)
            g_idx = g_idx[perms[key]]
        ct = method == "compressed-tensors"
        q, scales, zeros, twin[name] = quantise_int4(p, group, sym, g_idx, torch.bfloat16 if ct else torch.float16)
        if ct:  # codes packed along the input, zero points along the output; both as signed value + 8
            out[f"{base}.weight_packed"] = pack_rows_int32(q).t().contiguous()
            out[f"{base}.weight_scale"] = scales.t().contiguous()
            out[f"{base}.weight_shape"] = torch.tensor(p.shape)  # int64, as compressed-tensors writes it
            if not sym:
                out[f"{base}.weight_zero_point"] = pack_rows_int32(zeros.t().contiguous())
            if act_order:
                out[f"{base}.weight_g_idx"] = g_idx.to(torch.int32)
            continue
        if method == "awq":
            out[f"{base}.qweight"] = awq_pack(q)
            out[f"{base}.qzeros"] = awq_pack(zeros)
        else:
            out[f"{base}.qweight"] = pack_rows_int32(q)
            out[f"{base}.qzeros"] = pack_rows_int32((zeros.to(torch.int32) - 1).t().contiguous()).t().contiguous()
            out[f"{base}.g_idx"] = g_idx.to(torch.int32)
        out[f"{base}.scales"] = scales
    return out, twin


def int4_quant_config(method: str, sym: bool, act_order: bool, group: int) -> dict:
    if method == "compressed-tensors":
        return compressed_tensors_config(group, sym, act_order)
    if method == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
                "modules_to_not_convert": None}
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym, "desc_act": act_order,
            "damp_percent": 0.01, "static_groups": False, "true_sequential": True, "checkpoint_format": "gptq"}


def write_int4(path: Path, method: str, sym: bool = False, act_order: bool = False, group: int = 128) -> torch.nn.Module:
    """An AWQ (AutoAWQ GEMM), GPTQ (v1) or compressed-tensors W4A16 checkpoint of a tiny Qwen2; returns the
    dequantised twin."""
    hf = random_hf()
    state, twin = quantise_int4_state(hf.state_dict(), method, sym, act_order, group)
    hf.load_state_dict(twin)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    qc = int4_quant_config(method, sym, act_order, group)
    (path / "config.json").write_text(json.dumps({**CONFIG, "model_type": "qwen2", "quantization_config": qc}))
    return hf


def compressed_tensors_config(group: int, sym: bool, act_order: bool) -> dict[str, object]:
    """config.json's quantization_config as llm-compressor writes it for a W4A16 GPTQ recipe."""
    weights = {
        "num_bits": 4, "type": "int", "symmetric": sym, "group_size": group, "strategy": "group",
        "actorder": "group" if act_order else None, "block_structure": None, "dynamic": False,
        "observer": "minmax", "observer_kwargs": {},
    }
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": "pack-quantized"}},
        "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "global_compression_ratio": None,
        "version": "0.9.2",
    }


FP8_CONFIG = dict(
    architectures=["Qwen3ForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=128, max_position_embeddings=128,
    rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16", model_type="qwen3",
)


FP8_QUANT_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}


def quantise_fp8_state(
    state: dict[str, torch.Tensor], block: tuple[int, int] = (128, 128), suffixes: tuple[str, ...] = LINEAR_WEIGHTS
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the Qwen3-*-FP8 checkpoint's tensors: e4m3 `*_proj.weight` + float32 `weight_scale_inv` per block,
    the rest bf16; the dequantised twin's tensors). Every quantised dim must be whole blocks."""
    out: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, p in state.items():
        p = p.bfloat16().float()
        if not name.endswith(suffixes):
            out[name], twin[name] = p.bfloat16(), p
            continue
        rows, cols = p.shape
        bo, bi = block
        tiles = p.reshape(rows // bo, bo, cols // bi, bi)
        scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-8)
        q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        twin[name] = (q.float() * scale[:, None, :, None]).reshape(rows, cols)
        out[name] = q.reshape(rows, cols)
        out[name.replace(".weight", ".weight_scale_inv")] = scale.float()
    return out, twin


def write_fp8(path: Path, block: tuple[int, int] = (128, 128)) -> torch.nn.Module:
    """A Qwen3-*-FP8 style checkpoint (e4m3 weights + float32 weight_scale_inv per 128x128 block) of a tiny
    Qwen3 whose every dim is whole blocks; returns the dequantised twin."""
    from transformers import Qwen3Config

    torch.manual_seed(0)
    cfg = {k: v for k, v in FP8_CONFIG.items() if k != "model_type"}
    hf = AutoModelForCausalLM.from_config(Qwen3Config(**cfg), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.05 * torch.randn_like(p))
    state, twin = quantise_fp8_state(hf.state_dict(), block)
    hf.load_state_dict(twin)
    path.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path / "model.safetensors"))
    qc = {**FP8_QUANT_CONFIG, "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps({**FP8_CONFIG, "quantization_config": qc}))
    return hf


def quantise_saved(path: Path, fmt: str, group: int = 128, sym: bool = False, act_order: bool = False) -> torch.nn.Module:
    """Rewrite a save_pretrained directory (one safetensors file, released names: per-expert MoE tensors
    too) into `fmt` (fp8, awq, gptq) in place; returns transformers' model of the dequantised twin, loaded
    from its own directory beside it (transformers 5 fuses experts in memory, so the twin goes by file)."""
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    if fmt == "fp8":
        out, twin = quantise_fp8_state(state)
        qc = {**FP8_QUANT_CONFIG, "weight_block_size": [128, 128]}
    else:
        out, twin = quantise_int4_state(state, fmt, sym, act_order, group)
        qc = int4_quant_config(fmt, sym, act_order, group)
    config = json.loads((path / "config.json").read_text())
    twin_dir = path.with_name(path.name + "-twin")
    twin_dir.mkdir(parents=True, exist_ok=True)
    save_file(twin, str(twin_dir / "model.safetensors"))
    (twin_dir / "config.json").write_text(json.dumps(config))
    save_file(out, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    return AutoModelForCausalLM.from_pretrained(twin_dir, attn_implementation="eager", dtype=torch.float32).eval()
