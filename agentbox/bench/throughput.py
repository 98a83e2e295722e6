"""Throughput: prefill and decode tokens/s of our engine against transformers' `generate` on the same
weights, in the same process, dtype and thread count; and the GPU check's random-weight model.

Both engines are timed the same way: the clock starts when the batch is handed over; time to first token
ends when every sequence of the batch has its first token (that is the prefill); decode time runs from
there to the last token. Decode tokens/s = tokens generated after the first / decode time. Prompts are
random token ids, fresh for every measurement, and our engine runs with the prefix cache off, so neither
side is ever served from a cache.

Imports only torch, transformers and the engine (no HTTP stack, no psutil of its own), so that
scripts/gpu_check.sh can run it on a bare GPU machine.
"""

from __future__ import annotations

import gc
import itertools
import random
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList, PretrainedConfig

from agentbox.config import GPU_PAGE_SIZE, EngineConfig
from agentbox.engine.exec.runner import DTYPES
from agentbox.engine.ipc.messages import AddRequest
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.models.loader import LoadedModel, ModelSource, iter_weights
from agentbox.models.registry import model_class

_ids = itertools.count()


@dataclass(frozen=True)
class Rates:
    """One timed batch: `batch` sequences of `prompt_len` tokens, each generating `new_tokens`."""

    batch: int
    prompt_len: int
    new_tokens: int
    ttft_s: float  # until every sequence has its first token
    decode_s: float  # from there to the last token

    @property
    def prefill_tok_s(self) -> float:
        return self.batch * self.prompt_len / self.ttft_s

    @property
    def decode_tok_s(self) -> float:
        return self.batch * (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else float("nan")

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "prefill_tok_s": self.prefill_tok_s, "decode_tok_s": self.decode_tok_s}


def cuda_time(fn: Any, iters: int = 20) -> float:
    """Seconds per call of fn on the GPU (one warm-up call, synchronised around the timed loop)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


def random_prompts(batch: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    # Skip the low ids, where special tokens (bos, eos, chat markers) usually sit.
    rng = random.Random(seed)
    low = min(256, vocab_size // 4)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(batch)]


def engine_rates(llm: LLM, prompts: list[list[int]], new_tokens: int) -> Rates:
    """Drives the engine core step by step (as `LLM.generate` does) to see when the first tokens land."""
    core = llm.core
    sp = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for ids in prompts:
        err = core.add(AddRequest(f"bench-{next(_ids)}", list(ids), sp, None))
        if err is not None:
            raise RuntimeError(f"the engine refused a benchmark request: {err.error}")
    started: set[str] = set()
    first = None
    while core.has_work():
        for out in core.step():
            if out.error:
                raise RuntimeError(f"a benchmark request failed: {out.error}")
            if out.new_token_ids:
                started.add(out.request_id)
        if first is None and len(started) == len(prompts):
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return Rates(len(prompts), len(prompts[0]), new_tokens, first - start, end - first)


class _StepClock(LogitsProcessor):
    """Called once per forward pass of `generate`, right after it: the first call closes the prefill."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(time.perf_counter())
        return scores


