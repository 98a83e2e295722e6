"""Cold chunked prefill at long context on SmolLM2-shaped layers (random weights): tokens/s at 2k against 32k.

Chunked prefill attends each chunk's queries over the whole cached prefix. Done right, a chunk costs
chunk x context attention work plus its linear layers; a backend that copies the prefix out of the pages
for every chunk and layer (the torch backend's gather path) adds context x context / chunk copies on top.

The arithmetic bound, stated so the ratio can be read: per token and layer, SmolLM2's linear layers are
~7.1 MFLOP, its attention 4 x heads x head_dim x position FLOP (2 x 9 x 64 x 2 = 2304 per position), so a
32k prefill (mean position 16k) needs ~4.7x the work per token of a 2k one (mean 1k): at equal FLOP rates
tokens/s at 32k can be at most ~21 % of 2k's. `flop_rate_ratio` compares the FLOP/s actually reached, which
is what the backend decides.

The rates are not equal on CPUs with AMX (amx_tile + amx_bf16): prefill chunks' attention runs on the tiles
(kernels/cpu_attention_amx.c, split-bf16 products) at ~320-380 GFLOP/s of one core on a 1024-token chunk over
32k keys, 2.7x the fp32 kernel's ~120, while the linear layers stay fp32 (~120-170 GFLOP/s). On the Xeon of
bench/results/warm/README.md that takes the one-thread ratio from ~0.21 to 0.33-0.42. As `agentbox serve` runs
(`engine_threads`: on that 2-core VM the linear layers on one core, a long step's attention on both), 0.51-0.59.
Elsewhere, and with --exact-cpu, the fp32 kernel and the ~21 % bound stand.
"""

from __future__ import annotations

import os
import time
from typing import Any

# SmolLM2-135M's layer shape: hidden 576, 9 query heads on 3 kv heads of 64, MLP 1536.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 576, 9, 3, 64, 1536


def _flop_per_token(position: float) -> float:
    linear = 2 * (2 * HIDDEN * HEADS * HEAD_DIM + 2 * HIDDEN * KV_HEADS * HEAD_DIM + 3 * HIDDEN * MLP)
    return linear + 4 * HEADS * HEAD_DIM * position


def prefill_seconds(tokens: int, layers: int, chunk: int, use_views: bool = True,
                    threads: int | None = 1) -> float:
    """Seconds from adding a `tokens`-long prompt to its first token, in-process engine. `threads`: the engine's
    cpu_threads (None: its own choice, as `agentbox serve` runs; see ENGINE_THREADS)."""
    import torch
    from transformers import LlamaConfig

    from agentbox.bench.throughput import random_model
    from agentbox.config import CPU_PAGE_SIZE, EngineConfig
    from agentbox.engine.core import EngineCore
    from agentbox.engine.ipc.messages import AddRequest
    from agentbox.engine.sampling import SamplingParams
    from agentbox.layers.backends.torch_backend import TorchAttention

    cfg = LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=1024, hidden_size=HIDDEN, intermediate_size=MLP, num_hidden_layers=layers,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=tokens + 64, tie_word_embeddings=True)
    config = EngineConfig(model="random", device="cpu", dtype="float32", num_pages=tokens // CPU_PAGE_SIZE + 64,
                          max_num_batched_tokens=chunk, cache_policy="none", cpu_threads=threads, attention="torch")
    torch_threads = torch.get_num_threads()  # the engine sets the process's; given back after
    core = EngineCore(config, random_model(cfg, torch.float32, "cpu"))
    previous = TorchAttention.use_views
    TorchAttention.use_views = use_views
    try:
        prompt = [(7 * i) % 1000 + 1 for i in range(tokens)]
        t0 = time.perf_counter()
        core.add(AddRequest("p", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)))
        while not any(o.new_token_ids for o in core.step()):
            pass
        return time.perf_counter() - t0
    finally:
        TorchAttention.use_views = previous
        core.close()
        torch.set_num_threads(torch_threads)


def _rates(best: dict[int, float], layers: int) -> dict[str, Any]:
    short, long = sorted(best)
    out: dict[str, Any] = {}
    for n, s in best.items():
        flops = layers * sum(_flop_per_token(p) for p in range(0, n, 64)) * 64
        out[f"ctx_{n}"] = {"seconds": round(s, 3), "tok_s": round(n / s, 1), "gflop_s": round(flops / s / 1e9, 2)}
    out["tok_s_ratio_long_over_short"] = round(best[short] * long / (best[long] * short), 3)
    out["flop_rate_ratio_long_over_short"] = round(out[f"ctx_{long}"]["gflop_s"] / out[f"ctx_{short}"]["gflop_s"], 3)
    return out


def prefill_report(short: int = 2048, long: int = 32768, layers: int = 1, chunk: int = 1024,
                   repeats: int = 3) -> dict[str, Any]:
    """Both lengths under two thread settings, each length's best of `repeats` runs taken in alternation, after
    one unmeasured run of each setting: the process's first prefill builds and loads the attention kernels
    (~1.2 s), which counted against the 2k run and put its ratio at 4.5 instead of 0.48 here.

    `engine_threads` is the engine as `agentbox serve` runs it (cpu_threads unset): every core while no other
    process keeps them busy, all but one otherwise (engine/exec/cpu_threads.py).
    `one_thread` pins both to one core: the kernels' own rates, the ratio the tiles alone reach."""
    settings = {"engine_threads": None, "one_thread": 1}
    out: dict[str, Any] = {"what": f"cold chunked prefill, {layers} SmolLM2-shaped layers, chunk {chunk}, "
                                   f"best of {repeats}", "cpus": os.cpu_count()}
    for threads in settings.values():
        prefill_seconds(short, layers, chunk, threads=threads)
    best = {name: {short: float("inf"), long: float("inf")} for name in settings}
    for _ in range(repeats):
        for name, threads in settings.items():
            for n in (short, long):
                best[name][n] = min(best[name][n], prefill_seconds(n, layers, chunk, threads=threads))
    for name in settings:
        out[name] = _rates(best[name], layers)
    out["tok_s_ratio_bound_by_arithmetic"] = round(_flop_per_token(short / 2) / _flop_per_token(long / 2), 3)
    return out
