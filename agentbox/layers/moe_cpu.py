"""Int4 MoE experts on CPU through kernels/cpu_gemv's 4-bit kernel.

The canonical int4 experts (layers/moe_quant.py: AWQ, GPTQ, GGUF Q4_0 / Q4_1 / Q4_K) are K-major for the
GPU's grouped GEMM; on CPU their reference dequantises each routed expert per call, about 30 s a token
for a 30B MoE. Here each expert is repacked once at load into the CPU kernel's tiles (the same bytes: 16 of
nibbles plus a scale and an offset per 32 weights) and a step multiplies only the routed experts, each over
the tokens routed to it, as a dense 4-bit layer does: the kernel for a few rows, one dequantise + sgemm on
the same int8-rounded activations for many (prefill). The twin (`apply(..., linear=_linear_ref)`) runs the
same loop over the dequantised experts on `round_activations` of each projection's input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers.moe import ExpertMethod, activate
from agentbox.layers.quant import int4

if TYPE_CHECKING:
    from agentbox.layers.moe import FusedMoE


def eligible(layer: FusedMoE) -> bool:
    """Canonical int4 experts in fp32 on a CPU where the kernel builds (not under --exact-cpu), groups on
    the kernel's 32-column blocks, no act-order permutations."""
    from agentbox.kernels import cpu_gemv
    from agentbox.layers.moe_quant import Int4Experts

    if not isinstance(layer.method, Int4Experts) or layer.w13_qweight.device.type != "cpu":
        return False
    if int4.default_cpu_kernel() is not int4.Int4Kernel.CPU_SIMD or not cpu_gemv.available():
        return False
    if layer.w13_scale.dtype != torch.float32 or layer.int4_group % 32:
        return False
    return layer.w13_perm is None and layer.w2_perm is None


def _tiles(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, half: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's canonical experts ([E, K/8, N] codes, [E, K/g, N] scale / offset) -> the kernel's tiles
    stacked over experts ([E, N/4, K/32, 4, 16], [E, N/4, K/g, 2, 4])."""
    from agentbox.kernels import cpu_gemv
    from agentbox.layers.moe_quant import unpack_rows_bytes

    codes, so = [], []
    for e in range(qweight.shape[0]):
        c, s = cpu_gemv.pack_q4(unpack_rows_bytes(qweight[e]).t(), scale[e].t(), offset[e].t())
        codes.append(c)
        so.append(s.to(torch.float16 if half else torch.float32))  # an fp16 pack is exact: fp32 loses nothing
    return torch.stack(codes), torch.stack(so)


def _exact_half(*tensors: torch.Tensor) -> bool:
    return all(torch.equal(t.half().float(), t) for t in tensors)


def install(layer: FusedMoE) -> bool:
    """Repack an eligible layer's experts for the CPU kernel (the canonical tensors are released)."""
    if not eligible(layer):
        return False
    half = _exact_half(layer.w13_scale, layer.w13_offset, layer.w2_scale, layer.w2_offset)
    for w in ("w13", "w2"):
        q, s, o = (getattr(layer, f"{w}_{n}") for n in ("qweight", "scale", "offset"))
        codes, so = _tiles(q.data, s.data, o.data, half)
        for n in ("qweight", "scale", "offset"):
            delattr(layer, f"{w}_{n}")
        setattr(layer, f"{w}_codes", nn.Parameter(codes, requires_grad=False))
        setattr(layer, f"{w}_so", nn.Parameter(so, requires_grad=False))
    layer.method = CpuInt4Experts(layer.method.group)
    return True


Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def _linear(x: torch.Tensor, codes: torch.Tensor, so: torch.Tensor, n: int) -> torch.Tensor:
    from agentbox.kernels import cpu_gemv

    if x.shape[0] <= int4.CPU_SIMD_MAX_ROWS:
        return cpu_gemv.q4_matmul(x, codes, so, n)
    return F.linear(cpu_gemv.round_activations(x), cpu_gemv.q4_dequant(codes, so, n))


def _linear_ref(x: torch.Tensor, codes: torch.Tensor, so: torch.Tensor, n: int) -> torch.Tensor:
    from agentbox.kernels import cpu_gemv

    return F.linear(cpu_gemv.round_activations(x), cpu_gemv.q4_dequant_ref(codes, so, n))


class CpuInt4Experts(ExpertMethod):
    """The experts as `install` leaves them: w13_codes / w13_so, w2_codes / w2_so (kernels/cpu_gemv tiles)."""

    def __init__(self, group: int) -> None:
        self.group = group

    def create_weights(self, layer: FusedMoE) -> None:
        raise RuntimeError("CPU int4 experts are made by moe_cpu.install from loaded int4 experts")

    def apply(
        self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        linear: Linear = _linear,
    ) -> torch.Tensor:
        """Each routed expert over its tokens; `linear=_linear_ref` is the twin (dequantised weights)."""
        n13, h = 2 * layer.intermediate_local, layer.hidden_size
        b13, b2 = layer.w13_bias, layer.w2_bias if layer.tp_rank == 0 else None
        xf = x.float()
        out = torch.zeros_like(xf)
        for e in torch.unique(topk_ids).tolist():
            token, slot = torch.where(topk_ids == e)
            gate_up = linear(xf[token], layer.w13_codes[e], layer.w13_so[e], n13)
            if b13 is not None:
                gate_up = gate_up + b13[e]
            act = activate(gate_up, layer.activation, layer.swiglu_alpha, layer.swiglu_limit)
            y = linear(act, layer.w2_codes[e], layer.w2_so[e], h)
            if b2 is not None:
                y = y + b2[e]
            out.index_add_(0, token, y * topk_weights[token, slot, None].float())
        return out.to(x.dtype)
