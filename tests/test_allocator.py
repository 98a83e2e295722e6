"""agentbox/allocator.py: with glibc's thresholds set, a step's large temporaries reuse freed memory instead of
faulting fresh pages in each step (glibc's defaults map and unmap them, or trim the heap they came from)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentbox import allocator

# Two 20 MB activations a step, written and freed, as a prefill step's; the minor page faults of four steps after
# six to settle.
STEPS = """
import ctypes, resource, sys
from agentbox import allocator
if sys.argv[1] == "keep":
    assert allocator.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def step():
    blocks = [libc.malloc(20 << 20) for _ in range(2)]
    for b in blocks:
        ctypes.memset(b, 1, 20 << 20)
    for b in blocks:
        libc.free(b)
for _ in range(6):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True, timeout=120, check=True)
    return int(done.stdout.split()[-1])


def test_steps_reuse_freed_memory() -> None:
    if not allocator.keep_freed_memory():  # this process too: harmless, and says whether the C library is glibc
        pytest.skip("the C library has no mallopt (not glibc)")
    pages = 4 * 2 * (20 << 20) // 4096
    assert _faults("default") > pages // 4  # glibc's defaults: fresh pages again, step after step
    assert _faults("keep") < pages // 100
