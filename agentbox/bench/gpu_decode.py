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
from dataclasses import dataclass
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
from agentbox.config import GPU_PAGE_SIZE, EngineConfig
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


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int = 4 << 30, repeats: int = 5) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy: the ceiling a kernel can reach here."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    elapsed = time.perf_counter() - start
    del src, dst
    return 2 * nbytes * repeats / elapsed


def weight_bytes(model: torch.nn.Module) -> int:
    seen = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())


@dataclass(frozen=True)
class Shape:
    """What one run measures: the model's config, where, and the batch/prompt/generation sizes."""

    config: Any
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    batches: tuple[int, ...] = BATCHES
    prompt_len: int = PROMPT_LEN
    new_tokens: int = NEW_TOKENS


def engine_decode(loaded: LoadedModel, shape: Shape, attention: str, enforce_eager: bool) -> dict[str, Any]:
    pages = max(shape.batches) * -(-(shape.prompt_len + shape.new_tokens) // GPU_PAGE_SIZE) + 8
    config = EngineConfig(
        device=shape.device, dtype=str(shape.dtype).removeprefix("torch."), attention=attention,
        enforce_eager=enforce_eager, num_pages=pages, max_num_seqs=max(shape.batches), cache_policy="none",
    )
    t0 = time.perf_counter()
    llm = LLM(config, loaded=loaded)
    _sync(shape.device)
    out: dict[str, Any] = {
        "attention_backend": llm.core.runner.backend.name,
        "cuda_graphs": llm.core.runner.graphs is not None,
        "start_s": time.perf_counter() - t0,  # includes graph capture
    }
    vocab = loaded.vocab_size
    engine_rates(llm, random_prompts(1, 8, vocab, 0), 4)  # warm-up
    for i, b in enumerate(shape.batches):
        r = engine_rates(llm, random_prompts(b, shape.prompt_len, vocab, i + 1), shape.new_tokens)
        _sync(shape.device)
        out[f"batch_{b}"] = r.as_dict()
    del llm
    _release(shape.device)
    return out


def _release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def hf_decode(shape: Shape) -> dict[str, Any]:
    """transformers' generate on its own randomly initialised copy of the shape (its speed does not depend on
    the values), sdpa attention, its default dynamic cache."""
    with torch.device(shape.device):
        hf = AutoModelForCausalLM.from_config(shape.config, dtype=shape.dtype).eval()
    vocab = shape.config.vocab_size
    out: dict[str, Any] = {}
    transformers_rates(hf, random_prompts(1, 8, vocab, 0), 4)  # warm-up
    for i, b in enumerate(shape.batches):
        r = transformers_rates(hf, random_prompts(b, shape.prompt_len, vocab, i + 1), shape.new_tokens)
        out[f"batch_{b}"] = r.as_dict()
    del hf
    _release(shape.device)
    return out


def gpu_decode_report(shape: Shape | None = None, backends: tuple[str, ...] = ("torch", "triton", "flashinfer")) -> dict[str, Any]:
    shape = shape or Shape(qwen3_8b_config())
    cuda = shape.device.startswith("cuda")
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    measured_bw = copy_bandwidth(shape.device, nbytes=(4 << 30) if cuda else (64 << 20))
    report: dict[str, Any] = {
        "gpu": name,
        "torch": torch.__version__,
        "model": f"random weights, {shape.config.model_type} {shape.config.hidden_size}x{shape.config.num_hidden_layers}, "
        f"{str(shape.dtype).removeprefix('torch.')}",
        "prompt_len": shape.prompt_len,
        "new_tokens": shape.new_tokens,
        "transformers": hf_decode(shape),
    }
    loaded = random_model(shape.config, shape.dtype, shape.device)
    nbytes = weight_bytes(loaded.model)
    runs: dict[str, Any] = {}
    for attention in backends:
        if attention not in ATTENTION_BACKENDS:
            runs[attention] = {"skipped": "not installed"}
            continue
        for eager in (True, False):
            key = f"{attention}/{'eager' if eager else 'graphs'}"
            if not eager and not ATTENTION_BACKENDS[attention].supports_cuda_graphs:
                runs[key] = {"skipped": f"the {attention} backend has no CUDA-graph support (eager only)"}
                continue
            try:
                runs[key] = engine_decode(loaded, shape, attention, eager)
            except Exception as e:  # one backend failing must not hide the others' numbers
                runs[key] = {"error": f"{type(e).__name__}: {e}"}
    report["engine"] = runs
    widest = f"batch_{max(shape.batches)}"
    hf1 = report["transformers"]["batch_1"]["decode_tok_s"]
    hf_widest = report["transformers"][widest]["decode_tok_s"]
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
        ratios[f"{key}_{widest}_over_transformers"] = run[widest]["decode_tok_s"] / hf_widest
    report["bandwidth_at_batch_1"] = ceiling
    report["ratios"] = ratios
    return report


if __name__ == "__main__":
    print(json.dumps(gpu_decode_report(), indent=2))
