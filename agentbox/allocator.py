"""glibc's malloc keeps the memory a step frees for the next step, instead of handing it back to the OS.

A prefill step allocates its activations anew: 2,048 tokens of a 2,048-wide model are 16 MB a tensor, and an MoE
layer makes dozens (each expert's gathered rows and products, the C kernels' packed activations). glibc serves a
block above its mmap threshold (128 KB, raised by itself as such blocks are freed, up to 32 MB) from fresh pages
and unmaps it when freed, and gives the top of its heap back to the OS past the trim threshold (twice the mmap
threshold), so each step faulted its memory in and had the kernel zero it again. Measured on a Qwen3-30B-A3B-shaped
GGUF (2 layers, Q8_0, `--cpu-moe`, 2-core Xeon): a 2,048-token prefill took 12-108k minor page faults (fewer as
glibc's threshold crept up, never none) at 1.40-1.63k tok/s; with blocks up to 32 MB from the heap and the heap
kept, 15-17 faults from the second prefill on, at 1.72-1.82k tok/s. The cost: freed memory stays with the process
for reuse (its peak of temporaries, not returned while idle). Blocks above 32 MB, glibc's cap, are still mapped
each time. A leaf module: the engine's runner calls it before it loads the model (called after the load, the same
prefill still took 27-48k faults).
"""

from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # the largest glibc takes (4 * 1024 * 1024 * sizeof(long))
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Sets both thresholds for this process; False where the C library has no mallopt or refuses (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
