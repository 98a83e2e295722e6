"""`agentbox bench warm` end to end at small contexts: a served tiny model over real HTTP, warm turns hit the
session's cache, and every stage of the host time is measured."""

from __future__ import annotations

import pytest

from agentbox.bench.warm import STAGES, warm_report


@pytest.mark.slow
def test_bench_warm_small_contexts(smollm2_path) -> None:  # noqa: ANN001 - the fixture skips without SmolLM2
    report = warm_report((1024, 3072), warm_turns=2, http=True, prefill=False, pause_ms=20)
    for n in (1024, 3072):
        http = report["http"][n]
        assert http["prompt_tokens"] > n // 2
        # a warm turn recomputes only its new tokens (and the last partial page), never the history
        assert len(http["warm_uncached_tokens"]) == 4 and all(0 < u < 64 for u in http["warm_uncached_tokens"]), http
        assert len(http["warm_ttft_ms_all"]) == len(http["warm_ttft_ms_back_to_back_all"]) == 2
        stages = report["host_stages"][n]
        assert set(stages["ms"]) == set(STAGES) and all(v >= 0 for v in stages["ms"].values())
        assert stages["new_tokens"] < 64 < stages["prompt_tokens"]
    assert report["warm_ratio_longest_over_shortest"] > 0 and report["warm_ratio_back_to_back"] > 0
    assert report["pause_ms"] == 20


def test_prefill_report_measures_both_thread_settings_and_gives_threads_back() -> None:
    import torch

    from agentbox.bench.prefill import prefill_report

    before = torch.get_num_threads()
    report = prefill_report(short=64, long=256, chunk=64, repeats=1)
    assert torch.get_num_threads() == before  # the engines' thread counts do not outlive them
    for name in ("engine_threads", "one_thread"):
        r = report[name]
        assert r["ctx_64"]["tok_s"] > 0 and r["ctx_256"]["tok_s"] > 0
        assert r["tok_s_ratio_long_over_short"] == pytest.approx(
            r["ctx_256"]["tok_s"] / r["ctx_64"]["tok_s"], rel=0.01)
    assert 0 < report["tok_s_ratio_bound_by_arithmetic"] < 1
