"""The quantised weight formats the dequant-GEMM kernels read, defined by their torch dequantisers.

Plain torch (no Triton), so layers can import the definitions without decorating a kernel (the interpreter
flag is read at decoration). Each function takes any leading dims (experts) and returns fp32:
- int4, canonical (layers/quant/int4.py, transposed for the kernels): `qweight` int32 [..., K/8, N], row k
  of K at bits 4 * (k % 8); `scale`, `offset` [..., K/group, N]; w[k, n] = q * scale + offset. -> [..., K, N]
- FP8 block: `weight` e4m3 [..., N, K], `scale_inv` [..., ceil(N/bo), ceil(K/bi)] float32. -> [..., N, K]
- MXFP4 (OCP microscaling, gpt-oss): `blocks` uint8 [..., N, K/32, 16] (two FP4 E2M1 codes a byte, low
  nibble first), `scales` uint8 [..., N, K/32] (a power-of-two exponent biased by 127). -> [..., N, K]
"""

from __future__ import annotations

import torch

MXFP4_BLOCK = 32  # values per MXFP4 scale
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequant_int4(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = (qweight.unsqueeze(-2) >> shifts.view(8, 1)) & 0xF  # [..., K/8, 8, N]
    q = q.flatten(-3, -2).float()
    return q * scale.float().repeat_interleave(group, -2) + offset.float().repeat_interleave(group, -2)


def dequant_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = weight.shape[-2:]
    s = scale_inv.float().repeat_interleave(block[0], -2)[..., :n, :].repeat_interleave(block[1], -1)[..., :k]
    return weight.float() * s


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]: the low nibble is the even element
    exponent = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponent.unsqueeze(-1)).flatten(-2).to(dtype)
