"""Single-stream prefill and decode of our engine against llama.cpp's own `llama-server` (bench/llama_server.py)
on the same GGUF, at the same thread count, in one run: each CPU kernel our GGUF method can use (dense
dequantised, torch's int4, the SIMD kernels), and llama-server with one slot when one is found. Ratios are
ours / llama.cpp.

Ours is timed in process (engine steps, as `bench throughput` does); llama.cpp over its HTTP stream (first
streamed token closes the prefill, the last one the decode), which costs it an SSE event per token (well
under a millisecond on loopback). Prompts are the same random token ids for both (sent to llama-server as ids),
and llama-server is asked to ignore its end-of-text token as ours is; its decode rate counts the tokens it did
stream.
The two sides run in alternating rounds, so neither gets the machine's quiet minutes alone.
"""

from __future__ import annotations

import contextlib
import gc
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import torch

from agentbox import collector
from agentbox.bench import llama_server
from agentbox.bench.cpu_rows import cpu_info
from agentbox.bench.spawn import spawned
from agentbox.bench.throughput import Rates, engine_rates, random_prompts
from agentbox.config import EngineConfig, Speculative
from agentbox.engine.llm import LLM
from agentbox.kernels import cpu_gemv
from agentbox.layers.quant import int4, resident_weight_bytes
from agentbox.models.loader import load_tokenizer, resolve_model


def _load(gguf: str, kernel: int4.Int4Kernel, threads: int, context: int = 1008) -> LLM:
    pages = max(64, -(-context // PAGE) + 2)  # the null page, and a page of slack: a prompt of `context` fits
    with int4.cpu_kernel(kernel):
        # drafts off: this compares kernels and the decode loop, and llama-server drafts nothing here either
        llm = LLM(EngineConfig(model=gguf, device="cpu", cpu_threads=threads, cache_policy="none", num_pages=pages,
                               page_size=PAGE, speculative=Speculative.OFF))
    engine_rates(llm, random_prompts(1, 8, llm.loaded.vocab_size, 0), 2)  # warm-up
    collector.after_startup()  # as the server's engine does: no collection walks the model's objects mid-decode
    return llm


PAGE = 16


def _best(runs: list[Rates]) -> dict[str, Any]:
    return {
        "prefill_tok_s": max(r.prefill_tok_s for r in runs),
        "decode_tok_s": max(r.decode_tok_s for r in runs),
        "runs": [r.as_dict() for r in runs],
    }


def _llamacpp_rates(url: str, prompt: list[int], new_tokens: int) -> Rates:
    # Token ids, not text: llama-server then computes exactly our prompt (no detokenise/retokenise drift) and
    # `cache_prompt: false` keeps a repeated prompt from being served from its slot's cache.
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0.0, "stream": True, "ignore_eos": True,
            "cache_prompt": False}
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
    return Rates(1, len(prompt), len(times), times[0] - start, times[-1] - times[0])


@contextlib.contextmanager
def _llama_server(binary: Path | None, gguf: str, n_ctx: int, threads: int) -> Iterator[str | dict[str, str]]:
    """The URL of llama-server with one slot on `gguf`, or {"skipped": why} when there is none."""
    if binary is None:
        yield {"skipped": llama_server.NOT_FOUND}
        return
    target = llama_server.target(binary, gguf, n_ctx, threads, llama_server.Slots(1))
    assert target.command is not None
    with tempfile.TemporaryDirectory() as tmp, spawned(target.command, Path(tmp) / "llama-server.log",
                                                       target.ready_paths) as (url, _):
        _llamacpp_rates(url, list(range(100, 108)), 2)  # warm-up
        yield url


def compare_llamacpp(gguf: str, prompt_len: int = 128, new_tokens: int = 64, threads: int = 1, repeats: int = 2,
                     default_only: bool = False, binary: Path | None = None) -> dict[str, Any]:
    """Rounds of one request per engine, interleaved (ours with each kernel, or only the default one, then
    llama.cpp, `repeats` times), so a shared machine's slow minute falls on both sides; each side keeps its
    fastest run."""
    binary = binary or llama_server.find_binary()
    src = resolve_model(gguf)
    if src.kind != "gguf":
        raise ValueError(f"{gguf!r} is not a GGUF file: the llama.cpp comparison needs one")
    tokenizer = load_tokenizer(src)
    prompts = random_prompts(repeats, prompt_len, len(tokenizer), seed=3)
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
        engines = {k: _load(gguf, k, threads, prompt_len + new_tokens) for k in kernels}
        resident = {k: resident_weight_bytes(llm.loaded.model) for k, llm in engines.items()}
        with _llama_server(binary, gguf, prompt_len + new_tokens + 64, threads) as server:
            for prompt in prompts:
                for k, llm in engines.items():
                    ours[k].append(engine_rates(llm, [prompt], new_tokens))
                if isinstance(server, str):
                    theirs.append(_llamacpp_rates(server, prompt, new_tokens))
        del engines
        gc.collect()
    finally:
        torch.set_num_threads(previous)
    report["ours"] = {k.value: {"resident_weight_bytes": resident[k], **_best(runs)} for k, runs in ours.items()}
    report["llama.cpp"] = _best(theirs) if theirs else server
    theirs_build = llama_server.build_info(binary) if binary is not None else {"skipped": llama_server.NOT_FOUND}
    report["cpu"] = {"ours": cpu_info(), "llama.cpp": {"cpu_model": cpu_info()["cpu_model"], **theirs_build}}
    if theirs:
        report["ratios"] = {
            f"{phase}_{kernel}": side[f"{phase}_tok_s"] / report["llama.cpp"][f"{phase}_tok_s"]
            for kernel, side in report["ours"].items() for phase in ("prefill", "decode")
        }
    return report
