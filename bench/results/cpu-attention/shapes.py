"""Other shapes of cpu_attention.c, before (a git ref, default main) and after, alternating in one process: process
CPU time (at 1 thread the calling thread's) and wall, AVX-512 builds (this CPU's pick). A decode row over 4,096 keys
and a 17-token verify (SmolLM2's heads, fp16 cache), the warm turn of docs/cpu-kernels.md (30 tokens over 121k keys,
2 query heads on 1 kv head of 16, fp32 cache), a 1024-token chunk over 2k cached keys (SmolLM2's heads, fp32).

    PYTHONPATH=. python bench/results/cpu-attention/shapes.py [--json shapes.json]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from agentbox.kernels import cpu_attention

ROOT = Path(__file__).resolve().parents[3]
# (name, new tokens, kv_len, hq, hkv, hd, fp16 cache, threads, rounds)
SHAPES = [("decode 1 over 4096", 1, 4096, 9, 3, 64, True, 1, 60), ("decode 1 over 4096", 1, 4096, 9, 3, 64, True, 2, 60),
          ("verify 17 over 4096", 17, 4096, 9, 3, 64, True, 1, 30),
          ("warm turn 30 over 121k, hd 16", 30, 121000, 2, 1, 16, False, 1, 10),
          ("warm turn 30 over 121k, hd 16", 30, 121000, 2, 1, 16, False, 2, 10),
          ("chunk 1024 over 2048 cached", 1024, 3072, 9, 3, 64, False, 1, 6)]


def load(src: Path, out: Path) -> ctypes.CDLL:
    subprocess.run(["cc", *cpu_attention.AVX512_FLAGS, "-I", str(cpu_attention.SPREAD.parent), str(src), "-o",
                    str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.ab_paged_attention.argtypes = [*cpu_attention._ARGS, ctypes.c_int]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="main")
    ap.add_argument("--json")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    (tmp / "ref.c").write_bytes(subprocess.run(["git", "show", f"{a.ref}:agentbox/kernels/cpu_attention.c"], cwd=ROOT,
                                               check=True, capture_output=True).stdout)
    libs = {"before": load(tmp / "ref.c", tmp / "before.so"), "after": load(cpu_attention.SOURCE, tmp / "after.so")}
    res = []
    for name, nq, kv, hq, hkv, hd, f16, th, rounds in SHAPES:
        gen, ps = torch.Generator().manual_seed(0), 16
        pages = -(-kv // ps)
        table = (torch.randperm(pages + 8, generator=gen)[:pages] + 1).to(torch.int32)[None].contiguous()
        dt = torch.float16 if f16 else torch.float32
        k = torch.randn((pages + 9) * ps, hkv, hd, generator=gen).to(dt)
        v = torch.randn((pages + 9) * ps, hkv, hd, generator=gen).to(dt)
        q = torch.randn(nq, hq, hd, generator=gen)
        s, ql, kl = (torch.tensor([x], dtype=torch.int64) for x in (0, nq, kv))
        gflop = (nq * (kv - nq) + nq * (nq + 1) // 2) * hq * 4 * hd / 1e9
        t: dict[str, list[tuple[float, float]]] = {n: [] for n in libs}
        outs = {}
        for r in range(rounds):
            for n in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
                out = torch.empty_like(q)
                c, w = time.process_time(), time.perf_counter()
                libs[n].ab_paged_attention(q.data_ptr(), 1, s.data_ptr(), ql.data_ptr(), kl.data_ptr(),
                                           table.data_ptr(), pages, ps, k.data_ptr(), v.data_ptr(), hq, hkv, hd,
                                           hd ** -0.5, out.data_ptr(), th, int(f16))
                t[n].append((time.process_time() - c, time.perf_counter() - w))
                outs[n] = out
        row = {"shape": name, "threads": th, "gflop": round(gflop, 4),
               "max_abs_diff": (outs["before"] - outs["after"]).abs().max().item()}
        for n, ts in t.items():
            cpu, wall = statistics.median(x for x, _ in ts[1:]), statistics.median(y for _, y in ts[1:])
            row[n] = {"cpu_ms": round(cpu * 1e3, 3), "wall_ms": round(wall * 1e3, 3)}
        row["cpu_speedup"] = round(row["before"]["cpu_ms"] / row["after"]["cpu_ms"], 2)
        row["wall_speedup"] = round(row["before"]["wall_ms"] / row["after"]["wall_ms"], 2)
        print(row, flush=True)
        res.append(row)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