@torch.inference_mode()
def transformers_rates(hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> Rates:
    device = next(hf.parameters()).device
    ids = torch.tensor(prompts, dtype=torch.int64, device=device)  # equal lengths: no padding needed
    clock = _StepClock()
    start = time.perf_counter()
    out = hf.generate(  # type: ignore[operator]
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # never stop early at an eos: the same work as ignore_eos on our side
        do_sample=False,
        pad_token_id=0,
        logits_processor=LogitsProcessorList([clock]),
    )
    if device.type == "cuda":
        torch.cuda.synchronize()
    if out.shape[1] != ids.shape[1] + new_tokens or len(clock.times) != new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    return Rates(len(prompts), len(prompts[0]), new_tokens, clock.times[0] - start, clock.times[-1] - clock.times[0])


def transformers_model(loaded: LoadedModel, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """transformers' own model class holding exactly the weights our loader read (a GGUF is dequantised
    once, by our reader, so both sides compute with identical numbers)."""
    hf = AutoModelForCausalLM.from_config(loaded.hf_config).to(dtype=dtype, device=device).eval()
    state = {name: t.to(dtype) for name, t in iter_weights(loaded.source, loaded.hf_config)}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    tied = bool(getattr(loaded.hf_config, "tie_word_embeddings", False))
    if unexpected or [m for m in missing if not (tied and m == "lm_head.weight")]:
        raise RuntimeError(f"weights do not fit transformers' model: missing {missing}, unexpected {unexpected}")
    if tied:
        hf.tie_weights()
    return hf


def ratios(ours: dict[str, dict[str, float]], theirs: dict[str, dict[str, float]]) -> dict[str, float]:
    """ours / transformers for each batch and phase, plus our widest batch's decode over their batch 1
    (what serving several agents at once buys over one-at-a-time generate)."""
    out: dict[str, float] = {}
    for key in ours:
        for phase in ("prefill_tok_s", "decode_tok_s"):
            out[f"{phase.removesuffix('_tok_s')}_{key}"] = ours[key][phase] / theirs[key][phase]
    widest = max(ours, key=lambda k: int(k.removeprefix("batch_")))
    out[f"decode_ours_{widest}_over_transformers_batch_1"] = (
        ours[widest]["decode_tok_s"] / theirs["batch_1"]["decode_tok_s"]
    )
    return out


def compare_throughput(
    model: str,
    new_tokens: int,
    prompt_len: int,
    batches: tuple[int, ...] = (1, 8),
    device: str = "cpu",
    dtype: str = "auto",
    cpu_threads: int | None = None,
    repeats: int = 1,
) -> dict[str, Any]:
    """Our engine and transformers' generate on the same model, same dtype, same torch thread count."""
    config = EngineConfig(
        model=model,
        device=device,
        dtype=dtype,
        cpu_threads=cpu_threads,
        cache_policy="none",
        max_num_seqs=max(batches),
        num_pages=max(batches) * -(-(prompt_len + new_tokens) // EngineConfig(device=device).resolved_page_size) + 8,
    )
    llm = LLM(config)  # sets the torch thread count on CPU; transformers runs under the same setting
    torch_dtype = DTYPES[config.resolved_dtype]
    hf = transformers_model(llm.loaded, torch_dtype, config.resolved_device)
    vocab = llm.loaded.vocab_size
    seeds = itertools.count(1)
    # Warm-up: first calls pay for allocator growth and lazy initialisation on both sides.
    engine_rates(llm, random_prompts(1, 8, vocab, next(seeds)), 2)
    transformers_rates(hf, random_prompts(1, 8, vocab, next(seeds)), 2)
    ours, theirs = {}, {}
    for b in batches:
        # Alternating repeats, best kept: on a shared machine the slow outliers are other people's load.
        runs = [
            (engine_rates(llm, random_prompts(b, prompt_len, vocab, next(seeds)), new_tokens),
             transformers_rates(hf, random_prompts(b, prompt_len, vocab, next(seeds)), new_tokens))
            for _ in range(repeats)
        ]
        ours[f"batch_{b}"] = max((r[0] for r in runs), key=lambda r: r.decode_tok_s).as_dict()
        theirs[f"batch_{b}"] = max((r[1] for r in runs), key=lambda r: r.decode_tok_s).as_dict()
    report = {
        "model": model,
        "device": config.resolved_device,
        "dtype": config.resolved_dtype,
        "torch_threads": torch.get_num_threads(),
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "repeats": repeats,
        "attention_backend": llm.core.runner.backend.name,
        "ours": ours,
        "transformers": theirs,
        "ratios": ratios(ours, theirs),
    }
    del llm, hf
    gc.collect()
    return report


def tp_comparison(
    model: str, tp: int, new_tokens: int, prompt_len: int, batches: tuple[int, ...], device: str = "cpu",
    dtype: str = "auto", repeats: int = 1,
) -> dict[str, Any]:
    """Our engine at tp 1 and at `tp` on the same model: decode step time of each, their ratio, and what
    rank 0 spends per step writing the step to the workers (pack + pipe writes)."""
    runs: dict[int, dict[str, Any]] = {}
    for size in (1, tp):
        config = EngineConfig(
            model=model, device=device, dtype=dtype, cache_policy="none", tensor_parallel_size=size,
            max_num_seqs=max(batches),
            num_pages=max(batches) * -(-(prompt_len + new_tokens) // EngineConfig(device=device).resolved_page_size) + 8,
        )
        with LLM(config) as llm:
            vocab = llm.loaded.vocab_size
            engine_rates(llm, random_prompts(1, 8, vocab, 1), 2)  # warm-up
            w = llm.core.workers
            sent_s, sent_n = (w.send_seconds, w.steps_sent) if w is not None else (0.0, 0)
            per_batch = {}
            for b in batches:
                best = max((engine_rates(llm, random_prompts(b, prompt_len, vocab, 2 + r), new_tokens)
                            for r in range(repeats)), key=lambda r: r.decode_tok_s)
                per_batch[f"batch_{b}"] = {"decode_step_ms": round(1e3 * best.decode_s / (new_tokens - 1), 3),
                                           "decode_tok_s": round(best.decode_tok_s, 1)}
            runs[size] = {
                "per_batch": per_batch,
                "weight_bytes_per_rank": list(llm.core.runner.weight_bytes_per_rank),
                "step_send_us": round(1e6 * (w.send_seconds - sent_s) / max(1, w.steps_sent - sent_n), 1)
                if w is not None else 0.0,
            }
    return {
        "tp": tp,
        f"tp{tp}": runs[tp],
        "tp1": runs[1],
        "broadcast_us_per_step": runs[tp]["step_send_us"],
        "step_time_ratio": {
            b: round(runs[tp]["per_batch"][b]["decode_step_ms"] / runs[1]["per_batch"][b]["decode_step_ms"], 3)
            for b in runs[1]["per_batch"]
        },
    }


# ---- random-weight models (the GPU check builds Qwen3-8B's shape in place, no download) ----


def qwen3_8b_config() -> PretrainedConfig:
    from transformers import Qwen3Config

    return Qwen3Config(
        architectures=["Qwen3ForCausalLM"],
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
    )


def compare_logits(got: torch.Tensor, ref: torch.Tensor) -> dict[str, Any]:
    """Ours against a reference: the largest difference, against the reference's scale, and the top tokens."""
    return {"max_abs_diff": (got - ref).abs().max().item(), "max_abs_ref": ref.abs().max().item(),
            "top1_match": int(got.argmax()) == int(ref.argmax())}


def built(cls: Any, config: PretrainedConfig, dtype: torch.dtype, device: str | torch.device) -> torch.nn.Module:
    """`cls(config)` with its parameters allocated in `dtype` on `device` (a big model never lands on the host)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return cls(config)
    finally:
        torch.set_default_dtype(previous)


@torch.no_grad()
def random_model(config: PretrainedConfig, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> LoadedModel:
    """Our model class for `config` with random weights drawn in place on `device` (norms at 1, matrices
    N(0, 0.02)): the cost of a big model without its download. Outputs are noise; speed is real."""
    model = built(model_class(config), config, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif p.ndim >= 2:
            p.normal_(0.0, 0.02, generator=gen)
        else:
            p.zero_()  # biases
    model.eval().requires_grad_(False)
    source = ModelSource("hf", Path("random"), f"random-{config.model_type}")
    return LoadedModel.of(model, config, source, dtype, eos_token_ids=[], max_model_len=int(config.max_position_embeddings))


def logits_check(config: PretrainedConfig, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Our last-position logits against transformers' for a random model of `config`, saved as a checkpoint
    and loaded back by our loader (eager attention on the HF side: it is the one that knows sinks)."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    prompt = random_prompts(1, 40, config.vocab_size, seed=7)[0]
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        hf = hf.to(device=device, dtype=dtype)
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt], device=device)).logits[0, -1].float()
        llm = LLM(EngineConfig(model=tmp, device=device, dtype=str(dtype).removeprefix("torch."), num_pages=16))
        got = llm.logits(prompt)
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "max_abs_diff": (got - expected).abs().max().item(),
        "max_abs_logit": expected.abs().max().item(),
        "top1_match": int(got.argmax()) == int(expected.argmax()),
    }


def tiny_qwen3_logits_check(device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Our logits against transformers' for a tiny random Qwen3."""
    from transformers import Qwen3Config

    return logits_check(Qwen3Config(
        architectures=["Qwen3ForCausalLM"], hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512,
    ), device, dtype)


def gpu_report(batches: tuple[int, ...] = (1, 32), prompt_len: int = 128, new_tokens: int = 64) -> dict[str, Any]:
    """What scripts/gpu_check.sh prints: bf16 logits against transformers, then decode speed of a
    random-weight model of Qwen3-8B's shape at each batch size."""
    device = "cuda"
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "logits_vs_transformers": tiny_qwen3_logits_check(device, torch.bfloat16),
    }
    config = qwen3_8b_config()
    t0 = time.perf_counter()
    loaded = random_model(config, torch.bfloat16, device)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    pages = max(batches) * -(-(prompt_len + new_tokens) // GPU_PAGE_SIZE) + 8
    llm = LLM(
        EngineConfig(device=device, dtype="bfloat16", num_pages=pages, max_num_seqs=max(batches), cache_policy="none"),
        loaded=loaded,
    )
    engine_rates(llm, random_prompts(1, 8, config.vocab_size, 0), 4)  # warm-up
    rates = {}
    for i, b in enumerate(batches):
        r = engine_rates(llm, random_prompts(b, prompt_len, config.vocab_size, i + 1), new_tokens)
        torch.cuda.synchronize()
        rates[f"batch_{b}"] = r.as_dict()
    report["qwen3_8b_shape_random"] = {
        "params_b": sum(p.numel() for p in loaded.model.parameters()) / 1e9,
        "build_s": build_s,
        "attention_backend": llm.core.runner.backend.name,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        **rates,
    }
    return report


if __name__ == "__main__":  # python -m agentbox.bench.throughput --gpu (what scripts/gpu_check.sh runs)
    import json
    import sys

    if sys.argv[1:] != ["--gpu"]:
        sys.exit("usage: python -m agentbox.bench.throughput --gpu   (the CPU benchmark: agentbox bench throughput)")
    print(json.dumps(gpu_report(), indent=2))
