"""w4a16: x [M, K] (fp16 / bf16 / fp32) times a 4-bit weight dequantised tile by tile inside the GEMM.

The weight is the canonical int4 form of layers/quant/int4.py, transposed for the kernel: codes packed
eight rows of K per int32 word (`qweight` [K / 8, N], row k at bits 4 * (k % 8)), and per group of
`group` rows a scale and an offset (`scale`, `offset` [K / group, N]): w[k, n] = q * scale + offset.
AWQ, GPTQ and GGUF Q4_0 / Q4_1 reach this form at load. The twin, `w4a16_matmul_ref`, defines it
(through kernels/dequant.py); the GEMM is the shared dense one of kernels/_quant_triton.py.

`w4k_matmul` reads GGUF Q4_K's own two-level scales instead (a 6-bit scale and min per 32 rows, fp16 d and dmin
per 256): 0.578 bytes a weight against the file's 0.5625, where a bf16 scale and offset per 32 take 0.625
(Gemma 4 31B's UD-Q4_K_XL: about 1.1 GiB less on the card).
"""

from __future__ import annotations

import torch

from agentbox.kernels._quant_triton import WeightFormat, check_runnable, dequant_gemm
from agentbox.kernels.dequant import dequant_int4, dequant_int4k


def w4a16_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int
) -> torch.Tensor:
    return (x.float() @ dequant_int4(qweight, scale, offset, group)).to(x.dtype)


def w4a16_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int
) -> torch.Tensor:
    check_runnable(x, qweight)
    m, k = x.shape
    n = qweight.shape[1]
    if group % 32 or k % group or qweight.shape[0] * 8 != k:
        raise ValueError(f"w4a16: K={k} and group {group} must be multiples of 32 matching qweight {tuple(qweight.shape)}")
    # BLOCK_K 32: a K tile never straddles a group
    return dequant_gemm(x, n, qweight, scale, fmt=WeightFormat.INT4, o=offset, k_group=group)


def w4k_matmul_ref(
    x: torch.Tensor, qweight: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, dd: torch.Tensor
) -> torch.Tensor:
    return (x.float() @ dequant_int4k(qweight, sc, mn, dd)).to(x.dtype)


def w4k_matmul(x: torch.Tensor, qweight: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, dd: torch.Tensor) -> torch.Tensor:
    """qweight [K / 8, N] int32; sc, mn [K / 32, N] uint8; dd [K / 256, N, 2] fp16 (d, dmin)."""
    check_runnable(x, qweight)
    m, k = x.shape
    n = qweight.shape[1]
    if k % 256 or qweight.shape[0] * 8 != k or sc.shape != (k // 32, n) or (mn.shape, mn.stride()) != (
        sc.shape, sc.stride()) or dd.shape != (k // 256, n, 2) or not dd.is_contiguous():
        raise ValueError(f"w4k: K={k} (a multiple of 256) does not match qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(sc.shape)} / {tuple(mn.shape)} and super-scales {tuple(dd.shape)}")
    return dequant_gemm(x, n, qweight, sc, fmt=WeightFormat.INT4_K, o=mn, h=dd, k_group=32)
