"""The fused decode's attention alone (cpu_decode.c ab_attend) and cpu_attention.c at decode: 1 row of SmolLM2's 9 query
heads on 3 kv heads of 64, 30 layers' caches of N keys each (out of cache, as in a decode step), pages in reverse
order; fp32 vs fp16 caches, rounds interleaved, CPU time of the calling thread (one thread).

    PYTHONPATH=. python bench/results/kv-fp16/attention.py 4096
"""
import ctypes
import statistics
import sys
import time

import torch

from agentbox.kernels import cpu_attention, cpu_gemv

n = int(sys.argv[1])
layers, ps, hq, hkv, hd = 30, 16, 9, 3, 64
torch.set_num_threads(1)
pages = n // ps
table = torch.arange(pages, 0, -1).to(torch.int32)[None].contiguous()
gen = torch.Generator().manual_seed(0)
caches = {dt: [tuple(torch.randn((pages + 1) * ps, hkv, hd, generator=gen).to(dt) for _ in "kv") for _ in range(layers)]
          for dt in (torch.float32, torch.float16)}
lib = cpu_gemv._lib()
P, I64 = ctypes.c_void_p, ctypes.c_int64
lib.ab_attend.argtypes = [P, P, ctypes.c_int, I64, I64, I64, ctypes.c_float, P, I64, P, I64, I64, P, P, ctypes.c_int]
qkv, out = torch.randn(1, (hq + 2 * hkv) * hd), torch.empty(1, hq * hd)
kv_lens, q = torch.tensor([n], dtype=torch.int64), torch.randn(1, hq, hd)


def fused(dt: torch.dtype) -> None:
    for k, v in caches[dt]:
        lib.ab_attend(k.data_ptr(), v.data_ptr(), int(dt == torch.float16), hq, hkv, hd, hd**-0.5, qkv.data_ptr(), 1,
                      table.data_ptr(), pages, ps, kv_lens.data_ptr(), out.data_ptr(), 1)


def kernel(dt: torch.dtype) -> None:
    for k, v in caches[dt]:
        cpu_attention.paged_attention(q, k, v, table, ps, [1], [n], hd**-0.5, n_threads=1, amx=False)


res: dict[tuple[str, str], list[float]] = {}
for rnd in range(6):
    for name, f in (("ab_attend", fused), ("cpu_attention", kernel)):
        for dt in (torch.float32, torch.float16) if rnd % 2 == 0 else (torch.float16, torch.float32):
            t = time.thread_time()
            f(dt)
            res.setdefault((name, str(dt)), []).append((time.thread_time() - t) * 1e3)
for (name, dt), ts in res.items():
    print(f"{name} {dt}: median {statistics.median(ts[1:]):.2f} ms for {layers} layers at {n} keys, min {min(ts[1:]):.2f}")
