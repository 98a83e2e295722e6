"""Host time per decode step: scheduling plus input preparation (Requests -> StepInputs -> the packed
buffer a tp worker receives), the model excluded. It must not grow with context: a step's work is its new
tokens and new pages, never a request's whole token list or page list. Measured at two context lengths and
two batch sizes on a tiny random model, with the pre-split runner's per-step work (prompt + output
concatenated, page table rebuilt from Python lists) as the baseline in the same run.

Also the whole decode step (schedule, prepare, model, sample) of the torch attention backend at 512, 4k and
8k tokens of context, batch 1, on a small random Llama, with the backend's gather path (every layer copies
the history out of the pages) as the baseline against its view path (attention over a slice of the cache)
in the same run, steps of the two interleaved so that load on the machine hits both alike."""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers import LlamaConfig

from agentbox.bench.throughput import random_model
from agentbox.config import CPU_PAGE_SIZE, EngineConfig
from agentbox.engine.core import EngineCore
from agentbox.engine.request import Request, Status
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.scheduler import SchedulerOutput
from agentbox.layers.backends.torch_backend import TorchAttention


def _tiny(max_len: int) -> LlamaConfig:
    return LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=1, num_key_value_heads=1, vocab_size=128, max_position_embeddings=max_len)


def legacy_prepare(out: SchedulerOutput, page_size: int) -> torch.Tensor:
    """The runner's per-step host work before the split, for the baseline: every token list concatenated,
    the page table rebuilt from Python lists."""
    ids: list[int] = []
    slots: list[int] = []
    for s in out.seqs:
        r = s.request
        toks = r.prompt_token_ids + r.output_token_ids
        start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
        ids.extend(toks[start:end])
        pages = _pages(r)
        slots.extend(pages[p // page_size] * page_size + p % page_size for p in range(start, end))
    table = torch.zeros((len(out.seqs), max(len(_pages(s.request)) for s in out.seqs)), dtype=torch.int32)
    for i, s in enumerate(out.seqs):
        table[i, : len(_pages(s.request))] = torch.tensor(_pages(s.request), dtype=torch.int32)
    return table


def _pages(r: Request) -> list[int]:
    assert r.cache_handle is not None
    return r.cache_handle.pages


def _small(max_len: int) -> LlamaConfig:
    """Small but shaped like a real model: GQA (4 query heads on 2 kv heads), head_dim 64, 4 layers."""
    return LlamaConfig(architectures=["LlamaForCausalLM"], hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, max_position_embeddings=max_len)


def _decoding(core: EngineCore, batch: int, context: int) -> list[Request]:
    """`batch` requests as if their `context`-token prompts were prefilled: pages held, running."""
    ps = core.runner.page_size
    reqs = []
    for i in range(batch):
        params = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
        r = Request(f"bench-{i}", [(i + j) % 100 + 1 for j in range(context)], params)
        lock = core.cache.lock(core.cache.match([]), r.all_token_ids)  # nothing cached: a row, no pages yet
        if not core.cache.grow(lock.handle, -(-(context + 1) // ps) * ps):
            raise RuntimeError("the bench's pool is too small")
        r.cache_handle = lock.handle
        r.num_computed_tokens = context - 1
        r.status = Status.RUNNING
        core.scheduler.running.append(r)
        core.scheduler.requests[r.request_id] = r
        reqs.append(r)
    return reqs


def host_step_us(batch: int, context: int, steps: int = 200) -> dict[str, float]:
    """Median microseconds per decode step of schedule + prepare + pack, and of the legacy preparation."""
    ps = CPU_PAGE_SIZE
    pages = batch * (-(-(context + 2 * steps + 2) // ps) + 1) + 8
    config = EngineConfig(model="random", device="cpu", dtype="float32", cache_policy="none", num_pages=pages,
                          max_num_seqs=batch, max_num_batched_tokens=max(batch, 64), cpu_threads=1)
    core = EngineCore(config, random_model(_tiny(context + 2 * steps + 64), torch.float32, "cpu"))
    reqs = _decoding(core, batch, context)
    # Two passes, not interleaved: the legacy preparation walks every token of every request (a million at
    # batch 32 x 32k), which evicts the CPU caches and made our own step look 1.6x slower at 32k than alone.
    ours: list[float] = []
    legacy: list[float] = []
    for timed in (ours, legacy):
        for _ in range(steps):
            t0 = time.perf_counter()
            out = core.scheduler.schedule()
            if timed is ours:
                nbytes = len(core.runner.prepare(out).pack())
            t1 = time.perf_counter()
            if timed is legacy:
                legacy_prepare(out, ps)
            timed.append(time.perf_counter() - t0 if timed is ours else time.perf_counter() - t1)
            for s in out.seqs:  # what the core does after the model, minus sampling: one more token each
                s.request.num_computed_tokens += s.num_new_tokens
                s.request.append_output(7)
    assert len(out.seqs) == len(reqs)
    ours.sort()
    legacy.sort()
    return {"host_us": round(1e6 * ours[steps // 2], 1), "legacy_prepare_us": round(1e6 * legacy[steps // 2], 1),
            "step_bytes": nbytes}  # what a tp worker receives per decode step


def step_report(contexts: tuple[int, int] = (1024, 32768), batches: tuple[int, ...] = (1, 32)) -> dict[str, Any]:
    short, long = contexts
    report: dict[str, Any] = {"what": "host time per decode step (schedule + prepare + pack), model excluded"}
    for b in batches:
        a, z = host_step_us(b, short), host_step_us(b, long)
        report[f"batch_{b}"] = {
            f"ctx_{short}": a, f"ctx_{long}": z,
            "ratio_long_over_short": round(z["host_us"] / a["host_us"], 3),
            "legacy_ratio_long_over_short": round(z["legacy_prepare_us"] / a["legacy_prepare_us"], 3),
        }
    return report


def decode_step_ms(context: int, steps: int = 12) -> dict[str, float]:
    """Median milliseconds of a whole batch-1 decode step (core.step) at `context` tokens, torch backend's
    view path and gather path alternating step by step on the same engine."""
    ps = CPU_PAGE_SIZE
    config = EngineConfig(model="random", device="cpu", dtype="float32", cache_policy="none",
                          num_pages=-(-(context + 2 * steps + 8) // ps) + 4, max_num_seqs=1, attention="torch",
                          cpu_threads=1)
    core = EngineCore(config, random_model(_small(context + 2 * steps + 64), torch.float32, "cpu"))
    backend = core.runner.backend
    assert isinstance(backend, TorchAttention)
    backend.use_cpu_kernel = False  # this report is the view path against the gather
    _decoding(core, 1, context)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * steps + 2):
        backend.use_views = i % 2 == 0
        t0 = time.perf_counter()
        core.step()
        if i >= 2:  # the first two steps warm both paths up
            times[backend.use_views].append(time.perf_counter() - t0)
        if backend.use_views and backend.bases is None:
            raise RuntimeError(f"the view path did not run at {context} tokens (pages not consecutive?)")
    view, gather = (sorted(times[k])[steps // 2] * 1e3 for k in (True, False))
    return {"view_ms": round(view, 2), "gather_ms": round(gather, 2), "gather_over_view": round(gather / view, 2)}


def decode_report(contexts: tuple[int, ...] = (512, 4096, 8192)) -> dict[str, Any]:
    report: dict[str, Any] = {
        "what": "decode step time, torch attention backend, batch 1, 4-layer random Llama (256 hidden, 4 heads on "
                "2 kv heads x 64), fp32, 1 CPU thread: view path (no copy of the history) vs gather path",
    }
    for c in contexts:
        report[f"ctx_{c}"] = decode_step_ms(c)
    return report
