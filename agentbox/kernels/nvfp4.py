"""NVFP4 GEMMs: x [M, K] times a weight [N, K] stored as e2m1 codes (two a byte along K, low nibble first), an
e4m3 scale per 16 values of K and an fp32 multiplier per output column (layers/quant/nvfp4.py keeps the
checkpoint's per-tensor global scale per row, so fused layers stay exact).

- `nvfp4_w4a16_matmul`: the Triton weight-only kernel (any GPU; CPU under TRITON_INTERPRET=1): each tile of
  codes and scale bytes is decoded in registers (kernels/_quant_triton.py `load_weight_tile`, format NVFP4)
  and multiplied in x's dtype with fp32 accumulation. Its twin, `nvfp4_w4a16_matmul_ref`, defines it:
  dequantise (layers/quant/nvfp4.py `dequantize_nvfp4`), then matmul in fp32.
- `fp4_gemm`: W4A4 on FP4 tensor cores (sm_100 / sm_120) through flashinfer, where it is installed:
  activations quantised to NVFP4 per 16 with the checkpoint's input scale, flashinfer's `mm_fp4`, then each
  column times its global multiplier. Not run here (no such GPU, no flashinfer): scripts/gpu_check.sh and
  the `gpu` test measure it against the W4A16 kernel and the twin.
"""

from __future__ import annotations

import torch

from agentbox.kernels._quant_triton import WeightFormat, check_runnable, dequant_gemm
from agentbox.kernels.nvfp4_codes import GROUP, dequantize_nvfp4

BLOCK_K = 64  # a tile spans four scale groups; the kernel reads a scale per element row, so any K % 16 == 0 works


def nvfp4_w4a16_matmul_ref(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    return (x.float() @ dequantize_nvfp4(weight, weight_scale, global_scale).t()).to(x.dtype)


def nvfp4_w4a16_matmul(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32), weight uint8 [N, K / 2], weight_scale e4m3 [N, K / 16], global fp32 [N]."""
    check_runnable(x, weight)
    n, k = weight.shape[0], x.shape[1]
    if k % GROUP or weight.shape[1] * 2 != k or weight_scale.shape != (n, k // GROUP):
        raise ValueError(
            f"nvfp4: x [.., {k}], weight {tuple(weight.shape)}, scale {tuple(weight_scale.shape)} do not fit "
            f"(K a multiple of {GROUP}, weight [N, K / 2], scale [N, K / {GROUP}])"
        )
    scale = weight_scale.view(torch.uint8)  # decoded in arithmetic: no fp8 type needed (Ampere, interpreter)
    g = global_scale.float().reshape(1, n)  # `o`: read at column n
    return dequant_gemm(
        x, n, weight, scale, fmt=WeightFormat.NVFP4, o=g, k_group=GROUP, block_k=BLOCK_K,
        w_strides=(weight.stride(1), weight.stride(0)), s_strides=(scale.stride(1), scale.stride(0)),
    )


def _pad_to(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out = t.new_zeros(-(-t.shape[0] // rows) * rows, -(-t.shape[1] // cols) * cols)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def prepare_fp4_gemm(weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Once at load: the weight's scales padded to the 128 x 4 tiles of the FP4 GEMM's swizzled layout and
    interleaved there (flashinfer's `nvfp4_block_scale_interleave`); the codes are used as stored."""
    import flashinfer

    sf = _pad_to(weight_scale.view(torch.uint8), 128, 4)
    return weight, flashinfer.nvfp4_block_scale_interleave(sf)


def fp4_gemm(
    x: torch.Tensor, weight: torch.Tensor, weight_sf: torch.Tensor, global_scale: torch.Tensor,
    input_scale: torch.Tensor, n: int,
) -> torch.Tensor:
    """x [M, K] bf16 / fp16 -> [M, N]: activations to NVFP4 with the global 1 / input_scale (the checkpoint's
    calibrated amax / (448 * 6)), the FP4 GEMM with alpha = input_scale, then each column's multiplier."""
    import flashinfer

    x_fp4, x_sf = flashinfer.fp4_quantize(x, (1.0 / input_scale).float(), GROUP, False, True)
    out = flashinfer.mm_fp4(
        x_fp4, weight.t(), x_sf, weight_sf.t(), input_scale.float(), x.dtype, block_size=GROUP, backend="cutlass"
    )
    return (out[:, :n].float() * global_scale).to(x.dtype)  # in fp32: the multiplier may be far from 1
