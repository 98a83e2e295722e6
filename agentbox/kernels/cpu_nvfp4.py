"""NVFP4 weights times activations on x86-64 CPUs (cpu_nvfp4.c), and the torch twin.

The weight stays in the checkpoint's layout (kernels/nvfp4_codes.py: codes uint8 [N, K / 2], e4m3 scales
[N, K / 16], an fp32 global multiplier per row or one), so NVFP4 experts in host RAM run at 4.5 bits a weight as
loaded. The activations are rounded to int8 per 32 columns exactly as cpu_gemv's kernels round them
(`round_activations`), each block of 32 codes becomes int8 through a 16-entry table of twice the e2m1 values,
and the integer dot products are scaled by the e4m3 block scale and the global: the twin (`nvfp4_matmul_ref`)
computes the same sums in torch, and a many-row caller's `F.linear(round_activations(x), dequantize_nvfp4(...))`
the same numbers.

Its own small library per instruction-set variant (cpu_gemv.Isa, the variant cpu_gemv picks or `use_isa` names),
built and cached by cpu_gemv.compile_cached, so it builds and loads apart from the other weight kernels.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from agentbox.kernels import cpu_gemv
from agentbox.kernels.cpu_gemv import BLOCK, Isa, quantize_activations_ref, round_activations
from agentbox.kernels.nvfp4_codes import GROUP, unpack_e2m1

__all__ = ["available", "nvfp4_matmul", "nvfp4_matmul_ref", "round_activations", "supports"]

SOURCE = cpu_gemv.SOURCE.with_name("cpu_nvfp4.c")
_c_i64, _c_ptr, _c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


@functools.cache
def load(isa: Isa) -> tuple[ctypes.CDLL | None, str]:
    target, why = cpu_gemv.compile_cached(f"cpu_nvfp4-{isa.value}", (SOURCE,), (*cpu_gemv.FLAGS, *isa.cc_flags),
                                          hashed=(SOURCE.with_name("cpu_gemv.h"),), label=f"{SOURCE.name} ({isa.value})")
    if target is None:
        return None, why
    lib = ctypes.CDLL(str(target))
    lib.ab_nvfp4_isa.restype = ctypes.c_char_p
    # (x, m, k, codes, scales, global, n, out, threads)
    lib.ab_nvfp4_matmul.argtypes = [_c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_ptr, _c_i64, _c_ptr, _c_int]
    lib.ab_nvfp4_matmul.restype = _c_int
    return lib, ""


def _lib() -> tuple[ctypes.CDLL | None, str]:
    isa = cpu_gemv.isa()  # the weight kernels' variant (a test's use_isa included)
    if isa is None:
        return None, cpu_gemv.unavailable_reason()
    return load(isa)


def available() -> bool:
    return _lib()[0] is not None


def supports(k: int) -> bool:
    """The kernel takes inputs in whole activation blocks of 32 (NVFP4 itself needs only 16)."""
    return k > 0 and k % BLOCK == 0


def _globals(global_scale: torch.Tensor, n: int) -> torch.Tensor:
    return global_scale.float().reshape(-1).expand(n).contiguous() if global_scale.numel() == 1 else \
        global_scale.float().reshape(n).contiguous()


def nvfp4_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> [M, N] fp32 for the weight codes [N, K / 2] uint8, scale [N, K / 16] e4m3 (or its bytes),
    global_scale [N] (or one) fp32; x rounded to int8 per 32 columns (round_activations)."""
    lib, why = _lib()
    if lib is None:
        raise RuntimeError(f"the CPU NVFP4 kernel is unavailable: {why}")
    x = x.contiguous().float()
    (m, k), n = x.shape, codes.shape[0]
    if codes.shape[1] * 2 != k or scale.shape[1] * GROUP != k or not supports(k):
        raise ValueError(f"x has {k} columns, the weight {codes.shape[1] * 2} (scales for {scale.shape[1] * GROUP}); "
                         f"the kernel needs a multiple of {BLOCK}")
    out = torch.empty(m, n, dtype=torch.float32)
    if m == 0 or n == 0:
        return out
    codes, s, g = codes.contiguous(), scale.contiguous().view(torch.uint8), _globals(global_scale, n)
    rc = lib.ab_nvfp4_matmul(x.data_ptr(), m, k, codes.data_ptr(), s.data_ptr(), g.data_ptr(), n, out.data_ptr(),
                             cpu_gemv.threads())
    if rc != 0:
        raise RuntimeError(f"nvfp4_matmul failed (code {rc})")
    return out


def nvfp4_matmul_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """The twin: integer dots of the rounded activations and twice the e2m1 values per group of 16, times the
    activation block's d and the group's e4m3 scale, summed over the row, times half the global."""
    xq, d = quantize_activations_ref(x)  # [M, K/32, 32], [M, K/32]
    m, n = x.shape[0], codes.shape[0]
    w2 = (unpack_e2m1(codes) * 2).reshape(n, -1, GROUP)  # integers in [-12, 12]
    dots = torch.einsum("mgj,ngj->mng", xq.reshape(m, -1, GROUP), w2)
    per = d.repeat_interleave(BLOCK // GROUP, 1)  # [M, K/16]: each group's activation block
    total = (dots * per.unsqueeze(1) * scale.float().unsqueeze(0)).sum(-1)
    return total * (0.5 * _globals(global_scale, n))
