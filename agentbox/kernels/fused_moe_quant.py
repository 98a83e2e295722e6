"""Fused MoE over quantised experts that stay quantised in memory: int4 (canonical), k-bit, FP8 block, MXFP4,
NVFP4.

Each entry point describes its tensors as `ExpertWeights` for the one grouped GEMM of kernels/fused_moe.py,
which dequantises a [BLOCK_K, BLOCK_N] tile of the routed expert inside its K loop (weight-only: the
activations stay in x's dtype, the products accumulate in fp32). Layouts (kernels/dequant.py defines them):
- int4, HELPERS contract 1: `w13_qweight` int32 [E, H/8, 2I], `w13_scale` / `w13_offset` [E, H/g, 2I];
  `w2_qweight` [E, I/8, H], `w2_scale` / `w2_offset` [E, I/g, H] (K-major, the transpose of [out, in]).
  GPTQ act-order experts add `w13_perm` [E, H] / `w2_perm` [E, I] (stored K row j is input perm[e, j]):
  the kernel gathers the activations' columns through it, the weights stay as stored.
- k-bit (bits 5, 6, 8: GGUF Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K experts), one `BitsWeights` per projection:
  `qweight` int32 [E, K/8, N] (the low nibbles, int4's layout), `qhigh` int32 [E, K (bits-4)/32, N], `scale`
  and optional `offset` [E, K/g, N], g 16 or 32. w13 and w2 each have their own bits, group and offset;
  bits 4 is the int4 form (no qhigh; offset always), so a Q4_K gate/up layer may run with a Q6_K down.
- FP8 block, contract 2: `w13_weight` e4m3 [E, 2I, H], `w13_weight_scale_inv` float32 [E, 2I/bo, H/bi];
  `w2_weight` [E, H, I], `w2_weight_scale_inv` [E, H/bo, I/bi]; gate and up each start on a block row.
- MXFP4, as layers/experts/mxfp4.py stores gpt-oss's experts: `w13_blocks` uint8 [E, 2I, H/32, 16],
  `w13_scales` uint8 [E, 2I, H/32]; `w2_blocks` [E, H, I/32, 16], `w2_scales` [E, H, I/32].
- NVFP4, as layers/experts/nvfp4.py stores it: codes uint8 [E, N, K/2] (two a byte, low nibble first), e4m3
  scales [E, N, K/16], an fp32 global multiplier per output row [E, N].
Every twin (`*_ref`) dequantises only the experts the batch routes to and runs fused_moe_ref on them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from agentbox.kernels._quant_triton import WeightFormat, native_fp8
from agentbox.kernels.dequant import MXFP4_BLOCK, dequant_bits, dequant_fp8_block, dequant_int4, dequant_mxfp4
from agentbox.kernels.fused_moe import ExpertWeights, fused_moe_experts, fused_moe_ref, silu_and_mul

Act = Callable[[torch.Tensor], torch.Tensor]


def _strides(t: torch.Tensor, *dims: int) -> tuple[int, int, int]:
    return tuple(t.stride(d) for d in dims)  # type: ignore[return-value]


def int4_expert_weights(
    qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int, perm: torch.Tensor | None = None
) -> ExpertWeights:
    e, k8, n = qweight.shape
    if perm is not None and (perm.shape != (e, k8 * 8) or perm.stride(1) != 1):
        raise ValueError(f"int4 experts: perm {tuple(perm.shape)} does not fit [E, K] = {(e, k8 * 8)} (contiguous rows)")
    if qweight.dtype != torch.int32 or scale.shape != (e, k8 * 8 // group, n) or offset.shape != scale.shape:
        raise ValueError(
            f"int4 experts: qweight {tuple(qweight.shape)} {qweight.dtype}, scale {tuple(scale.shape)}, offset "
            f"{tuple(offset.shape)} do not fit [E, K/8, N] int32 and [E, K/{group}, N]"
        )
    return ExpertWeights(
        WeightFormat.INT4, qweight, n, k8 * 8, _strides(qweight, 0, 2, 1),
        scale, _strides(scale, 0, 1, 2), offset, _strides(offset, 0, 1, 2), k_group=group, perm=perm,
    )


@dataclass(frozen=True)
class BitsWeights:
    """One projection of every expert in the k-bit form (bits 5, 6, 8) or, with bits 4, the int4 form."""

    qweight: torch.Tensor  # int32 [E, K/8, N]
    qhigh: torch.Tensor | None  # int32 [E, K (bits-4) / 32, N]; None for bits 4
    scale: torch.Tensor  # [E, K/group, N]
    offset: torch.Tensor | None  # [E, K/group, N]; None: symmetric, w = (q - 2^(bits-1)) * scale
    group: int
    bits: int

    def expert_weights(self) -> ExpertWeights:
        if self.bits == 4:
            if self.offset is None or self.qhigh is not None:
                raise ValueError("4-bit experts are the int4 form: an offset and no high bits")
            return int4_expert_weights(self.qweight, self.scale, self.offset, self.group)
        e, k8, n = self.qweight.shape
        k = k8 * 8
        high = (e, k * (self.bits - 4) // 32, n)
        if (
            self.qweight.dtype != torch.int32 or self.qhigh is None or self.qhigh.dtype != torch.int32
            or tuple(self.qhigh.shape) != high or self.scale.shape != (e, k // self.group, n)
            or (self.offset is not None and self.offset.shape != self.scale.shape)
        ):
            raise ValueError(
                f"{self.bits}-bit experts: qweight {tuple(self.qweight.shape)} {self.qweight.dtype}, qhigh "
                f"{None if self.qhigh is None else tuple(self.qhigh.shape)}, scale {tuple(self.scale.shape)} do not "
                f"fit int32 [E, K/8, N], int32 {list(high)} and [E, K/{self.group}, N]"
            )
        offset = self.offset
        return ExpertWeights(
            WeightFormat.INT4, self.qweight, n, k, _strides(self.qweight, 0, 2, 1),
            self.scale, _strides(self.scale, 0, 1, 2), offset,
            (0, 0, 0) if offset is None else _strides(offset, 0, 1, 2), k_group=self.group,
            bits=self.bits, high=self.qhigh, high_strides=_strides(self.qhigh, 0, 2, 1),
        )

    def dequant(self, ids: torch.Tensor) -> torch.Tensor:
        """The definition for experts `ids`: [n, N, K] fp32 ([out, in])."""
        offset = None if self.offset is None else self.offset[ids]
        if self.bits == 4:
            w = dequant_int4(self.qweight[ids], self.scale[ids], offset, self.group)  # type: ignore[arg-type]
        else:
            w = dequant_bits(self.qweight[ids], self.qhigh[ids], self.scale[ids], offset, self.group, self.bits)  # type: ignore[index]
        return w.transpose(-1, -2)


def fp8_expert_weights(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> ExpertWeights:
    e, n, k = weight.shape
    bo, bi = block
    if weight.dtype != torch.float8_e4m3fn or scale_inv.shape != (e, -(-n // bo), -(-k // bi)):
        raise ValueError(
            f"FP8 experts: weight {tuple(weight.shape)} {weight.dtype} and scale_inv {tuple(scale_inv.shape)} "
            f"do not fit e4m3 [E, N, K] and [E, N/{bo}, K/{bi}]"
        )
    fmt = WeightFormat.FP8_NATIVE if native_fp8(weight.device) else WeightFormat.FP8
    codes = weight.view(torch.uint8)  # the bytes; the tile decoder turns them into values
    return ExpertWeights(
        fmt, codes, n, k, _strides(codes, 0, 1, 2), scale_inv, _strides(scale_inv, 0, 2, 1), k_group=bi, n_group=bo,
    )


def mxfp4_expert_weights(blocks: torch.Tensor, scales: torch.Tensor) -> ExpertWeights:
    e, n, groups, half = blocks.shape
    if blocks.dtype != torch.uint8 or half != MXFP4_BLOCK // 2 or scales.shape != (e, n, groups):
        raise ValueError(
            f"MXFP4 experts: blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} do not "
            f"fit uint8 [E, N, K/32, 16] and [E, N, K/32]"
        )
    codes = blocks.view(e, n, groups * half)  # byte k // 2 holds inputs k (low nibble) and k + 1
    return ExpertWeights(
        WeightFormat.MXFP4, codes, n, groups * MXFP4_BLOCK, _strides(codes, 0, 1, 2),
        scales, _strides(scales, 0, 2, 1), k_group=MXFP4_BLOCK,
    )


def nvfp4_expert_weights(codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> ExpertWeights:
    e, n, half = codes.shape
    if codes.dtype != torch.uint8 or scale.shape != (e, n, half * 2 // 16) or global_scale.shape != (e, n):
        raise ValueError(
            f"NVFP4 experts: codes {tuple(codes.shape)} {codes.dtype}, scales {tuple(scale.shape)} and global "
            f"{tuple(global_scale.shape)} do not fit uint8 [E, N, K/2], [E, N, K/16] and [E, N]"
        )
    s8 = scale.view(torch.uint8)  # e4m3 bytes, decoded in the tile
    gs = global_scale.float()
    return ExpertWeights(
        WeightFormat.NVFP4, codes, n, half * 2, _strides(codes, 0, 1, 2), s8, _strides(s8, 0, 2, 1),
        gs, (gs.stride(0), 0, gs.stride(1)), k_group=16,
    )


def fused_moe_int4(
    x: torch.Tensor,
    w13_qweight: torch.Tensor, w13_scale: torch.Tensor, w13_offset: torch.Tensor,
    w2_qweight: torch.Tensor, w2_scale: torch.Tensor, w2_offset: torch.Tensor,
    group: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    act: Act = silu_and_mul, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
    w13_perm: torch.Tensor | None = None, w2_perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] -> [T, H] over canonical int4 experts (scale and offset in any float dtype); group % 32 == 0.
    `w13_perm` / `w2_perm`: GPTQ act-order experts' row orders (None: stored order is input order)."""
    w13 = int4_expert_weights(w13_qweight, w13_scale, w13_offset, group, w13_perm)
    w2 = int4_expert_weights(w2_qweight, w2_scale, w2_offset, group, w2_perm)
    return fused_moe_experts(x, w13, w2, topk_weights, topk_ids, act, b13, b2)


