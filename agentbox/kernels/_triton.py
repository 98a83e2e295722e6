"""Triton, if installed: every kernel module imports it from here, so `import agentbox.kernels.x` works where
Triton is absent (the kernels then refuse to run with a clear error) and the torch twins still do.

The interpreter (`TRITON_INTERPRET=1`) is read by `triton.jit` when a kernel is *decorated*, so callers that
want it must set it before the first kernel module is imported; the backends import kernel modules lazily
(on first use), never at registration, for that reason.
"""

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

# Keeps the decode/extend kernels' `window` argument a plain int: a window this large never clips a key.
NO_WINDOW = 1 << 30


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_runnable(*tensors: torch.Tensor) -> None:
    """Refuses up front what would otherwise fail deep inside Triton with an unhelpful message."""
    if not HAS_TRITON:
        raise RuntimeError("the triton package is not installed; use the torch attention backend")
    on_cpu = any(t.device.type == "cpu" for t in tensors)
    if on_cpu and not interpreting():
        raise RuntimeError("Triton kernels run on CPU tensors only under its interpreter (TRITON_INTERPRET=1)")


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def window_arg(sliding_window: int | None) -> int:
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return NO_WINDOW if sliding_window is None else sliding_window
