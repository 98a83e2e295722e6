"""The GPU check's NVFP4 block (scripts/gpu_check.sh): one JSON object.

At Qwen3-8B's gate_up shape (K 4096 -> N 24576) and a K that is no multiple of the 64-wide tile (4112), at 1
and 32 tokens in bf16: the Triton W4A16 kernel (kernels/nvfp4.py) against dequantise-then-matmul (max |diff| /
max |ref|) and its time per call and tokens per second of this one layer, next to the dequantised weight's
bf16 F.linear. On a GPU with FP4 tensor cores (sm_100 / sm_120) where flashinfer imports, also the FP4 GEMM
(W4A4: relative error against the W4A16 result, which rounds no activation) and its time. And the fused NVFP4
MoE kernel (kernels/fused_moe_quant.py) against its twin at Qwen3-30B-A3B's expert shape (128 experts, top 8,
2048 -> 768) at 1 and 16 tokens, with its time per call. Weights are random
codes and scales drawn in the layout. `report()` takes a device and shapes so a test runs the assembly on CPU
under Triton's interpreter at a tiny shape.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from agentbox.kernels.nvfp4 import nvfp4_w4a16_matmul, nvfp4_w4a16_matmul_ref
from agentbox.kernels.nvfp4_codes import dequantize_nvfp4
from agentbox.layers.quant.formats import has_fp4_tensor_cores
from agentbox.layers.quant.nvfp4 import flashinfer_fp4_available

SHAPES = ((4096, 24576), (4112, 4096))  # (K, N)
BATCHES = (1, 32)
MOE_SHAPE = (128, 8, 2048, 768)  # experts, top k, hidden, expert intermediate
MOE_TOKENS = (1, 16)


def _time(fn: Callable[[], torch.Tensor], device: str, reps: int) -> float:
    fn()  # compile / warm
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def _weights(k: int, n: int, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    packed = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(n, k // 16, generator=gen) * 4).to(torch.float8_e4m3fn)
    gs = torch.full((n,), 0.01)
    return packed.to(device), scale.to(device), gs.to(device)


def moe_report(device: str, shape: tuple[int, int, int, int], tokens: tuple[int, ...], dtype: torch.dtype,
               reps: int, gen: torch.Generator) -> list[dict[str, Any]]:
    from agentbox.kernels.fused_moe_quant import fused_moe_nvfp4, fused_moe_nvfp4_ref

    e, top, h, inter = shape

    def experts(n: int, k: int) -> tuple[torch.Tensor, ...]:
        per = [_weights(k, n, "cpu", gen) for _ in range(e)]
        return tuple(torch.stack([p[i] for p in per]).to(device) for i in range(3))

    w13, w2 = experts(2 * inter, h), experts(h, inter)
    cases = []
    for t in tokens:
        x = (torch.randn(t, h, generator=gen) * 0.1).to(dtype).to(device)
        weights, ids = torch.topk(torch.softmax(torch.randn(t, e, generator=gen), -1), top, dim=-1)
        args = (x, w13, w2, weights.to(device), ids.to(device))
        got, ref = fused_moe_nvfp4(*args).float(), fused_moe_nvfp4_ref(*args).float()
        tm = _time(partial(fused_moe_nvfp4, *args), device, reps)
        cases.append({"experts": e, "top_k": top, "hidden": h, "inter": inter, "tokens": t,
                      "max_err": float((got - ref).abs().max() / ref.abs().max()), "ms": tm * 1e3})
    return cases


def report(device: str = "cuda", shapes: tuple[tuple[int, int], ...] = SHAPES, batches: tuple[int, ...] = BATCHES,
           dtype: torch.dtype = torch.bfloat16, reps: int = 20, moe_shape: tuple[int, int, int, int] = MOE_SHAPE,
           moe_tokens: tuple[int, ...] = MOE_TOKENS) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    capability = torch.cuda.get_device_capability() if device == "cuda" else None
    fp4 = device == "cuda" and has_fp4_tensor_cores(capability) and flashinfer_fp4_available()
    out: dict[str, Any] = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                           "capability": capability, "fp4_gemm": fp4, "cases": []}
    for k, n in shapes:
        packed, scale, gs = _weights(k, n, device, gen)
        dense = dequantize_nvfp4(packed, scale, gs).to(dtype)
        for m in batches:
            x = torch.randn(m, k, generator=gen).to(dtype).to(device)
            ref = nvfp4_w4a16_matmul_ref(x, packed, scale, gs).float()
            got = nvfp4_w4a16_matmul(x, packed, scale, gs).float()
            case: dict[str, Any] = {"k": k, "n": n, "m": m,
                                    "w4a16_max_err": float((got - ref).abs().max() / ref.abs().max())}
            t = _time(partial(nvfp4_w4a16_matmul, x, packed, scale, gs), device, reps)
            td = _time(partial(F.linear, x, dense), device, reps)
            case.update(w4a16_ms=t * 1e3, w4a16_tok_s=m / t, dense_bf16_ms=td * 1e3, dense_bf16_tok_s=m / td)
            if fp4:
                from agentbox.kernels.nvfp4 import fp4_gemm, prepare_fp4_gemm

                w, sf = prepare_fp4_gemm(packed, scale)
                input_scale = (x.float().abs().amax() / (6 * 448)).reshape(1)
                y = fp4_gemm(x, w, sf, gs, input_scale, n).float()
                tf = _time(partial(fp4_gemm, x, w, sf, gs, input_scale, n), device, reps)
                case.update(fp4_rel_err_vs_w4a16=float((y - got).norm() / got.norm()),
                            fp4_rel_err_vs_ref=float((y - ref).norm() / ref.norm()), fp4_ms=tf * 1e3, fp4_tok_s=m / tf)
            out["cases"].append(case)
    out["moe"] = moe_report(device, moe_shape, moe_tokens, dtype, reps, gen)
    return out


if __name__ == "__main__":
    print(json.dumps(report(), indent=2))
