"""Quantised MoE experts on CPU through the CPU kernels: kernels/cpu_gemv (4-bit) and kernels/cpu_bits (2, 3,
5, 6 and 8 bits: GGUF Q2_K / Q3_K experts only ever run here).

The canonical int4 experts (layers/experts/int4.py: AWQ, GPTQ, GGUF Q4_0 / Q4_1 / Q4_K) and the k-bit ones
(layers/experts/bits.py: GGUF Q5_* / Q6_K / Q8_0, and Q4_K_M's Q4_K gate/up with a Q6_K down) are K-major for
the GPU's grouped GEMM; on CPU their reference dequantises each routed expert per call, about 30 s a token
for a 30B MoE. Here each expert's projections are repacked once at load into the CPU kernels' forms (the
same information: codes plus a scale, and an offset, per group) and a step multiplies only the routed
experts, each over the tokens routed to it, as a dense quantised layer does: the kernel for a few rows, one
dequantise + sgemm on the same int8-rounded activations for many (prefill). The twin
(`apply(..., linear=_linear_ref)`) runs the same loop over the dequantised experts on `round_activations`
of each projection's input.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.kernels.huge_pages import huge
from agentbox.layers.experts.base import ExpertLayer, ExpertMethod, MoEActivation, activate
from agentbox.layers.experts.bits import BitsExperts
from agentbox.layers.experts.int4 import Int4Experts, unpack_rows_bytes
from agentbox.layers.quant import bits as kbits
from agentbox.layers.quant import int4
from agentbox.layers.quant.cpu_parts import CpuPart, moe_struct

PROJECTIONS = ("w13", "w2")


@dataclass(frozen=True)
class CpuProjection:
    """One projection of every expert as the CPU kernels hold it: `{w}_codes` [E, ...] (4 bits: cpu_gemv's
    tiles, with `{w}_so`; more: cpu_bits' rows [E, N, row bytes]) for an [N, K] weight."""

    n: int
    k: int
    bits: int  # 4: cpu_gemv; 5, 6, 8: cpu_bits
    group: int
    scale_form: int = 0  # cpu_bits.ScaleForm (bits other than 4)
    has_offset: bool = True


def _layer_codes(layer: ExpertLayer, w: str) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor | None]:
    """(codes [E, K, N] uint8, bits, scale [E, K/g, N], offset or None) of a projection, either method."""
    from agentbox.kernels.dequant import unpack_bits

    qweight, scale = getattr(layer, f"{w}_qweight").data, getattr(layer, f"{w}_scale").data
    offset = getattr(layer, f"{w}_offset", None)
    qhigh = getattr(layer, f"{w}_qhigh", None)
    if qhigh is None:  # the int4 layout: 4-bit codes, or 2 / 3-bit ones (BitsForm.bits says which)
        codes = torch.stack([unpack_rows_bytes(qweight[e]) for e in range(qweight.shape[0])])
        b = layer.method.forms[w].bits if isinstance(layer.method, BitsExperts) else 4
        return codes, b, scale, None if offset is None else offset.data
    b = layer.method.forms[w].bits
    return unpack_bits(qweight, qhigh.data, b).to(torch.uint8), b, scale, None if offset is None else offset.data


def eligible(layer: ExpertLayer) -> bool:
    """Int4 or k-bit experts in fp32 on a CPU where the kernels build (not under --exact-cpu), 4-bit groups
    on the 4-bit kernel's 32-column blocks, no act-order permutations."""
    from agentbox.kernels import cpu_gemv

    if not isinstance(layer.method, Int4Experts | BitsExperts) or layer.w13_qweight.device.type != "cpu":
        return False
    if int4.default_cpu_kernel() is not int4.Int4Kernel.CPU_SIMD or not cpu_gemv.available():
        return False
    if layer.w13_scale.dtype != torch.float32 or layer.hidden_size % 32 or layer.intermediate_local % 32:
        return False
    if isinstance(layer.method, Int4Experts):
        return layer.int4_group % 32 == 0 and layer.w13_perm is None and layer.w2_perm is None
    return all(f.bits != 4 or f.group % 32 == 0 for f in layer.method.forms.values())


def _exact_half(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or torch.equal(t.half().float(), t) for t in tensors)


