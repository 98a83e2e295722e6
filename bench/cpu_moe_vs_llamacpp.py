"""Prefill and decode of one MoE GGUF on the CPU: agentbox's CPU experts (`--cpu-moe`; on a CPU-only machine the
whole model is on the CPU) against llama.cpp's own `llama-server`, same file, same threads, in one run (issue 44).

Ours runs in process through the engine core (as `agentbox bench throughput` does: prefill = prompt tokens / time
to the first token, decode = the tokens after it / their time); llama.cpp's numbers are its own `timings` of a
/completion request (prompt_per_second, predicted_per_second: inside its server, no HTTP in them, which can only
favour it). Prompts are token ids (the files of bench/qwen3_30b_a3b_gguf.py have a synthetic vocabulary), the
prompt cache is off on both sides, drafts are off, and the two alternate `--repeats` times so a loaded machine's
slow minute falls on both; each side keeps its best.

    python bench/cpu_moe_vs_llamacpp.py /tmp/q30b-q8_0.gguf --llama-server ~/llama.cpp/build/bin/llama-server \\
        --threads 2 --prompt 2048 --new-tokens 32 > result.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VOCAB_FLOOR = 259  # the synthetic vocabulary's <unk>, <s>, </s> and byte tokens: prompts use the pieces after them


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_FLOOR, vocab) for _ in range(n)]


def ours(gguf: str, threads: int, prompt: list[int], new_tokens: int) -> dict[str, Any]:
    from agentbox.bench.throughput import engine_rates
    from agentbox.config import CPU_PAGE_SIZE, EngineConfig
    from agentbox.engine.llm import LLM
    from agentbox.engine.stats import to_json

    config = EngineConfig(
        model=gguf, cpu_threads=threads, cpu_moe=True, speculative="off", cache_policy="none", max_num_seqs=1,
        max_num_batched_tokens=len(prompt), num_pages=-(-(len(prompt) + new_tokens) // CPU_PAGE_SIZE) + 4,
    )
    t0 = time.perf_counter()
    llm = LLM(config)
    load_s = time.perf_counter() - t0
    engine_rates(llm, [prompt[:16]], 4)  # warm-up
    return {"llm": llm, "load_s": load_s, "stats": lambda: to_json(llm.core.stats())["experts"]}


def ours_rates(side: dict[str, Any], prompt: list[int], new_tokens: int) -> dict[str, float]:
    from agentbox.bench.throughput import engine_rates

    r = engine_rates(side["llm"], [prompt], new_tokens)
    return {"prefill_tok_s": r.prefill_tok_s, "decode_tok_s": r.decode_tok_s}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def llama_server(binary: str, gguf: str, threads: int, ctx: int, log: Path,
                 extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    cmd = [binary, "-m", gguf, "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-np", "1",
           "--host", "127.0.0.1", "--port", str(port), "-b", "2048", "-ub", "512", *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("llama-server did not come up in 600 s")


def theirs_rates(url: str, prompt: list[int], new_tokens: int) -> dict[str, float]:
    import httpx

    body = {"prompt": prompt, "n_predict": new_tokens, "cache_prompt": False, "ignore_eos": True,
            "temperature": 0.0, "top_k": 1, "stream": False}
    r = httpx.post(f"{url}/completion", json=body, timeout=1800)
    r.raise_for_status()
    t = r.json()["timings"]
    if t.get("prompt_n") != len(prompt):
        raise RuntimeError(f"llama-server computed {t.get('prompt_n')} prompt tokens of {len(prompt)}")
    return {"prefill_tok_s": t["prompt_per_second"], "decode_tok_s": t["predicted_per_second"],
            "predicted_n": t["predicted_n"]}


def _best(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: max(r[k] for r in runs) for k in ("prefill_tok_s", "decode_tok_s")} | {"runs": runs}  # type: ignore[dict-item]


def cpu() -> dict[str, Any]:
    from agentbox.bench.cpu_rows import cpu_info
    from agentbox.kernels import cpu_gemv

    flags = set()
    try:
        flags = set(next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                         if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        pass
    isa = sorted(f for f in flags if f.startswith(("avx2", "avx512", "amx")) or f in ("fma", "f16c"))
    return {**cpu_info(), "isa_flags": isa, "agentbox_kernels": cpu_gemv.describe(), "cores": os.cpu_count()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json-out", help="also write the JSON here")
    ap.add_argument("--llama-arg", action="append", default=[],
                    help="one more llama-server argument (repeatable), e.g. --llama-arg=--no-repack where its AMX "
                         "Q8_0 kernel stops on SIGILL (llama.cpp of llama-cpp-python 0.3.36 on a Xeon with AMX)")
    args = ap.parse_args()
    from gguf import GGUFReader

    vocab = len(GGUFReader(args.gguf).fields["tokenizer.ggml.tokens"].data)
    prompts = [_prompt(args.prompt, vocab, seed) for seed in range(args.repeats)]
    mine = ours(args.gguf, args.threads, prompts[0], args.new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = llama_server(args.llama_server, args.gguf, args.threads, args.prompt + args.new_tokens + 64,
                                 Path(tmp) / "llama-server.log", args.llama_arg)
        try:
            theirs_rates(url, prompts[0][:16], 4)  # warm-up
            a, b = [], []
            for p in prompts:  # alternating: a slow minute falls on both sides
                a.append(ours_rates(mine, p, args.new_tokens))
                b.append(theirs_rates(url, p, args.new_tokens))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    us, them = _best(a), _best(b)
    report = {
        "gguf": args.gguf, "threads": args.threads, "prompt_tokens": args.prompt, "new_tokens": args.new_tokens,
        "agentbox": {**us, "load_s": mine["load_s"], "experts": mine["stats"]()},
        "llama.cpp llama-server": {**them, "extra_args": args.llama_arg},
        "ratio_prefill": us["prefill_tok_s"] / them["prefill_tok_s"],
        "ratio_decode": us["decode_tok_s"] / them["decode_tok_s"],
        "cpu": cpu(),
    }
    json.dump(report, sys.stdout, indent=2)
    print()
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
