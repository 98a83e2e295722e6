"""Triton for the dequant-GEMM kernels, if installed: `import agentbox.kernels.w4a16` works without it
(the kernels then refuse to run, naming why) and the torch twins still do. TRITON_INTERPRET must be set
before a kernel module is imported (it is read when a kernel is decorated)."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - depends on the machine
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False


def check_runnable(*tensors: torch.Tensor) -> None:
    if not HAS_TRITON:
        raise RuntimeError("the triton package is not installed: quantised GPU matmuls need it")
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if any(t.device.type == "cpu" for t in tensors) and not interpreting:
        raise RuntimeError("Triton kernels run on CPU tensors only under its interpreter (TRITON_INTERPRET=1)")
