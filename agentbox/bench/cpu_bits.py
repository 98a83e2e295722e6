"""Decode speed of the k-bit CPU kernels (kernels/cpu_bits.c): one JSON object (`python -m
agentbox.bench.cpu_bits`).

Per GGUF type (Q5_0, Q5_1, Q8_0, Q5_K, Q6_K, Q2_K, Q3_K) and layer shape (SmolLM2's 576 -> 1536 and 1536 -> 576), at
one token: time per call of `bits_matmul` against the dense fp32 `F.linear` of its dequantised weight and
against the 4-bit kernel (cpu_gemv's q4, Q4_1's 5 bits a weight) on the same shape, and the weight bytes
read per second, against a plain streaming read (`torch.sum` of a large fp32 tensor) in the same run.
Decode reads every layer once per token and a model's layers do not fit the last-level cache, so each
variant cycles through enough copies of its layer to exceed it (`cold`); `hot` repeats one copy. Times are
the minimum over repeats (the machine is shared: the minimum is the quiet moment) with the median beside
it. `rows` times the kernel against dequantise + sgemm at M rows, for the layer's rows threshold.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agentbox.kernels import cpu_bits as cb
from agentbox.kernels import cpu_gemv as cg

LLC_BYTES = 64 << 20  # cycle through at least this much: twice this machine's 32 MiB L3


@dataclass(frozen=True)
class BitsType:
    name: str
    bits: int
    group: int
    offset: bool
    form: cb.ScaleForm
    file_bits: float  # the GGUF type's bits per weight


TYPES = (
    BitsType("Q5_0", 5, 32, False, cb.ScaleForm.F16, 5.5),
    BitsType("Q5_1", 5, 32, True, cb.ScaleForm.F16, 6.0),
    BitsType("Q8_0", 8, 32, False, cb.ScaleForm.F16, 8.5),
    BitsType("Q5_K", 5, 32, True, cb.ScaleForm.I8, 5.5),
    BitsType("Q6_K", 6, 16, False, cb.ScaleForm.I8, 6.5625),
    BitsType("Q2_K", 2, 16, True, cb.ScaleForm.U4, 2.625),
    BitsType("Q3_K", 3, 16, False, cb.ScaleForm.I8, 3.4375),
)
SHAPES = ((1536, 576), (576, 1536))  # (N out, K in): gate/up and down of SmolLM2-135M


def _scales(n: int, k: int, t: BitsType, g: torch.Generator) -> torch.Tensor:
    if t.form in (cb.ScaleForm.I8, cb.ScaleForm.U4):  # a record's fp16 super-scale times 6-bit (Q2_K: 4-bit)
        parts = []  # multiples, as the K-quants
        top = 15 if t.form is cb.ScaleForm.U4 else 63
        for _, recs, p in cb._chunks(k):
            d = torch.rand(n, recs, 1, generator=g).half().float() / 64
            c = torch.randint(0, top + 1, (n, recs, p * 32 // t.group), generator=g)
            c[..., 0] = top  # llama.cpp's quantisers scale the largest sub-scale to the top of its range
            parts.append((d * c).reshape(n, -1))
        return torch.cat(parts, dim=1)
    return (torch.rand(n, k // t.group, generator=g) / 32).half().float()


def _weight(n: int, k: int, t: BitsType, seed: int) -> cb.BitsCPU:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << t.bits, (n, k), dtype=torch.uint8, generator=g)
    offset = -_scales(n, k, t, g) if t.offset else None
    return cb.pack_bits_cpu(codes, t.bits, _scales(n, k, t, g), offset, t.form)


def _copies(nbytes: int) -> int:
    return max(1, -(-LLC_BYTES // nbytes))


def _time(calls: list[Callable[[], object]], repeats: int, min_seconds: float) -> tuple[float, float]:
    """(min, median) seconds per call over `repeats` rounds, each cycling `calls` for >= min_seconds."""
    for f in calls:
        f()
    per: list[float] = []
    for _ in range(repeats):
        done, start = 0, time.perf_counter()
        while True:
            for f in calls:
                f()
            done += len(calls)
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        per.append(elapsed / done)
    return min(per), statistics.median(per)


def _stream_bytes_per_s(repeats: int) -> float:
    big = torch.ones(64 << 20)  # 256 MiB of fp32: far past any cache
    best, _ = _time([lambda: big.sum()], repeats, 0.3)
    return big.numel() * 4 / best


def layer(t: BitsType, n: int, k: int, repeats: int, min_seconds: float) -> dict[str, object]:
    w = _weight(n, k, t, seed=n + k)
    nbytes = cb.resident_bytes(w)
    weights = [w] + [cb.BitsCPU(w.data.clone(), w.bits, w.group, w.k, w.form, w.has_offset)
                     for _ in range(_copies(nbytes) - 1)]
    dense = cb.bits_dequant(w)
    denses = [dense] + [dense.clone() for _ in range(_copies(dense.numel() * 4) - 1)]
    g = torch.Generator().manual_seed(1)
    q4 = cg.pack_q4(torch.randint(0, 16, (n, k), generator=g), (torch.rand(n, k // 32, generator=g) / 32).half().float(),
                    (torch.randn(n, k // 32, generator=g) / 32).half().float())
    q4_bytes = sum(x.numel() * x.element_size() for x in q4)
    q4s = [q4] + [tuple(x.clone() for x in q4) for _ in range(_copies(q4_bytes) - 1)]
    x = torch.randn(1, k)
    out: dict[str, object] = {"type": t.name, "n": n, "k": k, "form": w.form.name,
                              "bits_per_weight": round(8 * nbytes / (n * k), 4), "file_bits_per_weight": t.file_bits}
    for where, ws, ds, qs in (("cold", weights, denses, q4s), ("hot", weights[:1], denses[:1], q4s[:1])):
        kb = _time([lambda v=v: cb.bits_matmul(x, v) for v in ws], repeats, min_seconds)
        fd = _time([lambda v=v: F.linear(x, v) for v in ds], repeats, min_seconds)
        q = _time([lambda v=v: cg.q4_matmul(x, *v, n) for v in qs], repeats, min_seconds)
        out[where] = {
            "bits_us": round(kb[0] * 1e6, 1), "bits_us_median": round(kb[1] * 1e6, 1),
            "dense_fp32_us": round(fd[0] * 1e6, 1), "q4_us": round(q[0] * 1e6, 1),
            "vs_dense": round(fd[0] / kb[0], 2), "vs_q4": round(q[0] / kb[0], 2),
            "bits_gb_per_s": round(nbytes / kb[0] / 1e9, 2), "dense_gb_per_s": round(dense.numel() * 4 / fd[0] / 1e9, 2),
            "q4_gb_per_s": round(q4_bytes / q[0] / 1e9, 2),
        }
    return out


def rows_threshold(t: BitsType, n: int, k: int, repeats: int, min_seconds: float) -> list[dict[str, object]]:
    """Kernel vs dequantise + sgemm on the rounded rows, at M rows (one copy: prefill re-reads the layer)."""
    w = _weight(n, k, t, seed=7)
    res = []
    for m in (1, 4, 8, 16, 32, 64):
        x = torch.randn(m, k)
        kb = _time([lambda x=x: cb.bits_matmul(x, w)], repeats, min_seconds)[0]
        dq = _time([lambda x=x: F.linear(cg.round_activations(x), cb.bits_dequant(w))], repeats, min_seconds)[0]
        res.append({"m": m, "kernel_us": round(kb * 1e6, 1), "dequant_sgemm_us": round(dq * 1e6, 1)})
    return res


def report(repeats: int = 5, min_seconds: float = 0.2, threads: int = 1) -> dict[str, object]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        load0, start = os.getloadavg(), time.time()
        stream = _stream_bytes_per_s(repeats)
        layers = [layer(t, n, k, repeats, min_seconds) for t in TYPES for n, k in SHAPES]
        rows = {t.name: rows_threshold(t, 1536, 576, repeats, min_seconds) for t in (TYPES[0], TYPES[4])}
        return {"threads": threads, "stream_read_gb_per_s": round(stream / 1e9, 2), "layers": layers,
                "rows_threshold_1536x576": rows, "load_average_before_after": [load0[0], os.getloadavg()[0]],
                "seconds": round(time.time() - start, 1)}
    finally:
        torch.set_num_threads(previous)


if __name__ == "__main__":
    print(json.dumps(report(), indent=1))