def _pack(codes: torch.Tensor, b: int, scale: torch.Tensor, offset: torch.Tensor | None) -> tuple[list[torch.Tensor], CpuProjection]:
    """Every expert of one projection in the kernel's form, stacked (one form for all experts)."""
    from agentbox.kernels import cpu_bits, cpu_gemv

    e, k, n = codes.shape
    group = k // scale.shape[1]
    if b == 4:
        half = _exact_half(scale, offset)
        packed = [cpu_gemv.pack_q4(codes[x].t(), scale[x].t(), offset[x].t()) for x in range(e)]  # type: ignore[index]
        so = [s.to(torch.float16 if half else torch.float32) for _, s in packed]  # an fp16 pack is exact
        return [huge(torch.stack([c for c, _ in packed])), huge(torch.stack(so))], CpuProjection(n, k, 4, group)

    if b < 4 and offset is not None and torch.equal(offset, scale * -float(1 << (b - 1))):
        offset = None  # Q3_K's offset is its centre: the kernel's symmetric form holds 20 bytes less per 256

    def one(x: int, form: cpu_bits.ScaleForm | None) -> cpu_bits.BitsCPU:
        return cpu_bits.pack_bits_cpu(codes[x].t(), b, scale[x].t(), None if offset is None else offset[x].t(), form)

    rows = [one(x, None) for x in range(e)]
    widest = min(r.form for r in rows)  # F32 < F16 < I8: an expert whose scales need more sets the form
    rows = [r if r.form == widest else one(x, widest) for x, r in enumerate(rows)]
    return [huge(torch.stack([r.data for r in rows]))], CpuProjection(n, k, b, group, int(widest), offset is not None)


def install(layer: ExpertLayer) -> bool:
    """Repack an eligible layer's experts for the CPU kernels (the GPU-layout tensors are released). A step
    the model loader runs once every weight is in (models/loader.py), not something the layer does itself."""
    if not eligible(layer):
        return False
    forms = {}
    for w in PROJECTIONS:
        codes, b, scale, offset = _layer_codes(layer, w)
        tensors, forms[w] = _pack(codes, b, scale, offset)
        for name in ("qweight", "qhigh", "scale", "offset"):
            if hasattr(layer, f"{w}_{name}"):
                delattr(layer, f"{w}_{name}")
        for name, t in zip(("codes", "so"), tensors, strict=False):
            setattr(layer, f"{w}_{name}", nn.Parameter(t, requires_grad=False))
    layer.method = CpuExperts(forms)
    return True


Linear = Callable[[torch.Tensor, "ExpertLayer", str, int], torch.Tensor]  # (x, layer, projection, expert)


def _weights(layer: ExpertLayer, w: str, e: int) -> tuple[CpuProjection, torch.Tensor, torch.Tensor | None]:
    p: CpuProjection = layer.method.forms[w]
    return p, getattr(layer, f"{w}_codes")[e], getattr(layer, f"{w}_so")[e] if p.bits == 4 else None


def _bits(p: CpuProjection, data: torch.Tensor):  # noqa: ANN202 - cpu_bits.BitsCPU, imported lazily
    from agentbox.kernels import cpu_bits

    return cpu_bits.BitsCPU(data, p.bits, p.group, p.k, cpu_bits.ScaleForm(p.scale_form), p.has_offset)


def _linear(x: torch.Tensor, layer: ExpertLayer, w: str, e: int) -> torch.Tensor:
    from agentbox.kernels import cpu_bits, cpu_dense, cpu_gemv

    p, codes, so = _weights(layer, w, e)
    if p.bits == 4:
        if x.shape[0] <= int4.CPU_SIMD_MAX_ROWS:
            return cpu_gemv.q4_matmul(x, codes, so, p.n)
        return cpu_dense.linear(cpu_gemv.round_activations(x), cpu_gemv.q4_dequant(codes, so, p.n))
    if x.shape[0] <= kbits.CPU_SIMD_MAX_ROWS:
        return cpu_bits.bits_matmul(x, _bits(p, codes))
    return cpu_dense.linear(cpu_gemv.round_activations(x), cpu_bits.bits_dequant(_bits(p, codes)))


def _linear_ref(x: torch.Tensor, layer: ExpertLayer, w: str, e: int) -> torch.Tensor:
    from agentbox.kernels import cpu_bits, cpu_gemv

    p, codes, so = _weights(layer, w, e)
    dense = cpu_gemv.q4_dequant_ref(codes, so, p.n) if p.bits == 4 else cpu_bits.bits_dequant_ref(_bits(p, codes))
    return F.linear(cpu_gemv.round_activations(x), dense)


