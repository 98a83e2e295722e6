"""Triton for the dequant-GEMM kernels, if installed: `import agentbox.kernels.w4a16` works without it
(the kernels then refuse to run, naming why) and the torch twins still do. TRITON_INTERPRET must be set
before a kernel module is imported (it is read when a kernel is decorated).

`load_weight_tile` is the one in-kernel dequantiser every GEMM here shares (dense w4a16 / w8a16 and the
grouped fused-MoE GEMM): it returns the [BLOCK_K, BLOCK_N] tile of W^T for the K rows `rk` (starting at
`k0`) and N columns `rn`, in fp32 for the quantised formats of kernels/dequant.py. Scales are read once
per tile ([BLOCK_N] at group k0 // K_GROUP), so BLOCK_K must divide the K group (callers check: 32 does
for every format here). FP8 is decoded from its bytes in arithmetic (`FP8`: any GPU, Ampere has no fp8
type in Triton) or by a bitcast to Triton's fp8e4nv (`FP8_NATIVE`: sm_89+, hardware conversion); both
run under the interpreter of Triton 3.9, which also loads fp8 tensors directly.

`load_bits_tile` is its sibling for the k-bit form of kernels/dequant.py (bits 5, 6, 8: GGUF Q5_0 / Q5_1 /
Q8_0 / Q5_K / Q6_K): the low nibbles from `qweight` as INT4 reads them, the high bits from `qhigh`, and a
scale (plus an offset, or the symmetric 2^(bits-1) shift) per group of K_GROUP rows. BLOCK_K must divide
K_GROUP (16 divides both GGUF groups; Q6_K's is 16).
"""

from __future__ import annotations

import functools
import os
from enum import IntEnum

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False


class WeightFormat(IntEnum):
    """How `load_weight_tile` decodes a weight (the kernels take it as a constexpr int)."""

    DENSE = 0  # values in a float dtype, [N, K] by strides
    INT4 = 1  # int32 words of eight 4-bit codes along K; per-group scale and offset
    FP8 = 2  # e4m3 bytes, decoded in arithmetic; one scale per (N_GROUP x K_GROUP) block
    FP8_NATIVE = 3  # e4m3 bytes bitcast to Triton's fp8e4nv (sm_89+)
    MXFP4 = 4  # bytes of two FP4 E2M1 codes along K (low nibble first); a power-of-two scale per 32
    INT4_K = 5  # INT4's codes; Q4_K's 6-bit scale and min per 32 rows (uint8), fp16 d and dmin per 256 (`h`)
    NVFP4 = 6  # MXFP4's code bytes; an e4m3 scale byte per 16 along K, an fp32 multiplier per N column (`o`)


