"""GPU decode speed per attention backend, with CUDA graphs off and on, against transformers' generate in the
same process, on a random-weight model of Qwen3-8B's shape (bf16, built in place: no download), and how close
batch-1 decode comes to the card's memory-bandwidth ceiling.

Decode at batch 1 is memory bound: every token reads every weight once, so the fastest possible time per token
is weight bytes / memory bandwidth (Qwen3-8B bf16: 16.4 GB; an H200's 4.8 TB/s gives 3.4 ms). We report
weight bytes per token / measured time per token / bandwidth, against the card's published bandwidth (where
the card is in BANDWIDTH) and against the copy bandwidth measured here (a device-to-device copy, read + write).

`python -m agentbox.bench.gpu_decode` prints one JSON object (scripts/gpu_check.sh's `gpu_decode` block).
Imports only torch, transformers and the engine, like bench/throughput.py, whose timing helpers it reuses.
"""

from __future__ import annotations

import gc
import json
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from agentbox.bench.throughput import (
    engine_rates,
    qwen3_8b_config,
    random_model,
    random_prompts,
    transformers_rates,
)
from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.layers.backends import ATTENTION_BACKENDS
from agentbox.models.loader import LoadedModel

# Published memory bandwidth, bytes/s, by a substring of torch.cuda.get_device_name().
BANDWIDTH = {
    "H200": 4.8e12,
    "H100 NVL": 3.9e12,
    "H100 SXM": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H100": 3.35e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100": 1.555e12,
    "L40S": 0.864e12,
    "RTX 4090": 1.008e12,
    "RTX 3090": 0.936e12,
}
BATCHES = (1, 32)
PROMPT_LEN = 128
NEW_TOKENS = 64


def published_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in BANDWIDTH.items() if key in name), None)


def copy_bandwidth(nbytes: int = 4 << 30, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy: the ceiling a kernel can reach here."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del src, dst
    return 2 * nbytes * repeats / elapsed


def weight_bytes(model: torch.nn.Module) -> int:
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


def engine_decode(loaded: LoadedModel, attention: str, enforce_eager: bool) -> dict[str, Any]:
    pages = max(BATCHES) * -(-(PROMPT_LEN + NEW_TOKENS) // EngineConfig.page_size) + 8
    config = EngineConfig(
        device="cuda", dtype="bfloat16", attention=attention, enforce_eager=enforce_eager, num_pages=pages,
        max_num_seqs=max(BATCHES), cache_policy="none",
    )
    t0 = time.perf_counter()
    llm = LLM(config, loaded=loaded)
    torch.cuda.synchronize()
    out: dict[str, Any] = {
        "attention_backend": llm.core.runner.backend.name,
        "cuda_graphs": llm.core.runner.graphs is not None,
        "start_s": time.perf_counter() - t0,  # includes graph capture
    }
    vocab = loaded.vocab_size
    engine_rates(llm, random_prompts(1, 8, vocab, 0), 4)  # warm-up
    for i, b in enumerate(BATCHES):
        r = engine_rates(llm, random_prompts(b, PROMPT_LEN, vocab, i + 1), NEW_TOKENS)
        torch.cuda.synchronize()
        out[f"batch_{b}"] = r.as_dict()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


def hf_decode(config: Any) -> dict[str, Any]:
    """transformers' generate on its own randomly initialised copy of the shape (its speed does not depend on
    the values), bf16, sdpa attention, its default dynamic cache."""
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    out: dict[str, Any] = {}
    transformers_rates(hf, random_prompts(1, 8, config.vocab_size, 0), 4)  # warm-up
    for i, b in enumerate(BATCHES):
        out[f"batch_{b}"] = transformers_rates(hf, random_prompts(b, PROMPT_LEN, config.vocab_size, i + 1), NEW_TOKENS).as_dict()
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return out


def gpu_decode_report() -> dict[str, Any]:
    name = torch.cuda.get_device_name(0)
    config = qwen3_8b_config()
    measured_bw = copy_bandwidth()
    report: dict[str, Any] = {
        "gpu": name,
        "torch": torch.__version__,
        "model": "random weights, Qwen3-8B shape, bf16",
        "prompt_len": PROMPT_LEN,
        "new_tokens": NEW_TOKENS,
        "transformers": hf_decode(config),
    }
    loaded = random_model(config, torch.bfloat16, "cuda")
    nbytes = weight_bytes(loaded.model)
    runs: dict[str, Any] = {}
    for attention in ("torch", "triton", "flashinfer"):
        if attention not in ATTENTION_BACKENDS:
            runs[attention] = {"skipped": "not installed"}
            continue
        for eager in (True, False):
            key = f"{attention}/{'eager' if eager else 'graphs'}"
            if not eager and not ATTENTION_BACKENDS[attention].supports_cuda_graphs:
                runs[key] = {"skipped": f"the {attention} backend has no CUDA-graph support (eager only)"}
                continue
            try:
                runs[key] = engine_decode(loaded, attention, eager)
            except Exception as e:  # one backend failing must not hide the others' numbers
                runs[key] = {"error": f"{type(e).__name__}: {e}"}
    report["engine"] = runs
    hf1 = report["transformers"]["batch_1"]["decode_tok_s"]
    hf32 = report["transformers"][f"batch_{max(BATCHES)}"]["decode_tok_s"]
    published = published_bandwidth(name)
    ceiling: dict[str, Any] = {
        "weight_bytes": nbytes,
        "published_bandwidth_bytes_s": published,
        "measured_copy_bandwidth_bytes_s": measured_bw,
    }
    ratios: dict[str, float] = {}
    for key, run in runs.items():
        if "batch_1" not in run:
            continue
        tok_s = run["batch_1"]["decode_tok_s"]
        achieved = nbytes * tok_s  # weight bytes per token / time per token
        ceiling[key] = {
            "achieved_bytes_s": achieved,
            "fraction_of_published": achieved / published if published else None,
            "fraction_of_measured_copy": achieved / measured_bw,
        }
        ratios[f"{key}_batch_1_over_transformers"] = tok_s / hf1
        ratios[f"{key}_batch_{max(BATCHES)}_over_transformers"] = run[f"batch_{max(BATCHES)}"]["decode_tok_s"] / hf32
    report["bandwidth_at_batch_1"] = ceiling
    report["ratios"] = ratios
    return report


if __name__ == "__main__":
    print(json.dumps(gpu_decode_report(), indent=2))
