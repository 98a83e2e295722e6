"""Triton, if installed: every kernel module imports it from here, so `import agentbox.kernels.x` works where
Triton is absent (the kernels then refuse to run with a clear error) and the torch twins still do.

The interpreter (`TRITON_INTERPRET=1`) is read by `triton.jit` when a kernel is *decorated*, so callers that
want it must set it before the first kernel module is imported; the backends import kernel modules lazily
(on first use), never at registration, for that reason.

`triton`, `tl` and `HAS_TRITON` load on first use, not with this module: picking an attention backend on a CPU
asks `interpreting()`, and a process that has imported Triton prints about 600 lines of nanobind "leaked"
reports when it exits (every `agentbox stop` of a CPU server did).
"""

from __future__ import annotations

import os
from typing import Any

import torch

_LAZY = ("triton", "tl", "HAS_TRITON")


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name in globals():  # loaded (a direct call: check_runnable)
        return globals()[name]
    try:
        import triton
        import triton.language as tl

        found = True
    except ImportError:  # pragma: no cover - depends on the machine
        triton, tl, found = None, None, False
    globals().update(triton=triton, tl=tl, HAS_TRITON=found)
    return globals()[name]

# Keeps the decode/extend kernels' `window` argument a plain int: a window this large never clips a key.
NO_WINDOW = 1 << 30


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_runnable(*tensors: torch.Tensor) -> None:
    """Refuses up front what would otherwise fail deep inside Triton with an unhelpful message."""
    if not __getattr__("HAS_TRITON"):
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
