"""16-bit weights on the CPU, read as stored: kernels/cpu_hybrid.c's `ab_f16_matmul` (F16C widens 8 weights at a
time inside the dot product) and `ab_bf16_matmul` (a shift widens bf16), and their torch twin, `F.linear` over the
widened weight.

A GGUF written by llama.cpp's converter keeps a small model's linears in f16, and a Hugging Face checkpoint is
mostly bf16. Widened to fp32 at load they cost twice the bytes, and decode streams every weight once a token: held
as stored a step reads half as much. Widening either type to fp32 is exact, so the kernel multiplies the same fp32
numbers as the twin and differs from it only in the order of its sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows a step of the torch layers runs through the kernel; more widen the weight for one sgemm, which is faster
# from about 16 rows (each weight row is read by every activation row, and 16+ rows of 1536 columns leave L1):
# measured 0.66 / 0.81 ms at 16 rows of 512 x 3072 (kernel / widen + sgemm), 1.82 / 1.29 at 32.
MAX_ROWS = 12


def f16_matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., k] fp32, w [n, k] fp16 or bf16 -> [..., n] fp32."""
    return F.linear(x, w.float())


HALF_DTYPES = (torch.float16, torch.bfloat16)  # what the kernel reads as stored


def supported(w: torch.Tensor) -> bool:
    """Whether the kernel takes this weight (fp16 or bf16, contiguous, on the CPU, k a multiple of 16)."""
    from agentbox.kernels import cpu_gemv

    return (w.dtype in HALF_DTYPES and w.device.type == "cpu" and w.dim() == 2 and w.is_contiguous()
            and w.shape[1] % 16 == 0 and cpu_gemv.available())


def f16_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., k] fp32, w [n, k] fp16 or bf16 (`supported`) -> [..., n] fp32: the kernel up to MAX_ROWS rows, else
    the twin."""
    from agentbox.kernels import cpu_dense, cpu_gemv

    shape = x.shape
    rows = x.reshape(-1, shape[-1])
    if rows.shape[0] > MAX_ROWS or x.dtype != torch.float32:  # the twin's numbers, through oneDNN (cpu_dense)
        return cpu_dense.linear(x.float(), w.float()).to(x.dtype)
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], w.shape[0], dtype=torch.float32)
    lib = cpu_gemv._lib()
    kernel = lib.ab_bf16_matmul if w.dtype == torch.bfloat16 else lib.ab_f16_matmul
    rc = kernel(rows.data_ptr(), rows.shape[0], w.shape[1], w.data_ptr(), w.shape[0], out.data_ptr(), cpu_gemv.threads())
    if rc != 0:
        raise RuntimeError(f"{kernel.__name__} failed (code {rc})")
    return out.reshape(*shape[:-1], w.shape[0])
