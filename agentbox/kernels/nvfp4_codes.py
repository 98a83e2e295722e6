"""NVFP4's numbers, the bottom every NVFP4 path reads (kernels, quant methods, experts, the reference twins): two
e2m1 codes a byte, input column 2j in the low nibble, 2j + 1 in the high one; a code is sign (bit 3), two exponent
bits and one mantissa bit; one e4m3 scale per GROUP values and an fp32 multiplier per row (or one)."""

from __future__ import annotations

import torch

GROUP = 16
# e2m1 magnitudes by code & 7 (the format's table); code & 8 is the sign.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n / 2] -> float32 [..., n]: the e2m1 values, low nibble first."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=packed.device)
    b = packed.to(torch.int64)
    codes = torch.stack((b & 15, b >> 4), dim=-1).flatten(-2)
    return table[codes]


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The reference: uint8 [out, in / 2], e4m3 [out, >= in / 16], fp32 multiplier [out] (or scalar) -> fp32
    [out, in]. e2m1 x e4m3 is exact in fp32; the global scale is the one rounding."""
    values = unpack_e2m1(packed)
    scale = block_scale.float().repeat_interleave(GROUP, dim=-1)[..., : values.shape[-1]]
    gs = global_scale.float()
    return values * scale * (gs[..., None] if gs.dim() else gs)
