"""Weights the CPU kernels stream every decode step, in 2 MiB pages where Linux gives them.

A one-row product reads its weight once, front to back: with 4 KiB pages a 258 MB Q6_K LM head crosses 63,000 pages a
token, more than the core's TLB holds, and each page's first line waits on a page walk that its prefetches cannot hide.
The same kernel on the same bytes in 2 MiB pages read that head in 11.7 ms against 19 (one thread, the AVX-512 EPYC;
`transparent_hugepage` "madvise", the common default, gives them only to memory that asks). `huge` copies a large
tensor into memory that asks (madvise MADV_HUGEPAGE before it is touched); where the kernel declines, the copy is in
ordinary pages, and nothing else changes.
"""

from __future__ import annotations

import ctypes
import functools
import sys

import torch

PAGE = 2 << 20
MIN_BYTES = 4 << 20  # smaller tensors stay as they are: a page or two is not worth a copy
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


def huge(t: torch.Tensor) -> torch.Tensor:
    """`t` (contiguous, on the CPU) copied into memory whose whole 2 MiB pages are advised for huge pages (its first and
    last partial ones stay small: the storage is exactly the tensor's bytes), or `t` itself (small, elsewhere, not
    Linux)."""
    nbytes = t.numel() * t.element_size()
    madvise = _madvise()
    if t.device.type != "cpu" or nbytes < MIN_BYTES or madvise is None or not t.is_contiguous():
        return t
    out = torch.empty_like(t)  # untouched: its pages fault in after the advice (a large allocation is a fresh mmap)
    lo, hi = -(-out.data_ptr() // PAGE) * PAGE, (out.data_ptr() + nbytes) // PAGE * PAGE
    if hi > lo:
        madvise(lo, hi - lo, _MADV_HUGEPAGE)  # a refusal leaves ordinary pages
    out.copy_(t)
    return out