class CpuExperts(ExpertMethod):
    """The experts as `install` leaves them: `{w}_codes` (and `{w}_so` for 4 bits) per projection."""

    def __init__(self, forms: dict[str, CpuProjection]) -> None:
        self.forms = forms

    def create_weights(self, layer: ExpertLayer) -> None:
        raise RuntimeError("CPU experts are made by layers/experts/cpu.py install (a load step) from loaded quantised experts")

    def apply(
        self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        linear: Linear = _linear,
    ) -> torch.Tensor:
        """Each routed expert over its tokens; `linear=_linear_ref` is the twin (dequantised weights)."""
        if linear is _linear and _in_c(layer):
            return self._routed_in_c(layer, x, topk_weights, topk_ids)
        return run_routed(layer, x, topk_weights, topk_ids, linear)

    def _routed_in_c(self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
        """run_routed's loop in one C call (kernels/cpu_moe.c's ab_moe_routed): a prefill's gathers, SiLU and
        weighted adds in torch cost a seventh of a 2,048-token Qwen3-30B-A3B-shaped prefill (issue 44), and its
        products may take the AMX tiles. The same experts in the same order, the same products and the same two
        roundings of each add; the SiLU is cpu_gemv.h's exp (~1 ulp of torch's), so one token takes this path too
        and keeps a batch's numbers."""
        from agentbox.kernels import cpu_gemv

        w13, w2 = self.cpu_parts(layer)
        moe = moe_struct(w13, w2, layer.num_experts, topk_ids.shape[1], False, layer.intermediate_local, None)
        xf = x.float().contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        weights = topk_weights.float().contiguous()
        out = torch.empty_like(xf)
        rc = cpu_gemv._lib().ab_moe_routed(ctypes.addressof(moe), xf.data_ptr(), xf.shape[0], xf.shape[1],
                                           ids.data_ptr(), weights.data_ptr(), out.data_ptr(), cpu_gemv.threads())
        if rc:
            raise RuntimeError(f"ab_moe_routed failed (code {rc}: -1 out of memory, -2 an expert id out of range)")
        return out.to(x.dtype)

    def cpu_parts(self, layer: ExpertLayer) -> tuple[CpuPart, CpuPart]:
        parts = []
        for w in PROJECTIONS:
            p: CpuProjection = self.forms[w]
            codes = getattr(layer, f"{w}_codes")
            if p.bits == 4:
                so = getattr(layer, f"{w}_so")
                parts.append(CpuPart(codes, so, p.n, p.k, p.group, 4, half=so.dtype == torch.float16))
            else:
                parts.append(CpuPart(codes, None, p.n, p.k, p.group, p.bits, form=p.scale_form, off=p.has_offset))
        return parts[0], parts[1]


def _in_c(layer: ExpertLayer) -> bool:
    """The C loop runs gated SiLU experts without biases (Qwen3-MoE's); others keep run_routed."""
    return layer.activation is MoEActivation.SILU and layer.w13_bias is None and layer.w2_bias is None


def run_routed(layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
               linear: Linear) -> torch.Tensor:
    """Each routed expert over its tokens in fp32, `linear` its projections (CpuExperts' and NVFP4's on CPU:
    layers/experts/nvfp4_cpu.py)."""
    xf = x.float()
    out = torch.zeros_like(xf)
    if x.shape[0] == 1:
        # A decode step's one token: its experts straight from the lists, no gathers or scatters (torch.where, the
        # row index, index_add_ and the weight's indexing were ~half the torch ops of each expert). The same
        # experts in the same (sorted) order and the same products and sums as the loop below, so a token's
        # numbers do not depend on whether it ran alone.
        for e, weight in sorted(zip(topk_ids[0].tolist(), topk_weights[0].float().tolist(), strict=True)):
            out += _expert(layer, xf, e, linear) * weight
        return out.to(x.dtype)
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == e)
        out.index_add_(0, token, _expert(layer, xf[token], e, linear) * topk_weights[token, slot, None].float())
    return out.to(x.dtype)


def _expert(layer: ExpertLayer, x: torch.Tensor, e: int, linear: Linear) -> torch.Tensor:
    """Expert e's output for rows x (fp32), unweighted."""
    b13, b2 = layer.w13_bias, layer.w2_bias if layer.tp_rank == 0 else None
    gate_up = linear(x, layer, "w13", e)
    if b13 is not None:
        gate_up = gate_up + b13[e]
    act = activate(gate_up, layer.activation, layer.swiglu_alpha, layer.swiglu_limit)
    y = linear(act, layer, "w2", e)
    if b2 is not None:
        y = y + b2[e]
    return y
