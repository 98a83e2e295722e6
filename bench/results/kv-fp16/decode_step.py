"""Decode ms per step at ~N tokens of context through tests/model_harness.py (the fused decode where the model
qualifies): an fp32 KV pool against an fp16 one holding the same history, rounds interleaved, one process.

    PYTHONPATH=. python bench/results/kv-fp16/decode_step.py MODEL.gguf 4096 [threads]
"""
import statistics
import sys
import time

import torch

sys.path.insert(0, 'tests')
from model_harness import PagedRunner

from agentbox.models.loader import load_model

path, ctx = sys.argv[1], int(sys.argv[2])
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 1
torch.set_num_threads(threads)
lm = load_model(path, torch.float32, 'cpu')
gen = torch.Generator().manual_seed(0)
prompt = torch.randint(100, 30000, (ctx,), generator=gen).tolist()
pages = ctx // 16 + 80
r32 = PagedRunner(lm, num_pages=pages, page_size=16)
t = time.perf_counter()
for i in range(0, ctx, 512):  # chunked prefill, as the engine does
    r32.step({0: prompt[i:i + 512]})
print(f'prefill {ctx} tokens: {time.perf_counter() - t:.1f}s; fused decode: {type(r32.cpu_decode).__name__}', flush=True)
r16 = PagedRunner(lm, num_pages=pages, page_size=16, kv_dtype=torch.float16)
for a, b in zip(r16.cache.tensors(), r32.cache.tensors(), strict=True):
    a.copy_(b)  # the same history, rounded
if r32.state is not None:
    for la, lb in zip(r16.state.layers, r32.state.layers, strict=True):
        for a, b in zip(la, lb, strict=True):
            a.copy_(b)
r16.pages, r16.lens, r16.free_pages = {0: list(r32.pages[0])}, dict(r32.lens), list(r32.free_pages)
times = {'fp32': [], 'fp16': []}
cpu = {'fp32': [], 'fp16': []}
tok = 1234
for rnd in range(8):
    for name, r in (('fp32', r32), ('fp16', r16)) if rnd % 2 == 0 else (('fp16', r16), ('fp32', r32)):
        for _ in range(6):
            t, c = time.perf_counter(), time.thread_time()
            r.step({0: [tok]})
            times[name].append((time.perf_counter() - t) * 1e3)
            cpu[name].append((time.thread_time() - c) * 1e3)
for name, ts in times.items():
    ts = ts[2:]
    cs = cpu[name][2:]
    print(f'{name} KV: decode at ~{ctx} tokens: wall median {statistics.median(ts):.2f} ms/step, min {min(ts):.2f}; '
          f'CPU time median {statistics.median(cs):.2f}, min {min(cs):.2f} (n={len(ts)})')
