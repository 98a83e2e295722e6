"""Speculative decoding on a GPU (scripts/gpu_check.sh's `gpu_spec` block; tests/test_gpu_spec.py): exactness in
bf16 with CUDA graphs on, and what a verify step costs against a decode step.

- Exactness: greedy output with drafts equals greedy output without, token for token, on a random-weight model in
  bf16 with CUDA graphs (decode steps replay a graph; a step with a verify runs eagerly, see below). A random
  model repeats nothing, so the drafts come from near copies of the plain run's answers put in the drafter's
  recent outputs (every 7th token changed): kept up to a change, refused from there. Its LM head is scaled up
  so that greedy choices are not near-ties that any change of summation order flips.
- Cost: one sequence scoring its next token plus k drafts (k = 4, 8, 16) after a 512-token context, against a
  decode step as a graph replay and as an eager step, on Qwen3-8B's shape cut to 8 of its 36 layers. The
  drafter prices a verify at 1 + spec_row_cost * k decode steps (engine/draft.py POLICY["cuda"]: 0.02):
  `row_cost_vs_graph_decode` is that number as measured here.

Why a verify runs eagerly: graph_runner.py captures decode shapes only (one token per sequence; the triton
decode kernel reads one query per sequence from device tensors). A verify's k + 1 queries per sequence take
the prefix-extend path, whose per-sequence query lengths are host-side lists (AttentionMetadata.query_lens) that
a captured graph would freeze; capturing verifies needs device-side query offsets in the extend kernel and one
graph per (batch, k) pair. This block measures what the eager verify costs, so that price is known first.

`python -m agentbox.bench.gpu_spec` prints one JSON object.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch
from transformers import PretrainedConfig, Qwen3Config

from agentbox.bench.throughput import qwen3_8b_config, random_model, random_prompts
from agentbox.config import EngineConfig, Speculative
from agentbox.engine.llm import LLM
from agentbox.engine.request import Request
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.scheduler import ScheduledSeq, SchedulerOutput
from agentbox.models.loader import LoadedModel

KS = (4, 8, 16)
TINY = Qwen3Config(architectures=["Qwen3ForCausalLM"], hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024,
                   max_position_embeddings=2048, rms_norm_eps=1e-6)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _near_copy(tokens: list[int], vocab: int) -> list[int]:
    return [(t + 1) % vocab if i % 7 == 6 else t for i, t in enumerate(tokens)]


def exactness(config: PretrainedConfig, device: str, dtype: torch.dtype) -> dict[str, Any]:
    """Greedy with drafts against greedy without, on the same random model with CUDA graphs where the device
    has them."""
    loaded = random_model(config, dtype, device)
    with torch.no_grad():
        loaded.model.lm_head.weight.mul_(50.0)  # decisive logits: no near-ties for a summation order to flip
    prompts = random_prompts(4, 96, config.vocab_size, 7)
    sp = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}
    ref: list[list[int]] = []
    for mode in (Speculative.OFF, Speculative.SUFFIX):
        llm = LLM(EngineConfig(device=device, dtype=str(dtype).removeprefix("torch."), num_pages=256,
                               max_num_seqs=4, speculative=mode, spec_row_cost=0.0, spec_match_factor=2.0),
                  loaded=loaded)
        if mode is Speculative.OFF:
            ref = [o.token_ids for o in llm.generate(prompts, sp)]
            out["cuda_graphs"] = llm.core.runner.graphs is not None
            continue
        for answer in ref:
            llm.core.drafter.recent.add(_near_copy(answer, config.vocab_size))
        got = [o.token_ids for o in llm.generate(prompts, sp)]
        c = llm.core.counters
        out.update(identical=got == ref, drafted_tokens=c.drafted_tokens, accepted_tokens=c.accepted_tokens,
                   first_difference=next(([i, j] for i, (a, b) in enumerate(zip(got, ref, strict=True))
                                          for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None))
    return out


def _time_step(llm: LLM, step: SchedulerOutput, device: str, repeats: int) -> float:
    """Median seconds of one forward pass (the runner's whole step: prepare, forward, logits)."""
    times = []
    for _ in range(repeats + 2):
        _sync(device)
        t = time.perf_counter()
        llm.core.runner.forward_logits(step)
        _sync(device)
        times.append(time.perf_counter() - t)
    return sorted(times[2:])[repeats // 2]


def verify_cost(loaded: LoadedModel, device: str, context: int = 512, repeats: int = 9) -> dict[str, Any]:
    """A verify of k drafts against a decode step (graph replay and eager) of one sequence after `context`."""
    llm = LLM(EngineConfig(device=device, dtype=str(loaded.dtype).removeprefix("torch."), num_pages=128,
                           max_num_seqs=4, speculative=Speculative.OFF), loaded=loaded)
    core, runner = llm.core, llm.core.runner
    prompt = random_prompts(1, context + max(KS) + 1, loaded.vocab_size, 3)[0]
    with core.cache.scratch(len(prompt)) as handle:
        req = Request("gpu-spec-verify", prompt[:context], SamplingParams(temperature=0.0), cache_handle=handle)
        runner.forward_logits(SchedulerOutput([ScheduledSeq(req, context, True)], []))
        # its last token again, as a decode, then k drafts after it
        req = Request("gpu-spec-verify", prompt[:context], SamplingParams(temperature=0.0), cache_handle=handle,
                      num_computed_tokens=context - 1)
        decode = SchedulerOutput([ScheduledSeq(req, 1, True)], [])
        ms = {"decode_graph" if runner.graphs is not None else "decode_eager": _time_step(llm, decode, device, repeats)}
        graphs, runner.graphs = runner.graphs, None
        if graphs is not None:
            ms["decode_eager"] = _time_step(llm, decode, device, repeats)
        for k in KS:  # eager, as the engine runs it
            ms[f"verify_k{k}"] = _time_step(llm, SchedulerOutput([ScheduledSeq(req, 1 + k, True, prompt[context:context + k])], []),
                                            device, repeats)
        runner.graphs = graphs
    base = ms.get("decode_graph", ms["decode_eager"])
    return {
        "context_tokens": context, "step_ms": {k: round(v * 1e3, 3) for k, v in ms.items()},
        "verify_vs_decode": {str(k): round(ms[f"verify_k{k}"] / base, 3) for k in KS},
        "row_cost_vs_graph_decode": {str(k): round((ms[f"verify_k{k}"] / base - 1) / k, 4) for k in KS},
        "eager_decode_vs_graph": round(ms["decode_eager"] / base, 3),
    }


def gpu_spec_report(device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                    cost_config: PretrainedConfig | None = None) -> dict[str, Any]:
    if cost_config is None:
        cost_config = qwen3_8b_config()
        cost_config.num_hidden_layers = 8
    report: dict[str, Any] = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else device,
                              "dtype": str(dtype).removeprefix("torch."), "exactness": exactness(TINY, device, dtype)}
    loaded = random_model(cost_config, dtype, device)
    report["verify_cost"] = {"layers": cost_config.num_hidden_layers, **verify_cost(loaded, device)}
    return report


if __name__ == "__main__":
    print(json.dumps(gpu_spec_report(), indent=1))
