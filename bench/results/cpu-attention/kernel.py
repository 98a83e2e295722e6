"""cpu_attention.c's extend: 512 new tokens over 4,096 cached keys (kv_len 4,608), SmolLM2-135M's heads (9 query
heads on 3 kv heads of 64), the fp16 cache in pages of 16 in shuffled order. The kernel of a git ref (default
main: the one before issue 52) and the working tree's, each as its AVX-512 and its AVX2 build, called in
alternation in one process; GFLOP/s counts 4 * hd FLOP per (query head, visible key) pair (QK^T and PV), the
causal triangle of the new tokens included (2.23M pairs a head: 5.13 GFLOP a call, one layer).

    PYTHONPATH=. python bench/results/cpu-attention/kernel.py [--ref main] [--rounds 7] [--json out.json]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from agentbox.kernels import cpu_attention
from agentbox.kernels.cpu_attention import _ARGS, AVX512_FLAGS, FLAGS, SPREAD, paged_attention_ref

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def build(source: Path, flags: tuple[str, ...], out: Path) -> ctypes.CDLL:
    subprocess.run(["cc", *flags, "-I", str(SPREAD.parent), str(source), "-o", str(out), "-lm"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.ab_paged_attention.argtypes = [*_ARGS, ctypes.c_int]
    lib.ab_paged_attention.restype = ctypes.c_int
    return lib


def peak(tmp: Path) -> dict[str, float]:
    """One core's fp32 FMA rate: 12 independent FMA chains (peak.c), best of 5 runs of ~0.5 s each."""
    so = tmp / "peak.so"
    subprocess.run(["cc", "-O2", "-mavx512f", "-mfma", "-shared", "-fPIC", str(HERE / "peak.c"), "-o", str(so)],
                   check=True)
    lib = ctypes.CDLL(str(so))
    out = {}
    for name, lanes in (("ab_peak512", 16), ("ab_peak256", 8)):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [ctypes.c_int64], ctypes.c_double
        n, best = 100_000_000, 0.0
        for _ in range(5):
            t = time.perf_counter()
            fn(n)
            best = max(best, n * 12 * lanes * 2 / (time.perf_counter() - t) / 1e9)
        out[name.replace("ab_", "") + "_gflops"] = round(best, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", default="main")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--new", type=int, default=512)
    ap.add_argument("--cached", type=int, default=4096)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--json")
    a = ap.parse_args()
    hq, hkv, hd, ps = 9, 3, 64, 16
    n_q, kv = a.new, a.cached + a.new
    tmp = Path(tempfile.mkdtemp())
    old_src = tmp / "cpu_attention_ref.c"
    old_src.write_bytes(subprocess.run(["git", "show", f"{a.ref}:agentbox/kernels/cpu_attention.c"], cwd=ROOT,
                                       check=True, capture_output=True).stdout)
    libs = {}
    for tag, src in (("before", old_src), ("after", cpu_attention.SOURCE)):
        for isa, flags in (("avx512", AVX512_FLAGS), ("avx2", FLAGS)):
            libs[f"{tag}/{isa}"] = build(src, flags, tmp / f"{tag}-{isa}.so")
    gen = torch.Generator().manual_seed(0)
    pages = -(-kv // ps)
    table = (torch.randperm(pages + 8, generator=gen)[:pages] + 1).to(torch.int32)[None].contiguous()
    slots = (pages + 9) * ps
    k = torch.randn(slots, hkv, hd, generator=gen).half()
    v = torch.randn(slots, hkv, hd, generator=gen).half()
    q = torch.randn(n_q, hq, hd, generator=gen)
    scale = hd ** -0.5
    pairs = n_q * a.cached + n_q * (n_q + 1) // 2
    gflop = pairs * hq * 4 * hd / 1e9
    starts, qlens, kvl = (torch.tensor([x], dtype=torch.int64) for x in (0, n_q, kv))
    want = paged_attention_ref(q, k.float(), v.float(), table, ps, [n_q], [kv], scale)

    def call(lib: ctypes.CDLL, threads: int, out: torch.Tensor) -> tuple[float, float]:
        t, c = time.perf_counter(), time.process_time()
        rc = lib.ab_paged_attention(q.data_ptr(), 1, starts.data_ptr(), qlens.data_ptr(), kvl.data_ptr(),
                                    table.data_ptr(), table.shape[1], ps, k.data_ptr(), v.data_ptr(), hq, hkv, hd,
                                    scale, out.data_ptr(), threads, 1)
        assert rc == 0
        return time.perf_counter() - t, time.process_time() - c

    threads = [int(x) for x in a.threads.split(",")]
    times: dict[str, list[tuple[float, float]]] = {}
    err = {}
    for name, lib in libs.items():
        out = torch.empty_like(q)
        call(lib, 1, out)
        err[name] = (out - want).abs().max().item()
    for r in range(a.rounds):
        order = list(libs.items()) if r % 2 == 0 else list(libs.items())[::-1]
        for th in threads:
            for name, lib in order:
                out = torch.empty_like(q)
                times.setdefault(f"{name}/{th}t", []).append(call(lib, th, out))
    res = {"shape": {"new_tokens": n_q, "cached_keys": a.cached, "kv_len": kv, "hq": hq, "hkv": hkv, "hd": hd,
                     "page_size": ps, "kv_dtype": "fp16", "gflop_per_call": round(gflop, 3)},
           "ref": a.ref, "rounds": a.rounds, "peak_one_core": peak(tmp), "loadavg_before": os.getloadavg(),
           "kernels": {}}
    for key, tc in times.items():
        ts, cs = [w for w, _ in tc], [c for _, c in tc]
        med, cpu = statistics.median(ts), statistics.median(cs)
        res["kernels"][key] = {"median_ms": round(med * 1e3, 2), "min_ms": round(min(ts) * 1e3, 2),
                               "gflops_median": round(gflop / med, 1), "gflops_best": round(gflop / min(ts), 1),
                               # CPU time of the process (every thread): GFLOP per CPU-second, what a core did while
                               # it ran the kernel (the machine is shared; wall time counts others' turns)
                               "cpu_ms_median": round(cpu * 1e3, 2), "gflops_per_cpu_s": round(gflop / cpu, 1),
                               "max_abs_err_vs_fp64": err[key.rsplit("/", 1)[0]]}
    res["loadavg_after"] = os.getloadavg()
    for key, r in res["kernels"].items():
        print(f"{key:20s} {r['median_ms']:8.2f} ms (min {r['min_ms']:.2f})  {r['gflops_median']:6.1f} GFLOP/s "
              f"(best {r['gflops_best']:.1f})  cpu {r['cpu_ms_median']:.1f} ms: {r['gflops_per_cpu_s']:.1f} "
              f"GFLOP/cpu-s  err {r['max_abs_err_vs_fp64']:.2e}")
    print("peak one core:", res["peak_one_core"], "load", res["loadavg_before"], res["loadavg_after"])
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
