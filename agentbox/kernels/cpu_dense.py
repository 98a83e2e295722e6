"""Many-row fp32 products on the CPU through oneDNN's matmul (`torch.ops.mkldnn._linear_pointwise`) rather than
MKL's sgemm, which is what `F.linear` calls on the CPU.

Why: torch's MKL picks its AVX2 code on AMD CPUs, while oneDNN picks its kernels by ISA flags alone. On the 2-core
AMD EPYC (Zen 4, AVX-512) at two threads, the hybrid's prefill shapes (1,024 rows x 512 -> 3,072, x 1,536 -> 512,
x 512 -> 1,024) ran at 120-184 GFLOP/s through MKL and 181-200 through oneDNN, near the cores' fp32 peak; 300 rows
170-180 against 108-147, 64 rows 130-144 against 90-94; a 512-column f16 GGUF's prefill of 2,048 tokens went from
881-1,063 to 1,130-1,215 tok/s (alternating in one process).

Numbers: both multiply fp32 by fp32 and sum in fp32; only the order of the sums differs, as between any two sgemms.
Where oneDNN is missing (a torch built without it) or the op is absent, `F.linear` runs.

The torch layers' other many-row passes are here too: the MLP's SiLU-and-mul, one C pass over [gate | up] rows
(`ab_silu_mul_rows`), where F.silu over the strided gate half and the product took two passes and two temporaries;
RMSNorm and the rotary embedding (cpu_rows.c says why, and what numbers they give).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from agentbox.kernels import cpu_gemv


@functools.cache
def available() -> bool:
    """Whether torch carries oneDNN's linear op and it gives F.linear's numbers on a small product."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        op = torch.ops.mkldnn._linear_pointwise
        x, w = torch.arange(48.0).reshape(3, 16) / 7, torch.arange(80.0).reshape(5, 16) / 11
        return bool(torch.allclose(op(x, w, None, "none", [], ""), F.linear(x, w), rtol=1e-5, atol=1e-5))
    except (AttributeError, RuntimeError):
        return False


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, bias) for fp32 CPU tensors of any leading shape, through oneDNN where it is available."""
    if not (x.dtype == w.dtype == torch.float32 and x.device.type == w.device.type == "cpu" and x.numel()
            and (bias is None or bias.dtype == torch.float32) and not x.requires_grad and available()):
        return F.linear(x, w, bias)
    shape = x.shape
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]).contiguous(), w.contiguous(), bias, "none", [],
                                             "")
    return out.reshape(*shape[:-1], w.shape[0])


def silu_mul_rows(gate_up: torch.Tensor) -> torch.Tensor | None:
    """SiLU(gate) * up of fp32 rows [..., 2 I] ([gate | up], as F.silu(gate) * up; exp8's e^x) on the CPU, or None
    where the kernel does not take them (another device or dtype, no kernels): the caller runs torch."""
    if gate_up.device.type != "cpu" or gate_up.dtype != torch.float32 or gate_up.shape[-1] % 2 or not cpu_gemv.available():
        return None
    x = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
    half = x.shape[1] // 2
    out = torch.empty(x.shape[0], half, dtype=torch.float32)
    cpu_gemv._lib().ab_silu_mul_rows(x.data_ptr(), x.shape[0], half, out.data_ptr(), cpu_gemv.threads())
    return out.reshape(*gate_up.shape[:-1], half)


def _rows_lib() -> ctypes.CDLL:
    """cpu_gemv's library (the variant in use) with cpu_rows.c's two entry points declared."""
    return _declare_rows(cpu_gemv._lib())


@functools.cache
def _declare_rows(lib: ctypes.CDLL) -> ctypes.CDLL:
    """(x, t, heads, h, token / head strides, w, eps, out, threads) and (x, t, heads, d, token / head strides, cos,
    sin, out, threads): once per library."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.ab_rmsnorm_rows.argtypes = [ptr, *[i64] * 5, ptr, ctypes.c_float, ptr, ctypes.c_int]
    lib.ab_rmsnorm_rows.restype = ctypes.c_int
    lib.ab_rope_rows.argtypes = [ptr, *[i64] * 5, ptr, ptr, ptr, ctypes.c_int]
    lib.ab_rope_rows.restype = None
    return lib


def _fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and cpu_gemv.available()


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """F.rms_norm(x, weight.shape, weight, eps) of fp32 rows [T, H] or [T, heads, H] (any token and head strides,
    channels contiguous: q or k heads read in place from a qkv row) on the CPU, the fused decode's arithmetic
    (cpu_gemv.h's ab_rmsnorm); None where the kernel does not take them: the caller runs torch."""
    h = weight.shape[-1]
    if not (_fp32_cpu(x, weight) and x.dim() in (2, 3) and x.shape[-1] == h and x.stride(-1) == 1
            and weight.dim() == 1 and x.numel()):
        return None
    heads, s_head = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, h)
    out = torch.empty(x.shape, dtype=torch.float32)
    rc = _rows_lib().ab_rmsnorm_rows(x.data_ptr(), x.shape[0], heads, h, x.stride(0), s_head,
                                         weight.contiguous().data_ptr(), eps, out.data_ptr(), cpu_gemv.threads())
    return out if rc == 0 else None


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x * cos + rotate_half(x) * sin of x [T, heads, D] fp32 (any token and head strides, channels contiguous),
    cos / sin [T, 1, D], bit for bit torch's, on the CPU; None where the kernel does not take them."""
    if not (_fp32_cpu(x, cos, sin) and x.dim() == 3 and x.stride(2) == 1 and x.shape[-1] % 2 == 0
            and cos.shape == sin.shape == (x.shape[0], 1, x.shape[2])):
        return None
    t, heads, d = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((t, heads, d), dtype=torch.float32)
    _rows_lib().ab_rope_rows(x.data_ptr(), t, heads, d, x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
                                 out.data_ptr(), cpu_gemv.threads())
    return out
