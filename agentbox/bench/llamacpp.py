"""Single-stream prefill and decode of our engine against llama.cpp's server on the same GGUF, at the same
thread count, in one run: each CPU kernel our GGUF method can use (dense dequantised, torch's int4), and
llama.cpp (llama-cpp-python's server) when it is installed. Ratios are ours / llama.cpp.

Ours is timed in process (engine steps, as `bench throughput` does); llama.cpp over its HTTP stream (first
streamed token closes the prefill, the last one the decode), which costs it an SSE event per token (well
under a millisecond on loopback). Prompts are the same random token ids for both, detokenised for
llama.cpp; its server does not honour ignore_eos, so its decode rate counts the tokens it did stream.
The two sides run in alternating rounds, so neither gets the machine's quiet minutes alone.
"""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

from agentbox.bench.cpu_rows import cpu_info
from agentbox.bench.spawn import llamacpp_target, spawned
from agentbox.bench.throughput import Rates, engine_rates, random_prompts
from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.kernels import cpu_gemv
from agentbox.layers.quant import int4, resident_weight_bytes
from agentbox.models.loader import load_tokenizer, resolve_model


def _load(gguf: str, kernel: int4.Int4Kernel, threads: int) -> LLM:
    with int4.cpu_kernel(kernel):
        llm = LLM(EngineConfig(model=gguf, device="cpu", cpu_threads=threads, cache_policy="none", num_pages=64))
    engine_rates(llm, random_prompts(1, 8, llm.loaded.vocab_size, 0), 2)  # warm-up
    return llm


def _best(runs: list[Rates]) -> dict[str, Any]:
    return {
        "prefill_tok_s": max(r.prefill_tok_s for r in runs),
        "decode_tok_s": max(r.decode_tok_s for r in runs),
        "runs": [r.as_dict() for r in runs],
    }


def _llamacpp_rates(url: str, text: str, prompt_len: int, new_tokens: int) -> Rates:
    body = {"prompt": text, "max_tokens": new_tokens, "temperature": 0.0, "stream": True}
    times: list[float] = []
    start = time.perf_counter()
    with httpx.Client(timeout=600.0) as client, client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"llama.cpp streamed {len(times)} tokens")
    return Rates(1, prompt_len, len(times), times[0] - start, times[-1] - times[0])


def llamacpp_build() -> dict[str, Any]:
    """The instruction sets llama.cpp's library was built with (its own system-info line), asked of the
    Python the server runs under: which dot products its side of the comparison uses."""
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    if done.returncode != 0:
        return {"skipped": (done.stderr.strip().splitlines() or ["llama_cpp is not importable"])[-1]}
    line = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    fields = [f.strip().rsplit(" = ", 1) for f in line.replace("CPU :", "").split("|") if " = " in f]
    return {"system_info": line, "isa_flags": [name.strip() for name, on in fields if on.strip() == "1"]}


@contextlib.contextmanager
def _llamacpp_server(gguf: str, n_ctx: int, threads: int) -> Iterator[str | dict[str, str]]:
    """The server's URL, or {"skipped": why} when llama-cpp-python is not installed."""
    target = llamacpp_target(gguf, n_ctx=n_ctx)
    if target.command is None:
        yield {"skipped": target.note}
        return
    cmd = [*target.command, "--n_threads", str(threads), "--n_threads_batch", str(threads)]
    with tempfile.TemporaryDirectory() as tmp, spawned(cmd, Path(tmp) / "llama.cpp.log", target.ready_paths) as (url, _):
        _llamacpp_rates(url, "Hello, world. " * 4, 8, 2)  # warm-up
        yield url


def compare_llamacpp(gguf: str, prompt_len: int = 128, new_tokens: int = 64, threads: int = 1, repeats: int = 2,
                     default_only: bool = False) -> dict[str, Any]:
    """Rounds of one request per engine, interleaved (ours with each kernel, or only the default one, then
    llama.cpp, `repeats` times), so a shared machine's slow minute falls on both sides; each side keeps its
    fastest run."""
    src = resolve_model(gguf)
    if src.kind != "gguf":
        raise ValueError(f"{gguf!r} is not a GGUF file: the llama.cpp comparison needs one")
    tokenizer = load_tokenizer(src)
    prompts = random_prompts(repeats, prompt_len, len(tokenizer), seed=3)
    texts = [tokenizer.decode(p) for p in prompts]
    previous = torch.get_num_threads()
    report: dict[str, Any] = {"model": gguf, "threads": threads, "prompt_len": prompt_len, "new_tokens": new_tokens,
                              "repeats": repeats, "avx512_bf16": int4.cpu_has_avx512_bf16(),
                              "default_kernel": int4.default_cpu_kernel().value}
    kernels = [int4.Int4Kernel.DENSE, int4.Int4Kernel.INT4_CPU]
    if cpu_gemv.available():
        kernels.append(int4.Int4Kernel.CPU_SIMD)
    if default_only:
        kernels = [int4.default_cpu_kernel()]
    ours: dict[int4.Int4Kernel, list[Rates]] = {k: [] for k in kernels}
    theirs: list[Rates] = []
    resident: dict[int4.Int4Kernel, int] = {}
    try:
        engines = {k: _load(gguf, k, threads) for k in kernels}
        resident = {k: resident_weight_bytes(llm.loaded.model) for k, llm in engines.items()}
        with _llamacpp_server(gguf, prompt_len + new_tokens + 64, threads) as server:
            for prompt, text in zip(prompts, texts, strict=True):
                for k, llm in engines.items():
                    ours[k].append(engine_rates(llm, [prompt], new_tokens))
                if isinstance(server, str):
                    theirs.append(_llamacpp_rates(server, text, prompt_len, new_tokens))
        del engines
        gc.collect()
    finally:
        torch.set_num_threads(previous)
    report["ours"] = {k.value: {"resident_weight_bytes": resident[k], **_best(runs)} for k, runs in ours.items()}
    report["llama.cpp"] = _best(theirs) if theirs else server
    report["cpu"] = {"ours": cpu_info(), "llama.cpp": {"cpu_model": cpu_info()["cpu_model"], **llamacpp_build()}}
    if theirs:
        report["ratios"] = {
            f"{phase}_{kernel}": side[f"{phase}_tok_s"] / report["llama.cpp"][f"{phase}_tok_s"]
            for kernel, side in report["ours"].items() for phase in ("prefill", "decode")
        }
    return report
