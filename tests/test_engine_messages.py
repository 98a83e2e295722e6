"""The engine's answers to queries cross the process boundary as typed dataclasses (pickled, as the pipe does)
and turn into the JSON that /v1/stats, /metrics, /v1/sessions, `agentbox top` and the benches read: these
key sets are that contract."""

from __future__ import annotations

import json
import pickle

from agentbox.config import EngineConfig
from agentbox.engine.cache.stats import SessionDetail, SessionList
from agentbox.engine.ipc.messages import Query, QueryKind, QueryReply
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.stats import EngineStats, to_json

STATS_KEYS = {"uptime_s", "running", "waiting", "pool", "cache", "counters", "admission", "sessions", "parallel", "snapshots",
              "speculative", "experts"}
POOL_KEYS = {"total_pages", "free_pages", "used_pages", "page_size", "running_pages", "page_bytes", "kv_bytes_per_token"}
CACHE_KEYS = {"policy", "gpu_pages", "host_pages", "host_total_pages", "leased_pages", "evictions", "demotions",
              "promotions", "host_evictions", "sessions", "live_leases", "disk_pages", "disk_bytes", "disk_budget_bytes",
              "disk_written", "disk_restored", "disk_torn", "disk_sessions", "disk_states", "disk_written_behind",
              "disk_queued", "disk_dropped"}
COUNTER_KEYS = {"requests", "prompt_tokens", "cached_tokens", "host_cached_tokens", "recomputed_history_tokens",
                "generated_tokens", "computed_tokens", "prefill_tokens", "decode_tokens", "steps", "preemptions",
                "request_failures", "drafted_tokens", "accepted_tokens"}
SUMMARY_KEYS = {"id", "turns", "lease_state", "lease_expires_in_s", "prompt_tokens", "cached_tokens_gpu",
                "cached_tokens_host", "recomputed_history_tokens", "history_tokens", "last_ttft_s", "state",
                "resident_pages_gpu", "resident_pages_host", "resident_tokens_gpu", "resident_tokens_host",
                "cached_tokens", "hit_rate", "last_turn_hit_rate", "recompute_ratio", "expected_gap_s", "snapshot_bytes",
                "on_disk_tokens", "spec_drafted_tokens", "spec_accepted_tokens"}
TURN_KEYS = {"turn", "prompt_tokens", "cached_tokens", "host_cached_tokens", "recomputed_tokens", "ttft_s",
             "completion_tokens"}


def _ask(llm: LLM, kind: QueryKind, arg: str | None = None) -> object:
    reply = pickle.loads(pickle.dumps(QueryReply(1, llm.core.query(Query(1, kind, arg)))))
    return reply.result


def test_query_answers_are_typed_and_keep_their_json(smollm2_loaded, smollm2_path) -> None:  # noqa: ANN001
    llm = LLM(EngineConfig(model=str(smollm2_path), num_pages=64, host_cache_gb=0.01), loaded=smollm2_loaded)
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    ids = list(range(100, 150))
    llm.generate([ids], greedy, ["s"])
    second = llm.generate([ids + [7] * 5], greedy, ["s"])[0]
    assert second.num_cached_tokens > 0

    stats = _ask(llm, QueryKind.STATS)
    assert isinstance(stats, EngineStats)
    st = json.loads(json.dumps(to_json(stats)))  # plain JSON all the way down
    assert set(st) == STATS_KEYS and set(st["pool"]) == POOL_KEYS and set(st["cache"]) == CACHE_KEYS
    assert set(st["counters"]) == COUNTER_KEYS
    assert set(st["admission"]) == {"queued_new_sessions", "timeouts", "rejections"}
    assert set(st["sessions"]) == {"count", "live_leases"}
    assert st["parallel"]["tensor_parallel_size"] == 1
    # K and V of every layer, fp16 (the default CPU pool): 2 x layers x kv heads x head dim x 2 bytes
    lm = smollm2_loaded
    assert st["pool"]["kv_bytes_per_token"] == 2 * lm.num_layers * lm.num_kv_heads * lm.head_dim * 2
    assert st["cache"]["policy"] == "session" and st["sessions"]["count"] == 1
    assert st["counters"]["requests"] == 2 and st["counters"]["cached_tokens"] == second.num_cached_tokens
    assert st["counters"]["generated_tokens"] == 6

    listed = _ask(llm, QueryKind.SESSIONS)
    assert isinstance(listed, SessionList)
    (summary,) = to_json(listed)["data"]
    assert set(summary) == SUMMARY_KEYS
    assert summary["id"] == "s" and summary["turns"] == 2 and summary["lease_state"] == "live"
    assert summary["state"] == "waiting_tool" and summary["resident_tokens_gpu"] > 0

    detail = _ask(llm, QueryKind.SESSION, "s")
    assert isinstance(detail, SessionDetail)
    d = json.loads(json.dumps(to_json(detail)))
    assert set(d) == SUMMARY_KEYS | {"gaps_s", "turn_history"} and len(d["gaps_s"]) == 1
    assert [set(t) for t in d["turn_history"]] == [TURN_KEYS, TURN_KEYS]
    assert d["turn_history"][1]["cached_tokens"] == second.num_cached_tokens
    assert d["turn_history"][1]["completion_tokens"] == 3

    assert _ask(llm, QueryKind.SESSION, "nobody") is None
    dropped = to_json(_ask(llm, QueryKind.DROP_SESSION, "s"))
    assert dropped["id"] == "s" and dropped["deleted"] and dropped["freed_pages"] > 0
    assert dropped["aborted_requests"] == []
    assert _ask(llm, QueryKind.SESSION, "s") is None and _ask(llm, QueryKind.DROP_SESSION, "s") is None
    llm.core.check_integrity()