def check_runnable(*tensors: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("the triton package is not installed: quantised GPU matmuls need it")
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if any(t.device.type == "cpu" for t in tensors) and not interpreting:
        raise RuntimeError("Triton kernels run on CPU tensors only under its interpreter (TRITON_INTERPRET=1)")


def native_fp8(device: torch.device) -> bool:
    """Whether Triton converts e4m3 itself on this device (compute capability 8.9+; on sm_80 it refuses
    fp8e4nv at compile time)."""
    return device.type == "cuda" and _capability(torch.cuda.current_device() if device.index is None else device.index) >= (8, 9)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


if HAS_TRITON:
    _DENSE: tl.constexpr = tl.constexpr(WeightFormat.DENSE.value)
    _INT4: tl.constexpr = tl.constexpr(WeightFormat.INT4.value)
    _FP8: tl.constexpr = tl.constexpr(WeightFormat.FP8.value)
    _FP8_NATIVE: tl.constexpr = tl.constexpr(WeightFormat.FP8_NATIVE.value)
    _INT4_K: tl.constexpr = tl.constexpr(WeightFormat.INT4_K.value)
    _NVFP4: tl.constexpr = tl.constexpr(WeightFormat.NVFP4.value)

    @triton.jit
    def e4m3_to_f32(b):
        b = b.to(tl.int32)
        sign = tl.where((b & 0x80) != 0, -1.0, 1.0)
        e = (b >> 3) & 0xF
        m = (b & 0x7).to(tl.float32)
        normal = (1.0 + m / 8.0) * tl.exp2((e - 7).to(tl.float32))
        sub = (m / 8.0) * 0.015625  # 2^-6
        return sign * tl.where(e == 0, sub, normal)

    @triton.jit
    def e2m1_to_f32(c):
        """A 4-bit FP4 E2M1 code (sign, 2 exponent bits with bias 1, 1 mantissa bit) as fp32."""
        sign = tl.where((c & 0x8) != 0, -1.0, 1.0)
        e = (c >> 1) & 0x3
        m = (c & 0x1).to(tl.float32)
        mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
        return sign * mag

    @triton.jit
    def load_weight_tile(
        w_ptr, s_ptr, o_ptr, k0, rk, rn, kmask, nmask,
        swk, swn, ssk, ssn, sok, son, K_GROUP, N_GROUP,
        FORMAT: tl.constexpr,
    ):
        """W^T[rk, rn] ([BLOCK_K, BLOCK_N]); the pointers already point at this matrix (or expert). One return
        at the end: FORMAT is a constexpr, so only its branch is compiled (and the tile's dtype is its own)."""
        mask = kmask[:, None] & nmask[None, :]
        if FORMAT == _DENSE:
            w = tl.load(w_ptr + rk[:, None] * swk + rn[None, :] * swn, mask=mask, other=0.0)
        elif FORMAT == _NVFP4:
            # a scale per 16 rows of K: read per element (K_GROUP 16), so BLOCK_K may span several groups;
            # e2m1 x e4m3 is exact in fp32, the column's global multiplier rounds once, as the twin does
            b = tl.load(w_ptr + (rk // 2)[:, None] * swk + rn[None, :] * swn, mask=mask, other=0)
            c = (b.to(tl.int32) >> ((rk % 2) * 4)[:, None]) & 0xF
            sb = tl.load(s_ptr + (rk // K_GROUP)[:, None] * ssk + rn[None, :] * ssn, mask=mask, other=0)
            g = tl.load(o_ptr + rn * son, mask=nmask, other=0.0).to(tl.float32)
            w = e2m1_to_f32(c) * e4m3_to_f32(sb) * g[None, :]
        else:
            s = tl.load(s_ptr + (k0 // K_GROUP) * ssk + (rn // N_GROUP) * ssn, mask=nmask, other=0).to(tl.float32)
            if FORMAT == _INT4:
                words = tl.load(w_ptr + (rk // 8)[:, None] * swk + rn[None, :] * swn, mask=mask, other=0)
                q = (words >> ((rk % 8) * 4)[:, None]) & 0xF
                o = tl.load(o_ptr + (k0 // K_GROUP) * sok + rn * son, mask=nmask, other=0.0).to(tl.float32)
                w = q.to(tl.float32) * s[None, :] + o[None, :]
            elif FORMAT == _FP8:
                b = tl.load(w_ptr + rk[:, None] * swk + rn[None, :] * swn, mask=mask, other=0)
                w = e4m3_to_f32(b) * s[None, :]
            elif FORMAT == _FP8_NATIVE:
                b = tl.load(w_ptr + rk[:, None] * swk + rn[None, :] * swn, mask=mask, other=0)
                w = b.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[None, :]
            else:  # MXFP4: the scale byte is a biased exponent
                b = tl.load(w_ptr + (rk // 2)[:, None] * swk + rn[None, :] * swn, mask=mask, other=0)
                c = (b.to(tl.int32) >> ((rk % 2) * 4)[:, None]) & 0xF
                w = e2m1_to_f32(c) * tl.exp2(s - 127.0)[None, :]
        return w

    @triton.jit
    def load_bits_tile(
        q_ptr, h_ptr, s_ptr, o_ptr, k0, rk, rn, kmask, nmask,
        sqk, sqn, shk, shn, ssk, ssn, sok, son, K_GROUP,
        BITS: tl.constexpr, HAS_OFFSET: tl.constexpr,
    ):
        """W^T[rk, rn] ([BLOCK_K, BLOCK_N]) in fp32 from the k-bit form; the pointers already point at this
        matrix (or expert); `o_ptr` is not read without an offset (pass any pointer)."""
        HIGH: tl.constexpr = BITS - 4
        PER: tl.constexpr = 32 // HIGH  # rows of K per word of qhigh
        mask = kmask[:, None] & nmask[None, :]
        lo = tl.load(q_ptr + (rk // 8)[:, None] * sqk + rn[None, :] * sqn, mask=mask, other=0)
        hi = tl.load(h_ptr + (rk // PER)[:, None] * shk + rn[None, :] * shn, mask=mask, other=0)
        # int32 shifts are arithmetic: the masks drop the sign bits a word's top row brings down.
        q = ((lo >> ((rk % 8) * 4)[:, None]) & 0xF) | (((hi >> ((rk % PER) * HIGH)[:, None]) & ((1 << HIGH) - 1)) << 4)
        s = tl.load(s_ptr + (k0 // K_GROUP) * ssk + rn * ssn, mask=nmask, other=0).to(tl.float32)
        if HAS_OFFSET:
            o = tl.load(o_ptr + (k0 // K_GROUP) * sok + rn * son, mask=nmask, other=0).to(tl.float32)
            w = q.to(tl.float32) * s[None, :] + o[None, :]
        else:
            w = (q - (1 << (BITS - 1))).to(tl.float32) * s[None, :]
        return w


    @triton.jit
    def load_int4k_tile(q_ptr, d_ptr, sc_ptr, mn_ptr, k0, rk, rn, kmask, nmask, sqk, sqn, sdk, sdn, ssk, ssn):
        """W^T[rk, rn] in fp32 from Q4_K's own scales (kernels/dequant.py dequant_int4k): a 6-bit scale and min
        per 32 rows times d and dmin per 256, multiplied here as gguf does, so the weights are exactly gguf's.
        BLOCK_K 32: a tile is inside one group of 32 and so inside one block of 256."""
        mask = kmask[:, None] & nmask[None, :]
        words = tl.load(q_ptr + (rk // 8)[:, None] * sqk + rn[None, :] * sqn, mask=mask, other=0)
        q = (words >> ((rk % 8) * 4)[:, None]) & 0xF
        sc = tl.load(sc_ptr + (k0 // 32) * ssk + rn * ssn, mask=nmask, other=0).to(tl.float32)
        mn = tl.load(mn_ptr + (k0 // 32) * ssk + rn * ssn, mask=nmask, other=0).to(tl.float32)
        d = tl.load(d_ptr + (k0 // 256) * sdk + rn * sdn, mask=nmask, other=0.0).to(tl.float32)
        dmin = tl.load(d_ptr + (k0 // 256) * sdk + rn * sdn + 1, mask=nmask, other=0.0).to(tl.float32)
        return q.to(tl.float32) * (d * sc)[None, :] - (dmin * mn)[None, :]


if HAS_TRITON:

    @triton.jit
    def dequant_gemm_kernel(
        x_ptr, w_ptr, h_ptr, s_ptr, o_ptr, out_ptr, M, N, K, K_GROUP, N_GROUP,
        sxm, sxk, swk, swn, shk, shn, ssk, ssn, sok, son,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        FORMAT: tl.constexpr, BITS: tl.constexpr, HAS_OFFSET: tl.constexpr,
    ):
        """out [M, N] = x [M, K] @ W^T for every dense quantised weight (w4a16, w8a16, wbits): the tile comes from
        `load_bits_tile` when BITS > 4, else from `load_weight_tile` in FORMAT. One K tile never straddles a
        scale group (callers pick BLOCK_K)."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            kmask = rk < K
            x = tl.load(x_ptr + rm[:, None] * sxm + rk[None, :] * sxk, mask=(rm < M)[:, None] & kmask[None, :], other=0.0)
            if BITS > 4:
                w = load_bits_tile(w_ptr, h_ptr, s_ptr, o_ptr, k0, rk, rn, kmask, rn < N,
                                   swk, swn, shk, shn, ssk, ssn, sok, son, K_GROUP, BITS, HAS_OFFSET)
            elif FORMAT == _INT4_K:
                w = load_int4k_tile(w_ptr, h_ptr, s_ptr, o_ptr, k0, rk, rn, kmask, rn < N,
                                    swk, swn, shk, shn, ssk, ssn)
            else:
                w = load_weight_tile(w_ptr, s_ptr, o_ptr, k0, rk, rn, kmask, rn < N,
                                     swk, swn, ssk, ssn, sok, son, K_GROUP, N_GROUP, FORMAT)
            acc += tl.dot(x, w.to(x.dtype), input_precision="ieee")  # fp32: no TF32, as torch does
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rm < M)[:, None] & (rn < N)[None, :])


def dequant_gemm(
    x: torch.Tensor, n: int, w: torch.Tensor, s: torch.Tensor, *, fmt: WeightFormat = WeightFormat.INT4,
    o: torch.Tensor | None = None, h: torch.Tensor | None = None, bits: int = 0, k_group: int = 32,
    n_group: int = 1, block_k: int = 32, w_strides: tuple[int, int] | None = None,
    s_strides: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Launch `dequant_gemm_kernel` for an [M, K] x and an N-column weight. `w_strides` / `s_strides` are the
    (K, N) strides of the codes and the scales (default: stored K-major, [K.., N]); tensors a format does
    not read (`h`, `o`) may be None."""
    m, k = x.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    o_ = s if o is None else o
    h_ = w if h is None else h
    swk, swn = w_strides if w_strides is not None else (w.stride(0), w.stride(1))
    ssk, ssn = s_strides if s_strides is not None else (s.stride(0), s.stride(1))
    grid = (triton.cdiv(m, 16), triton.cdiv(n, 64))
    dequant_gemm_kernel[grid](
        x, w, h_, s, o_, out, m, n, k, k_group, n_group,
        x.stride(0), x.stride(1), swk, swn, h_.stride(0), h_.stride(1), ssk, ssn, o_.stride(0), o_.stride(1),
        BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, FORMAT=fmt.value, BITS=bits, HAS_OFFSET=o is not None,
    )
    return out