def fused_moe_bits(
    x: torch.Tensor, w13: BitsWeights, w2: BitsWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    act: Act = silu_and_mul, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] -> [T, H] over k-bit (or int4) experts, each projection in its own bits / group / offset."""
    return fused_moe_experts(x, w13.expert_weights(), w2.expert_weights(), topk_weights, topk_ids, act, b13, b2)


def fused_moe_fp8(
    x: torch.Tensor,
    w13_weight: torch.Tensor, w13_weight_scale_inv: torch.Tensor,
    w2_weight: torch.Tensor, w2_weight_scale_inv: torch.Tensor,
    block: tuple[int, int], topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    act: Act = silu_and_mul, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] -> [T, H] over FP8 block experts (weight-only); block = (bo, bi), bi % 32 == 0."""
    w13 = fp8_expert_weights(w13_weight, w13_weight_scale_inv, block)
    w2 = fp8_expert_weights(w2_weight, w2_weight_scale_inv, block)
    return fused_moe_experts(x, w13, w2, topk_weights, topk_ids, act, b13, b2)


def fused_moe_mxfp4(
    x: torch.Tensor,
    w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w2_blocks: torch.Tensor, w2_scales: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    act: Act = silu_and_mul, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] -> [T, H] over MXFP4 experts in the gpt-oss layout (gate rows then up rows in w13)."""
    w13 = mxfp4_expert_weights(w13_blocks, w13_scales)
    w2 = mxfp4_expert_weights(w2_blocks, w2_scales)
    return fused_moe_experts(x, w13, w2, topk_weights, topk_ids, act, b13, b2)


def fused_moe_nvfp4(
    x: torch.Tensor,
    w13: tuple[torch.Tensor, torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    act: Act = silu_and_mul, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, H] -> [T, H] over NVFP4 experts; w13 / w2 = (codes, scales, global multipliers per row)."""
    return fused_moe_experts(x, nvfp4_expert_weights(*w13), nvfp4_expert_weights(*w2), topk_weights, topk_ids, act, b13, b2)


