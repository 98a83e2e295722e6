"""The GPU check's quantised-MoE block (scripts/gpu_check.sh): one JSON object.

At the expert shapes of Qwen3-30B-A3B (128 experts, top 8, 2048 -> 768: int4 group 128, FP8 block 128, and
GGUF Q4_K_M's layers with a Q6_K down: int4 gate/up in groups of 32, a 6-bit down in groups of 16)
and gpt-oss-20b (32 experts, top 4, 2880 -> 2880: MXFP4), at 1 and 16 tokens, in the compute dtype:
time per call of each quantised fused-MoE kernel (kernels/fused_moe_quant.py) against the same kernel on
the same experts in the compute dtype (`vs_dense_kernel` = dense time / quantised time; at a few tokens
the call is bound by reading expert weights, so fewer bytes should mean less time), the routed experts'
bytes read per second (against the card's bandwidth: how far from memory-bound), the experts' resident
bytes against the dense ones, and the error against the format's twin (max |diff| / max |twin|). For MXFP4
also the path gpt-oss's layer took before (dequantise each routed expert in torch, then its matmuls).
Experts are random codes drawn on the device in each layout. `report()` takes a device and shapes so a
test can run the assembly on CPU under Triton's interpreter at a tiny shape.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from agentbox.kernels.dequant import dequant_mxfp4
from agentbox.kernels.fused_moe import fused_moe
from agentbox.kernels.fused_moe_quant import (
    BitsWeights,
    fused_moe_bits,
    fused_moe_bits_ref,
    fused_moe_fp8,
    fused_moe_fp8_ref,
    fused_moe_int4,
    fused_moe_int4_ref,
    fused_moe_mxfp4,
    fused_moe_mxfp4_ref,
)
from agentbox.layers.experts.base import MoEActivation, moe_ref


class ExpertFormat(Enum):
    INT4 = "int4_g128"
    FP8 = "fp8_block128"
    MXFP4 = "mxfp4"
    GGUF_Q4_K_M = "gguf_q4_k_m_q6_k_down"


@dataclass(frozen=True)
class MoEShape:
    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    formats: tuple[ExpertFormat, ...]


QWEN3_30B_A3B = MoEShape(
    "qwen3_30b_a3b", 128, 8, 2048, 768, (ExpertFormat.INT4, ExpertFormat.FP8, ExpertFormat.GGUF_Q4_K_M)
)
GPT_OSS_20B = MoEShape("gpt_oss_20b", 32, 4, 2880, 2880, (ExpertFormat.MXFP4,))


@dataclass(frozen=True)
class Experts:
    """One format's experts at a shape: its tensors (and group / block), the kernel call, its twin."""

    fmt: ExpertFormat
    tensors: tuple[Any, ...]

    def run(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return KERNELS[self.fmt][0](x, *self.tensors, weights, ids)

    def twin(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return KERNELS[self.fmt][1](x.float(), *self.tensors, weights, ids)

    @property
    def nbytes(self) -> int:
        tensors = [t for t in self.tensors if isinstance(t, torch.Tensor)]
        for w in (w for w in self.tensors if isinstance(w, BitsWeights)):
            tensors += [t for t in (w.qweight, w.qhigh, w.scale, w.offset) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)


KERNELS: dict[ExpertFormat, tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]] = {
    ExpertFormat.INT4: (fused_moe_int4, fused_moe_int4_ref),
    ExpertFormat.FP8: (fused_moe_fp8, fused_moe_fp8_ref),
    ExpertFormat.MXFP4: (fused_moe_mxfp4, fused_moe_mxfp4_ref),
    ExpertFormat.GGUF_Q4_K_M: (fused_moe_bits, fused_moe_bits_ref),
}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time(fn: Callable[[], Any], device: str, iters: int, warm: bool = True) -> float:
    if warm:
        fn()  # compiles on the first call
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / iters


def make_experts(fmt: ExpertFormat, s: MoEShape, dtype: torch.dtype, device: str) -> Experts:
    e, h, i = s.experts, s.hidden, s.inter

    def u8(*shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return torch.randint(lo, hi, shape, dtype=torch.uint8, device=device)

    def words(*shape: int) -> torch.Tensor:  # a random word is random codes
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device=device)

    if fmt is ExpertFormat.GGUF_Q4_K_M:
        s13 = (torch.rand(e, h // 32, 2 * i, device=device) * 0.01 + 0.002).to(dtype)
        s2 = (torch.rand(e, i // 16, h, device=device) * 0.003 + 0.001).to(dtype)
        return Experts(fmt, (BitsWeights(words(e, h // 8, 2 * i), None, s13, -8 * s13, 32, 4),
                             BitsWeights(words(e, i // 8, h), words(e, i // 16, h), s2, None, 16, 6)))
    if fmt is ExpertFormat.INT4:
        s13 = (torch.rand(e, h // 128, 2 * i, device=device) * 0.01 + 0.002).to(dtype)
        s2 = (torch.rand(e, i // 128, h, device=device) * 0.01 + 0.002).to(dtype)
        return Experts(fmt, (words(e, h // 8, 2 * i), s13, -8 * s13, words(e, i // 8, h), s2, -8 * s2, 128))
    elif fmt is ExpertFormat.FP8:
        def fp8(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, device=device) * 64).to(torch.float8_e4m3fn)

        return Experts(fmt, (fp8(e, 2 * i, h), torch.rand(e, 2 * i // 128, h // 128, device=device) * 0.001,
                             fp8(e, h, i), torch.rand(e, h // 128, i // 128, device=device) * 0.001, (128, 128)))
    return Experts(fmt, (u8(e, 2 * i, h // 32, 16), u8(e, 2 * i, h // 32, lo=119, hi=123),
                         u8(e, h, i // 32, 16), u8(e, h, i // 32, lo=119, hi=123)))


def _dense(s: MoEShape, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, iters: int) -> tuple[float, int]:
    """(seconds per call, resident bytes) of the same kernel on experts in x's dtype (freed on return)."""
    w13 = (0.02 * torch.randn(s.experts, 2 * s.inter, s.hidden, device=x.device)).to(x.dtype)
    w2 = (0.02 * torch.randn(s.experts, s.hidden, s.inter, device=x.device)).to(x.dtype)
    seconds = _time(lambda: fused_moe(x, w13, w2, weights, ids), str(x.device), iters)
    return seconds, (w13.numel() + w2.numel()) * w13.element_size()


def shape_report(s: MoEShape, tokens: int, dtype: torch.dtype, device: str, iters: int) -> dict[str, Any]:
    torch.manual_seed(tokens)
    x = torch.randn(tokens, s.hidden, device=device).to(dtype)
    weights, ids = torch.topk(torch.softmax(torch.randn(tokens, s.experts, device=device), -1), s.top_k, dim=-1)
    dense_s, dense_bytes = _dense(s, x, weights, ids, iters)
    routed = ids.unique().numel() / s.experts  # share of the experts' bytes one call must read
    out: dict[str, Any] = {
        "tokens": tokens, "experts_routed": ids.unique().numel(), "dense_kernel_us": dense_s * 1e6,
        "dense_read_gb_s": dense_bytes * routed / dense_s / 1e9,
    }
    for fmt in s.formats:
        ex = make_experts(fmt, s, dtype, device)
        got, ref = ex.run(x, weights, ids), ex.twin(x, weights, ids)
        kernel_s = _time(lambda ex=ex: ex.run(x, weights, ids), device, iters, warm=False)  # `got` warmed it
        row: dict[str, Any] = {
            "kernel_us": kernel_s * 1e6,
            "vs_dense_kernel": dense_s / kernel_s,
            "resident_vs_dense": ex.nbytes / dense_bytes,
            "read_gb_s": ex.nbytes * routed / kernel_s / 1e9,  # routed experts' bytes / time
            "rel_err_vs_twin": ((got.float() - ref).abs().max() / ref.abs().max()).item(),
        }
        if fmt is ExpertFormat.MXFP4:
            row["vs_torch_dequant_per_expert"] = _time(lambda ex=ex: _mxfp4_per_expert(ex, x, weights, ids), device, iters) / kernel_s
        out[fmt.value] = row
    return out


def _mxfp4_per_expert(ex: Experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """What Mxfp4Experts.apply ran before the kernel: dequantise each routed expert, then its matmuls."""
    b13, s13, b2, s2 = ex.tensors

    def expert(j: int) -> tuple[torch.Tensor, torch.Tensor]:
        return dequant_mxfp4(b13[j], s13[j], x.dtype), dequant_mxfp4(b2[j], s2[j], x.dtype)

    return moe_ref(x, weights, ids, expert, MoEActivation.SILU)


def report(
    device: str = "cuda", dtype: torch.dtype = torch.bfloat16, shapes: tuple[MoEShape, ...] = (QWEN3_30B_A3B, GPT_OSS_20B),
    tokens: tuple[int, ...] = (1, 16), iters: int = 20,
) -> dict[str, Any]:
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else device,
                           "dtype": str(dtype).removeprefix("torch.")}
    for s in shapes:
        out[s.name] = [shape_report(s, t, dtype, device, iters) for t in tokens]
    return out


if __name__ == "__main__":  # python -m agentbox.bench.gpu_moe_quant (scripts/gpu_check.sh's moe_quant block)
    print(json.dumps(report(), indent=2))
