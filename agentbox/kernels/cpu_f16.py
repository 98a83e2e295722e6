"""16-bit weights on the CPU, read as stored: kernels/cpu_hybrid.c's `ab_f16_matmul` (F16C widens 8 weights at a
time inside the dot product) and `ab_bf16_matmul` (a shift widens bf16), and their torch twin, `F.linear` over the
widened weight.

A GGUF written by llama.cpp's converter keeps a small model's linears in f16, and a Hugging Face checkpoint is
mostly bf16. Widened to fp32 at load they cost twice the bytes, and decode streams every weight once a token: held
as stored a step reads half as much. Widening either type to fp32 is exact, so the kernel multiplies the same fp32
numbers as the twin and differs from it only in the order of its sums.

Many rows (a prefill chunk, a warm turn) take AMX bf16 tiles where the CPU has them and the OS grants the tile
state (cpu_f16_amx.c: weights and activations split into two bf16 each, ~16 significant bits a product, finer than
llama.cpp's rounding of the activations to the weights' type); elsewhere the twin. `--exact-cpu` never gets here: it
widens 16-bit weights to fp32 at load.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

# Rows a step of the torch layers runs through the kernel; more widen the weight for one sgemm, which is faster
# from about 16 rows (each weight row is read by every activation row, and 16+ rows of 1536 columns leave L1):
# measured 0.66 / 0.81 ms at 16 rows of 512 x 3072 (kernel / widen + sgemm), 1.82 / 1.29 at 32.
MAX_ROWS = 12
# Fewest rows for the tiles: a speculative verify (at most spec_max_draft + 1 = 17 rows) keeps the twin's numbers,
# as cpu_attention.py's AMX_MIN_TOKENS keeps the fp32 attention's.
AMX_MIN_ROWS = 18
AMX_SOURCE = Path(__file__).with_name("cpu_f16_amx.c")


def f16_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., k] fp32, w [n, k] fp16 or bf16 -> [..., n] fp32."""
    return F.linear(x, w.float())


HALF_DTYPES = (torch.float16, torch.bfloat16)  # what the kernel reads as stored


def supported(w: torch.Tensor) -> bool:
    """Whether the kernel takes this weight (fp16 or bf16, contiguous, on the CPU, k a multiple of 16)."""
    from agentbox.kernels import cpu_gemv

    return (w.dtype in HALF_DTYPES and w.device.type == "cpu" and w.dim() == 2 and w.is_contiguous()
            and w.shape[1] % 16 == 0 and cpu_gemv.available())


@functools.cache
def _amx_library() -> tuple[ctypes.CDLL | None, str]:
    """cpu_f16_amx.c's build, loaded with the process's tile state granted, or (None, why)."""
    from agentbox.kernels.cpu_attention import AMX_CPU_FLAGS, AMX_FLAGS
    from agentbox.kernels.cpu_gemv import compile_cached, cpu_flags

    missing = (AMX_CPU_FLAGS | {"avx512bw"}) - cpu_flags()
    if missing:
        return None, f"this CPU lacks {', '.join(sorted(missing))}"
    target, why = compile_cached("cpu_f16-amx", (AMX_SOURCE,), (*AMX_FLAGS, "-mavx512bw"),
                                 hashed=(AMX_SOURCE.with_name("amx_tiles.h"),))
    if target is None:
        return None, why
    lib = ctypes.CDLL(str(target))
    if lib.ab_half_amx_init() != 0:  # Linux before 5.16, or a kernel that refuses arch_prctl(ARCH_REQ_XCOMP_PERM)
        return None, "the OS did not grant the AMX tile state"
    c_i64, c_ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.ab_half_amx_matmul.argtypes = [c_ptr, c_i64, c_i64, c_ptr, c_i64, c_int, c_ptr, c_int]  # x m k w n bf16 out th
    lib.ab_half_amx_matmul.restype = c_int
    return lib, ""


def amx_available() -> bool:
    return _amx_library()[0] is not None


def f16_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., k] fp32, w [n, k] fp16 or bf16 (`supported`) -> [..., n] fp32: the kernel up to MAX_ROWS rows, the
    tiles from AMX_MIN_ROWS where they run, else the twin."""
    from agentbox.kernels import cpu_dense, cpu_gemv

    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    m = rows.shape[0]
    amx = _amx_library()[0] if m >= AMX_MIN_ROWS and x.dtype == torch.float32 else None
    if (m > MAX_ROWS and amx is None) or x.dtype != torch.float32:  # the twin's numbers, through oneDNN (cpu_dense)
        return cpu_dense.linear(x.float(), w.float()).to(x.dtype)
    rows = rows.contiguous()
    out = torch.empty(m, w.shape[0], dtype=torch.float32)
    bf16 = w.dtype == torch.bfloat16
    if amx is not None:
        rc = amx.ab_half_amx_matmul(rows.data_ptr(), m, w.shape[1], w.data_ptr(), w.shape[0], int(bf16),
                                    out.data_ptr(), cpu_gemv.threads())
        if rc != 0:
            raise RuntimeError(f"ab_half_amx_matmul failed (code {rc})")
        return out.reshape(*shape[:-1], w.shape[0])
    lib = cpu_gemv._lib()
    kernel = lib.ab_bf16_matmul if bf16 else lib.ab_f16_matmul
    rc = kernel(rows.data_ptr(), m, w.shape[1], w.data_ptr(), w.shape[0], out.data_ptr(), cpu_gemv.threads())
    if rc != 0:
        raise RuntimeError(f"{kernel.__name__} failed (code {rc})")
    return out.reshape(*shape[:-1], w.shape[0])