# ---- the twins: dequantise the routed experts, then the dense reference ----


def _ref_on_routed(
    x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, act: Act,
    b13: torch.Tensor | None, b2: torch.Tensor | None,
    dequant: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """`dequant(expert ids)` -> (w13 [n, 2I, H], w2 [n, H, I]) for those experts, in [out, in] order."""
    routed = torch.unique(topk_ids)
    w13, w2 = dequant(routed)
    local = torch.searchsorted(routed, topk_ids)
    return fused_moe_ref(
        x, w13.to(x.dtype), w2.to(x.dtype), topk_weights, local, act,
        None if b13 is None else b13[routed], None if b2 is None else b2[routed],
    )


def fused_moe_int4_ref(
    x: torch.Tensor,
    w13_qweight: torch.Tensor, w13_scale: torch.Tensor, w13_offset: torch.Tensor,
    w2_qweight: torch.Tensor, w2_scale: torch.Tensor, w2_offset: torch.Tensor,
    group: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    act: Act = silu_and_mul, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
    w13_perm: torch.Tensor | None = None, w2_perm: torch.Tensor | None = None,
) -> torch.Tensor:
    def one(q: torch.Tensor, s: torch.Tensor, o: torch.Tensor, perm: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
        w = dequant_int4(q[ids], s[ids], o[ids], group)  # [n, K, N] in stored row order
        if perm is not None:  # stored row j is input perm[j]
            w = torch.empty_like(w).scatter_(1, perm[ids].unsqueeze(-1).expand_as(w), w)
        return w.transpose(1, 2)

    def dequant(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            one(w13_qweight, w13_scale, w13_offset, w13_perm, ids), one(w2_qweight, w2_scale, w2_offset, w2_perm, ids)
        )

    return _ref_on_routed(x, topk_weights, topk_ids, act, b13, b2, dequant)


def fused_moe_bits_ref(
    x: torch.Tensor, w13: BitsWeights, w2: BitsWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    act: Act = silu_and_mul, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
) -> torch.Tensor:
    return _ref_on_routed(x, topk_weights, topk_ids, act, b13, b2, lambda ids: (w13.dequant(ids), w2.dequant(ids)))


def fused_moe_fp8_ref(
    x: torch.Tensor,
    w13_weight: torch.Tensor, w13_weight_scale_inv: torch.Tensor,
    w2_weight: torch.Tensor, w2_weight_scale_inv: torch.Tensor,
    block: tuple[int, int], topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    act: Act = silu_and_mul, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
) -> torch.Tensor:
    def dequant(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            dequant_fp8_block(w13_weight[ids], w13_weight_scale_inv[ids], block),
            dequant_fp8_block(w2_weight[ids], w2_weight_scale_inv[ids], block),
        )

    return _ref_on_routed(x, topk_weights, topk_ids, act, b13, b2, dequant)


def fused_moe_mxfp4_ref(
    x: torch.Tensor,
    w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w2_blocks: torch.Tensor, w2_scales: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    act: Act = silu_and_mul, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
) -> torch.Tensor:
    def dequant(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return dequant_mxfp4(w13_blocks[ids], w13_scales[ids]), dequant_mxfp4(w2_blocks[ids], w2_scales[ids])

    return _ref_on_routed(x, topk_weights, topk_ids, act, b13, b2, dequant)


def fused_moe_nvfp4_ref(
    x: torch.Tensor,
    w13: tuple[torch.Tensor, torch.Tensor, torch.Tensor], w2: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    act: Act = silu_and_mul, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
) -> torch.Tensor:
    from agentbox.kernels.nvfp4_codes import dequantize_nvfp4

    def dequant(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(dequantize_nvfp4(c[ids], s[ids], g[ids]) for c, s, g in (w13, w2))  # type: ignore[return-value]

    return _ref_on_routed(x, topk_weights, topk_ids, act, b13, b2, dequant)
