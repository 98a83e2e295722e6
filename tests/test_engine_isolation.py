"""A request whose own values make the engine raise fails alone: the engine keeps serving the rest of the
batch (the values that once crashed it are refused at the API; these bypass it, as a future bug would)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from agentbox.config import EngineConfig
from agentbox.engine.core import EngineCore
from agentbox.engine.grammar_spec import plain_grammar_error
from agentbox.engine.ipc.messages import AddRequest, RequestOutput
from agentbox.engine.sampling import InvalidParam, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096, rms_norm_eps=1e-6)
PROMPT = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> EngineCore:
    path: Path = tmp_path_factory.mktemp("tiny-isolation")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])).save_pretrained(path)
    return EngineCore(EngineConfig(model=str(path), device="cpu", dtype="float32", num_pages=64, cpu_threads=1))


def _run(core: EngineCore, reqs: dict[str, SamplingParams], prompt: list[int]) -> dict[str, list[RequestOutput]]:
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in reqs}
    for rid, sp in reqs.items():
        err = core.add(AddRequest(rid, list(prompt), sp, None))
        if err is not None:
            outs[rid].append(err)
    while core.has_work():
        for o in core.step():
            outs[o.request_id].append(o)
    return outs


@pytest.mark.parametrize("bad", [
    SamplingParams(max_tokens=12, temperature=1.0, seed=2**64, ignore_eos=True),  # torch: Overflow ... long long
    SamplingParams(max_tokens=12, temperature=1.0, repetition_penalty=5e-324, ignore_eos=True),  # inf / nan
])
def test_a_failing_request_fails_alone(core: EngineCore, bad: SamplingParams) -> None:
    (alone,) = _run(core, {"ref": GREEDY}, PROMPT).values()
    failures = core.counters.request_failures
    outs = _run(core, {"good": GREEDY, "bad": bad, "good2": GREEDY}, PROMPT)
    last = outs["bad"][-1]
    assert last.finished and last.finish_reason == "error" and last.error_code == "request_failed"
    assert "failed in the engine" in (last.error or "")
    ref = [t for o in alone for t in o.new_token_ids]
    for rid in ("good", "good2"):
        assert [t for o in outs[rid] for t in o.new_token_ids] == ref and outs[rid][-1].finish_reason == "length"
    assert core.counters.request_failures == failures + 1
    core.check_integrity()  # the failed request's pages went back


@pytest.mark.parametrize(("field", "kw"), [
    ("seed", {"seed": 2**64}), ("top_k", {"top_k": 2**63}), ("repetition_penalty", {"repetition_penalty": 5e-324}),
    ("temperature", {"temperature": float("nan")}), ("stop_token_ids", {"stop_token_ids": [2**70]}),
    ("max_tokens", {"max_tokens": 2**40}),
])
def test_engine_bounds_name_the_field(field: str, kw: dict) -> None:
    with pytest.raises(InvalidParam) as e:
        SamplingParams(**kw).validate()
    assert e.value.field == field and field in str(e.value)


def test_grammar_errors_do_not_leak_cpp_paths() -> None:
    raw = RuntimeError("[22:01:03] /workspace/xgrammar/cpp/json_schema_converter.cc:812: Unsupported type 'foo'\n"
                       "Stack trace:\n  [bt] (0) /usr/lib/libxgrammar.so(+0x1234)")
    msg = plain_grammar_error(raw)
    assert msg == "Unsupported type 'foo'"


def test_prefill_is_abortable_between_chunks(tmp_path: Path) -> None:
    """A prompt of many prefill chunks, aborted after the first: it never reaches its first token, and its
    pages come back (the process loop handles an abort between any two steps)."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])).save_pretrained(tmp_path)
    core = EngineCore(EngineConfig(model=str(tmp_path), device="cpu", dtype="float32", num_pages=64, cpu_threads=1,
                                   max_num_batched_tokens=16))
    free = core.cache.num_free
    assert core.add(AddRequest("long", [(i % 200) + 2 for i in range(100)], GREEDY, None)) is None
    assert core.step() == []  # chunk 1 of 7: nothing sampled
    aborted = core.abort("long")
    assert aborted is not None and aborted.finished and aborted.finish_reason == "abort"
    assert not core.has_work() and core.counters.generated_tokens == 0
    core.check_integrity()
    assert core.cache.num_free + core.cache.stats().gpu_pages >= free - 1


def test_namespaces_keep_sessions_and_cache_reports_apart(core: EngineCore) -> None:
    """Two API keys' namespaces: a prefix one computed is reported cached to the other only after the other
    computed (or matched) it itself, and a keyless request never joins the other's session."""
    prompt = [(3 * i) % 200 + 2 for i in range(64)]

    def turn(rid: str, ns: str, sid: str | None) -> RequestOutput:
        assert core.add(AddRequest(rid, list(prompt), SamplingParams(max_tokens=2, temperature=0.0,
                                                                     ignore_eos=True), sid, ns)) is None
        last = None
        while core.has_work():
            for o in core.step():
                last = o if o.request_id == rid and o.finished else last
        assert last is not None
        return last

    a1 = turn("a1", "ka/", "ka/s")
    a2 = turn("a2", "ka/", "ka/s")
    assert a1.num_cached_tokens == 0 and a2.num_cached_tokens >= 48  # its own prefix: reported
    b1 = turn("b1", "kb/", None)
    assert b1.num_cached_tokens == 0, "another key's prefix was reported as cached"
    assert b1.session_id is not None and b1.session_id.startswith("kb/auto-")  # not joined to ka/s
    b2 = turn("b2", "kb/", None)
    assert b2.num_cached_tokens >= 48 and (b2.session_id or "").startswith("kb/")
    assert core.counters.cached_tokens >= a2.num_cached_tokens + b2.num_cached_tokens
    core.check_integrity()


def test_idle_sessions_expire_and_the_table_is_capped(core: EngineCore) -> None:
    from dataclasses import replace

    capped = EngineCore(replace(core.config, max_sessions=2, session_idle_s=3600.0))

    def turn(sid: str) -> None:
        assert capped.add(AddRequest(sid, [5, 6, 7, sum(map(ord, sid)) % 200 + 2], GREEDY, sid)) is None
        while capped.has_work():
            capped.step()

    for sid in ("s1", "s2", "s3"):
        turn(sid)
    assert {s.id for s in capped.cache.sessions} == {"s2", "s3"}  # the longest idle went first
    turn("s4")
    assert {s.id for s in capped.cache.sessions} == {"s3", "s4"}
    capped.config = replace(capped.config, session_idle_s=0.0)
    time.sleep(1.1)  # pruning for idleness runs at most once a second
    assert capped.prune_sessions() == 2 and len(capped.cache.sessions) == 0  # both idle past 0 s
    capped.check_integrity()
