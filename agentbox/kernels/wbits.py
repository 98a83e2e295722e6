"""wbits: x [M, K] (fp16 / bf16 / fp32) times a 5-, 6- or 8-bit weight dequantised tile by tile inside the GEMM.

The weight is the k-bit form of kernels/dequant.py (GGUF Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K reach it at load,
layers/quant/bits.py): the low nibbles in `qweight` [K / 8, N] (as w4a16's), the high bits in `qhigh`
[K (bits - 4) / 32, N], and per group of `group` rows of K a scale and an optional offset ([K / group, N]).
The twin, `wbits_matmul_ref`, defines it (through `dequant_bits`); the tile decoder is `load_bits_tile`.
Decode is memory-bound: the tile decode costs a few integer ops per weight against 5-8 bits read.
"""

from __future__ import annotations

import torch

from agentbox.kernels._quant_triton import check_runnable, dequant_gemm
from agentbox.kernels.dequant import BITS, dequant_bits

GROUPS = (16, 32)  # Q6_K's, the others': a K tile is one group (load_bits_tile reads one scale per tile)


def wbits_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qhigh: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group: int,
    bits: int,
) -> torch.Tensor:
    return (x.float() @ dequant_bits(qweight, qhigh, scale, offset, group, bits)).to(x.dtype)


def wbits_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qhigh: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group: int,
    bits: int,
) -> torch.Tensor:
    check_runnable(x, qweight)
    m, k = x.shape
    n = qweight.shape[1]
    if bits not in BITS or group not in GROUPS or k % group or k % 32 or qweight.shape[0] * 8 != k:
        raise ValueError(
            f"wbits: bits {bits} (one of {BITS}), group {group} (one of {GROUPS}) and K={k} (a multiple of 32 "
            f"and the group) must match qweight {tuple(qweight.shape)}"
        )
    if qhigh.shape[0] * 32 != k * (bits - 4):
        raise ValueError(f"wbits: qhigh {tuple(qhigh.shape)} does not hold {bits - 4} high bits of K={k} rows")
    # a K tile is one group: load_bits_tile reads one scale per tile
    return dequant_gemm(x, n, qweight, scale, o=offset, h=qhigh, bits=bits, k_group=group, block_k=group)
