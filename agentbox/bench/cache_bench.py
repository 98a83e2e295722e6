"""Cache: what keeping a session's history resident buys on the next turn, measured in-process.

Turn 1 sends a long prefix (an agent's system prompt + tools + history) cold; turn 2 extends turn 1 with
its answer and a new question, the way an agent's next turn does, and should only compute the new tail.
Then a byte-identical prompt from another session measures the hit rate on a shared prefix (what is left
uncached is the page-aligned tail the cache cannot share). Prompts are random token ids: the cache keys on
ids, and random ids make sure nothing but the cache can explain a fast warm turn.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from agentbox.bench.throughput import random_prompts
from agentbox.config import CachePolicy, EngineConfig
from agentbox.engine.llm import LLM, Completion
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.stats import to_json

FIRST_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # time to first token = wall time


def _timed(llm: LLM, prompt: list[int], session: str, sp: SamplingParams = FIRST_TOKEN) -> tuple[Completion, float]:
    start = time.perf_counter()
    (out,) = llm.generate([prompt], sp, session_ids=[session])
    if out.error:
        raise RuntimeError(f"cache benchmark request failed: {out.error}")
    return out, time.perf_counter() - start


def cache_report(
    model: str, prefix_tokens: int, question_tokens: int = 32, answer_tokens: int = 16, cpu_threads: int | None = None
) -> dict[str, Any]:
    page = EngineConfig(cpu_threads=cpu_threads).resolved_page_size
    # The pool holds a full 8k context (SmolLM2's) and the turns' tails, so nothing is evicted mid-run.
    need = max(8192, prefix_tokens + 4 * (question_tokens + answer_tokens))
    config = EngineConfig(
        model=model, cache_policy=CachePolicy.SESSION, num_pages=-(-need // page) + 16, cpu_threads=cpu_threads,
        host_cache_gb=0.0,  # everything fits in the pool: the host tier would only take RAM here
    )
    llm = LLM(config)
    if prefix_tokens + 2 * (question_tokens + answer_tokens) >= llm.core.max_model_len:
        raise ValueError(f"--prefix-tokens {prefix_tokens} leaves no room in a {llm.core.max_model_len}-token context")
    vocab = llm.loaded.vocab_size
    prefix, q1, q2, warmup = random_prompts(4, prefix_tokens, vocab, seed=11)
    q1, q2 = q1[:question_tokens], q2[:question_tokens]
    _timed(llm, warmup[:64], "warmup")  # first-call costs (allocator, lazy init) stay out of the cold number

    turn1 = prefix + q1
    out1, cold_s = _timed(llm, turn1, "agent-1")
    # The model's answer to turn 1 (a second pass over turn 1, served from the cache: the cold number above
    # stays a pure time to first token), then the agent's next turn: the whole transcript again, with the
    # answer and a new question appended.
    answer, _ = _timed(llm, turn1, "agent-1", SamplingParams(max_tokens=answer_tokens, temperature=0.0, ignore_eos=True))
    turn2 = turn1 + answer.token_ids + q2
    out2, warm_s = _timed(llm, turn2, "agent-1")
    same, _ = _timed(llm, list(turn1), "agent-2")  # byte-identical prompt, another session
    llm.core.check_integrity()
    return {
        "model": model,
        "device": config.resolved_device,
        "torch_threads": torch.get_num_threads(),
        "cache_policy": config.cache_policy.value,
        "prefix_tokens": prefix_tokens,
        "cold": {"prompt_tokens": len(turn1), "cached_tokens": out1.num_cached_tokens, "ttft_s": cold_s},
        "warm": {"prompt_tokens": len(turn2), "cached_tokens": out2.num_cached_tokens, "ttft_s": warm_s},
        "speedup": cold_s / warm_s,
        "identical_prefix": {
            "prompt_tokens": len(turn1),
            "cached_tokens": same.num_cached_tokens,
            "hit_rate": same.num_cached_tokens / len(turn1),
        },
        "stats": to_json(llm.core.stats().cache),
    }
