"""The quantised weight formats the dequant-GEMM kernels read, defined by their torch dequantisers.

Plain torch (no Triton), so layers can import the definitions without decorating a kernel (the interpreter
flag is read at decoration). Each function takes any leading dims (experts) and returns fp32:
- int4, canonical (layers/quant/int4.py, transposed for the kernels): `qweight` int32 [..., K/8, N], row k
  of K at bits 4 * (k % 8); `scale`, `offset` [..., K/group, N]; w[k, n] = q * scale + offset. -> [..., K, N]
- int4 with Q4_K's two-level scales (GGUF Q4_K at its file's bytes): `qweight` as int4's; `sc`, `mn` uint8
  [..., K/32, N] (6-bit scale and min per 32 rows), `dd` fp16 [..., K/256, N, 2] (d and dmin per 256 rows):
  w = q * (d * sc) - dmin * mn, in fp32 as gguf computes it. -> [..., K, N]
- FP8 block: `weight` e4m3 [..., N, K], `scale_inv` [..., ceil(N/bo), ceil(K/bi)] float32. -> [..., N, K]
- MXFP4 (OCP microscaling, gpt-oss): `blocks` uint8 [..., N, K/32, 16] (two FP4 E2M1 codes a byte, low
  nibble first), `scales` uint8 [..., N, K/32] (a power-of-two exponent biased by 127). -> [..., N, K]
- E8M0 (ue8m0: MXFP4's scales, DeepSeek-V4's FP8 block scales): one byte b a value, 2^(b - 127); 255 is NaN.
- k-bit (bits 5, 6, 8; GGUF Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K): codes q in [0, 2^bits), the low 4 bits as
  int4's `qweight` [..., K/8, N] and the high (bits - 4) bits in `qhigh` [..., K (bits-4) / 32, N] int32,
  32 / (bits - 4) consecutive rows of K per word, row k at bit (bits - 4) (k % (32 / (bits - 4))); `scale`
  and optional `offset` [..., K/group, N]: w = q * scale + offset, or (q - 2^(bits-1)) * scale without an
  offset (the symmetric types, computed so in fp32 exactly as gguf does). -> [..., K, N]
"""

from __future__ import annotations

import torch

MXFP4_BLOCK = 32  # values per MXFP4 scale
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


E8M0_DTYPES = (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))


def e8m0_bytes(t: torch.Tensor) -> torch.Tensor:
    """E8M0 scales as their biased exponent bytes (uint8), from either dtype a checkpoint stores them in."""
    if t.dtype not in E8M0_DTYPES:
        raise ValueError(f"E8M0 scales are stored as uint8 or float8_e8m0fnu, not {t.dtype}")
    return t.view(torch.uint8)


def e8m0_to_float(t: torch.Tensor) -> torch.Tensor:
    """E8M0 scales as fp32 2^(b - 127): exact (every power of two from 2^-127 to 2^127 is an fp32 value; 2^-127
    is a subnormal), so an FP8 block method holding fp32 scales holds the same numbers."""
    b = e8m0_bytes(t)
    out = torch.ldexp(torch.ones(b.shape, dtype=torch.float32, device=b.device), b.to(torch.int32) - 127)
    return out.masked_fill(b == 255, float("nan"))


def dequant_int4(qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group: int) -> torch.Tensor:
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    q = (qweight.unsqueeze(-2) >> shifts.view(8, 1)) & 0xF  # [..., K/8, 8, N]
    q = q.flatten(-3, -2).float()
    return q * scale.float().repeat_interleave(group, -2) + offset.float().repeat_interleave(group, -2)


def dequant_int4k(qweight: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, dd: torch.Tensor) -> torch.Tensor:
    d, dmin = (dd[..., i].float().repeat_interleave(8, -2) for i in range(2))  # per 256 rows -> per 32
    return dequant_int4(qweight, d * sc.float(), -(dmin * mn.float()), 32)


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


BITS = (5, 6, 8)  # the k-bit form's widths (4-bit weights take the int4 form)


def _pack_rows(v: torch.Tensor, width: int) -> torch.Tensor:
    """[..., K, N] values below 2^width -> [..., K width / 32, N] int32, 32 / width rows per word, row k at bit
    width (k % (32 / width)) (bit 31 wraps to the sign: unpacking masks after the arithmetic shift)."""
    per = 32 // width
    k, n = v.shape[-2:]
    if k % per:
        raise ValueError(f"pack: K={k} is not a multiple of {per} rows per int32 word")
    v = v.to(torch.int32).reshape(*v.shape[:-2], k // per, per, n)
    out = torch.zeros(*v.shape[:-2], n, dtype=torch.int32, device=v.device)
    for i in range(per):
        out |= v[..., i, :] << (width * i)
    return out


def _unpack_rows(packed: torch.Tensor, width: int) -> torch.Tensor:
    per = 32 // width
    shifts = torch.arange(0, 32, width, dtype=torch.int32, device=packed.device)
    v = (packed.unsqueeze(-2) >> shifts.view(per, 1)) & ((1 << width) - 1)  # [..., K/per, per, N]
    return v.flatten(-3, -2)


def pack_bits(q: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K, N] uint8 codes below 2^bits -> (qweight [..., K/8, N], qhigh [..., K (bits-4)/32, N]) int32."""
    if bits not in BITS:
        raise ValueError(f"k-bit form: bits must be one of {BITS}, not {bits}")
    q = q.to(torch.int32)
    return _pack_rows(q & 0xF, 4), _pack_rows(q >> 4, bits - 4)


def unpack_bits(qweight: torch.Tensor, qhigh: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_bits: [..., K, N] int32 codes."""
    return _unpack_rows(qweight, 4) | (_unpack_rows(qhigh, bits - 4) << 4)


def dequant_bits(
    qweight: torch.Tensor,
    qhigh: torch.Tensor,
    scale: torch.Tensor,
    offset: torch.Tensor | None,
    group: int,
    bits: int,
) -> torch.Tensor:
    q = unpack_bits(qweight, qhigh, bits)
    s = scale.float().repeat_interleave(group, -2)
    if offset is None:
        return (q - (1 << (bits - 1))).float() * s
    return q.float() * s + offset.float().repeat_interleave(group, -2)
