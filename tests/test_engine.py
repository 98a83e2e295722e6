"""The engine on the real SmolLM2: batching, chunking and preemption do not change greedy outputs; sampling
parameters behave; the pool's integrity holds after every run."""

from __future__ import annotations

import pytest

from agentbox.config import EngineConfig
from agentbox.engine.ipc.messages import AddRequest
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import InvalidParam, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def make_llm(loaded, path, **kw) -> LLM:  # noqa: ANN001
    return LLM(EngineConfig(model=str(path), **{"num_pages": 256, **kw}), loaded=loaded)


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer) -> list[list[int]]:  # noqa: ANN001
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Once upon a time, in a land far away, there lived a",
        "List three colors:",
        "import numpy as np\nx = np.arange(10)\nprint(",
        "The quick brown fox",
        "Q: What is 2 + 2?\nA:",
        "Write a haiku about the sea.\n",
    ]
    return [smollm2_tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def alone(smollm2_loaded, smollm2_path, prompts) -> list[list[int]]:  # noqa: ANN001
    llm = make_llm(smollm2_loaded, smollm2_path)
    outs = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    llm.core.check_integrity()
    return outs


def test_batched_equals_alone(smollm2_loaded, smollm2_path, prompts, alone) -> None:  # noqa: ANN001
    llm = make_llm(smollm2_loaded, smollm2_path)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert all(len(o.token_ids) == 24 and o.finish_reason == "length" for o in outs)
    llm.core.check_integrity()
    assert llm.core.cache.num_free + llm.core.cache.stats().gpu_pages == llm.core.cache.capacity  # the rest is cache


def test_chunked_prefill_equals_unchunked(smollm2_loaded, smollm2_path, prompts, alone) -> None:  # noqa: ANN001
    # A 5-token step budget splits every prompt into several chunks, mixed with other requests' decodes.
    llm = make_llm(smollm2_loaded, smollm2_path, max_num_batched_tokens=5)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone
    llm.core.check_integrity()


def test_preemption_by_recompute_when_pages_run_out(smollm2_loaded, smollm2_path, prompts, alone) -> None:  # noqa: ANN001
    # 12 usable pages of 4 tokens cannot hold 8 requests of ~35 tokens: requests get preempted, recomputed,
    # and still produce exactly their solo outputs; nothing crashes and no page leaks.
    # lru: no leases, so admission never holds anyone back and preemption alone is exercised.
    llm = make_llm(smollm2_loaded, smollm2_path, num_pages=13, page_size=4, cache_policy="lru")
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == alone
    assert llm.core.counters.preemptions > 0
    llm.core.check_integrity()
    assert llm.core.cache.num_free + llm.core.cache.stats().gpu_pages == llm.core.cache.capacity  # the rest is cache


def test_running_cap(smollm2_loaded, smollm2_path, prompts, alone) -> None:  # noqa: ANN001
    llm = make_llm(smollm2_loaded, smollm2_path, max_num_seqs=3)
    seen_running = []
    for p in prompts:
        llm.core.add(AddRequest(f"r{len(seen_running)}", p, GREEDY))
        seen_running.append(0)
    while llm.core.has_work():
        llm.core.step()
        seen_running.append(len(llm.core.scheduler.running))
    assert max(seen_running) == 3
    llm.core.check_integrity()


def test_seed_reproducible_and_independent_of_batch(smollm2_loaded, smollm2_path, prompts) -> None:  # noqa: ANN001
    llm = make_llm(smollm2_loaded, smollm2_path)
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    a = llm.generate([prompts[0]], sp)[0].token_ids
    b = llm.generate([prompts[0], prompts[1], prompts[2]], [sp, SamplingParams(max_tokens=8, temperature=1.0), sp])
    assert b[0].token_ids == a
    c = llm.generate([prompts[0]], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=99, ignore_eos=True))
    assert c[0].token_ids != a


def test_top_k_one_is_greedy_and_stop_tokens(smollm2_loaded, smollm2_path, prompts, alone) -> None:  # noqa: ANN001
    llm = make_llm(smollm2_loaded, smollm2_path)
    out = llm.generate([prompts[3]], SamplingParams(max_tokens=24, temperature=1.5, top_k=1, ignore_eos=True))
    assert out[0].token_ids == alone[3]
    stop_at = alone[3][5]
    out = llm.generate([prompts[3]], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_at], ignore_eos=True))
    assert out[0].token_ids == alone[3][: alone[3].index(stop_at) + 1]
    assert out[0].finish_reason == "stop"


def test_penalties_change_output_and_logprobs(smollm2_loaded, smollm2_path, prompts, alone) -> None:  # noqa: ANN001
    llm = make_llm(smollm2_loaded, smollm2_path)
    rep = llm.generate([prompts[5]], SamplingParams(max_tokens=24, temperature=0, repetition_penalty=3.0, ignore_eos=True))
    assert rep[0].token_ids != alone[5]
    freq = llm.generate([prompts[5]], SamplingParams(max_tokens=24, temperature=0, frequency_penalty=2.0, ignore_eos=True))
    assert len(set(freq[0].token_ids)) >= len(set(alone[5]))
    lp = llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True))[0]
    assert lp.logprobs is not None and len(lp.logprobs) == 4
    for tok, entry in zip(lp.token_ids, lp.logprobs, strict=True):
        assert entry.token_id == tok and entry.logprob <= 0
        assert len(entry.top) == 3 and entry.top[0][0] == tok  # greedy: the chosen token is the top one


def test_prompt_too_long_is_an_error_not_a_crash(smollm2_loaded, smollm2_path) -> None:  # noqa: ANN001
    llm = make_llm(smollm2_loaded, smollm2_path, max_model_len=64)
    out = llm.generate([[1] * 100], GREEDY)[0]
    assert out.finish_reason == "error" and "100 tokens" in (out.error or "") and "64" in (out.error or "")
    llm.core.check_integrity()


@pytest.mark.parametrize(
    ("field", "kw"),
    [("temperature", {"temperature": -1}), ("top_p", {"top_p": 0}), ("max_tokens", {"max_tokens": 0}),
     ("min_p", {"min_p": 2}), ("logprobs", {"logprobs": 50}), ("repetition_penalty", {"repetition_penalty": 0})],
)
def test_sampling_validation_names_the_field(field: str, kw: dict) -> None:
    with pytest.raises(InvalidParam) as e:
        SamplingParams(**kw).validate()
    assert e.value.field == field
