"""Per-row cost of the CPU kernels' multi-row products (`agentbox bench cpu-rows`): one JSON object.

A batch of decode steps, a speculative verify or a chunked prefill's tail multiplies M rows by the same
weight. The kernels read each weight once for all M rows and unpack it once per block, so the cost of a row
falls with M: this times one call at M = 1, 2, 4, 8, 16 (and, for the prefill threshold, 32 and 64 against
dequantise + sgemm) per GGUF type on SmolLM2's layer shapes, with the weight cold (the calls cycle through
copies of the layer past the last-level cache, as decode does) and reports time / M over the time at M = 1.
It names the CPU, its ISA flags and the kernel variant that ran. Times are the minimum over repeats, in the
process's CPU time at one thread.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from agentbox.bench.cpu_bits import SHAPES, TYPES, _copies, _weight
from agentbox.kernels import cpu_bits as cb
from agentbox.kernels import cpu_gemv as cg

ROWS = (1, 2, 4, 8, 16)
SGEMM_ROWS = (16, 32, 64)  # where dequantise + one sgemm may win (the layers' CPU_SIMD_MAX_ROWS)
ISA_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")


def _time(calls: list[Callable[[], object]], repeats: int, min_seconds: float) -> tuple[float, float]:
    """(min, median) seconds per call: the process's CPU time at one thread (on a shared machine the wall
    clock counts other processes' turns; CPU time does not, though shared caches still do), else wall time."""
    clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
    for f in calls:
        f()
    per: list[float] = []
    for _ in range(repeats):
        done, start = 0, clock()
        while (elapsed := clock() - start) < min_seconds or done == 0:
            for f in calls:
                f()
            done += len(calls)
        per.append(elapsed / done)
    return min(per), sorted(per)[len(per) // 2]


def cpu_info() -> dict[str, object]:
    """The CPU model, its ISA flags that matter to the kernels, and the variant picked."""
    picked = cg.isa()
    return {"cpu_model": cg.cpu_model(), "isa_flags": [f for f in ISA_FLAGS if f in cg.cpu_flags()],
            "kernel_isa": picked.value if picked else None, "cores": os.cpu_count()}


def _q4(n: int, k: int, seed: int, half: bool = True, q4_0: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A Q4_1-like weight: fp16 scale and offset per 32 columns (Q4_0-like with `q4_0`: offset -8 x scale); or
    Q4_K-like (`half` False): fp32 ones, the products of the file's super-block and 6-bit sub-block scales,
    which fp16 does not hold exactly."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    s, o = torch.rand(n, k // 32, generator=g) / 32, -torch.rand(n, k // 32, generator=g) / 4
    if half:
        s, o = s.half().float(), o.half().float()
        if q4_0:
            o = -8 * s
    else:
        s, o = s * 0.37, o * 0.11
    return (*cg.pack_q4(q, s, o), n)


def _q8(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(-127, 128, (n, k // 32, 32), dtype=torch.int8, generator=g)
    return (*cg.pack_q8(c, (torch.rand(n, k // 32, generator=g) / 64).half().float()), n)


def _kinds(n: int, k: int) -> dict[str, tuple[Callable[[torch.Tensor, object], torch.Tensor], list[object], int]]:
    """name -> (matmul(x, weight), cold copies of the weight, bytes of one)."""
    out: dict[str, tuple[Callable[[torch.Tensor, object], torch.Tensor], list[object], int]] = {}
    for name, q4 in (("Q4_0 (cpu_gemv q4)", _q4(n, k, 4, q4_0=True)), ("Q4_1 (cpu_gemv q4)", _q4(n, k, 1)),
                     ("Q4_K (cpu_gemv q4, fp32 scales)", _q4(n, k, 3, half=False))):
        q4_bytes = q4[0].numel() + q4[1].numel() * q4[1].element_size()
        out[name] = (lambda x, w: cg.q4_matmul(x, *w),
                     [q4] + [(q4[0].clone(), q4[1].clone(), n) for _ in range(_copies(q4_bytes) - 1)], q4_bytes)
    q8 = _q8(n, k, 2)
    q8_bytes = q8[0].numel() + q8[1].numel() * q8[1].element_size()
    out["Q8_0 (cpu_gemv q8)"] = (lambda x, w: cg.q8_matmul(x, *w),
                                 [q8] + [(q8[0].clone(), q8[1].clone(), n) for _ in range(_copies(q8_bytes) - 1)], q8_bytes)
    for t in TYPES:
        w = _weight(n, k, t, seed=n + k)
        nbytes = cb.resident_bytes(w)
        copies = [w] + [cb.BitsCPU(w.data.clone(), w.bits, w.group, w.k, w.form, w.has_offset)
                        for _ in range(_copies(nbytes) - 1)]
        out[f"{t.name} (cpu_bits)"] = (lambda x, w: cb.bits_matmul(x, w), copies, nbytes)  # type: ignore[arg-type]
    return out


def _dense(kind: str, w: object) -> torch.Tensor:
    if kind.startswith(("Q4_0", "Q4_1", "Q4_K")):
        return cg.q4_dequant(*w)  # type: ignore[misc]
    if kind.startswith("Q8_0 (cpu_gemv"):
        codes, scale, n = w  # type: ignore[misc]
        return cg.q8_rows(codes, scale, torch.arange(n))
    return cb.bits_dequant(w)  # type: ignore[arg-type]


def report(repeats: int = 3, min_seconds: float = 0.1, threads: int = 1, isa: cg.Isa | None = None) -> dict[str, object]:
    """`isa`: run that variant's build instead of the picked one (to compare them on one CPU)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with cg.use_isa(isa) if isa is not None else contextlib.nullcontext():
            return _report(repeats, min_seconds, threads)
    finally:
        torch.set_num_threads(previous)


def _report(repeats: int, min_seconds: float, threads: int) -> dict[str, object]:
    load0, start = os.getloadavg(), time.time()
    layers = []
    for n, k in SHAPES:
        for kind, (mm, copies, nbytes) in _kinds(n, k).items():
            g = torch.Generator().manual_seed(5)
            xs = {m: torch.randn(m, k, generator=g) for m in (*ROWS, *SGEMM_ROWS)}
            us = {m: _time([lambda w=w, x=xs[m], mm=mm: mm(x, w) for w in copies], repeats, min_seconds)[0] * 1e6
                  for m in (*ROWS, *SGEMM_ROWS)}
            sgemm = {m: _time([lambda x=xs[m], kind=kind, w=copies[0]: F.linear(cg.round_activations(x), _dense(kind, w))],
                              repeats, min_seconds)[0] * 1e6 for m in SGEMM_ROWS}
            layers.append({
                "kind": kind, "n": n, "k": k, "weight_bytes": nbytes,
                "us": {str(m): round(t, 1) for m, t in us.items()},
                "per_row_vs_one_row": {str(m): round(us[m] / m / us[1], 3) for m in ROWS},
                "dequant_sgemm_us": {str(m): round(t, 1) for m, t in sgemm.items()},
            })
    clock = "process CPU time" if threads == 1 else "wall clock"
    return {**cpu_info(), "threads": threads, "clock": clock, "weights": "cold (cycled past the last-level cache)",
            "layers": layers, "load_average_before_after": [load0[0], os.getloadavg()[0]],
            "seconds": round(time.time() - start, 1)}


if __name__ == "__main__":
    print(json.dumps(report(), indent=1))
