"""`agentbox bench llamacpp --server`: the agent workload against llama.cpp's llama-server. The accounting is
checked on hand-made records; the settings llama-server runs with are checked on its command line; one small
real run replays sessions against agentbox on the embedded SmolLM2 GGUF over HTTP, and against llama-server when
one is found (else its rows are named as skipped, saying how to get it). No timing assertions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentbox.bench import llama_server
from agentbox.bench.llamacpp_agents import AgentWorkload, compare_agents, decode_tok_s, history_reuse, targets
from agentbox.bench.stats import TurnRecord
from agentbox.config import CPU_PAGE_SIZE


def _rec(session: str, turn: int, prompt: int, cached: int | None, out: int = 5, ttft: float = 0.1,
         latency: float = 0.5) -> TurnRecord:
    return TurnRecord(session, turn, 0.0, ttft, latency, prompt, cached, out)


def test_history_reuse_is_the_cached_share_of_the_previous_prompt() -> None:
    records = [_rec("a", 0, 100, 0), _rec("a", 1, 150, 90), _rec("a", 2, 200, 150),
               _rec("b", 0, 100, 0), _rec("b", 1, 160, 200)]
    assert history_reuse(records) == [0.9, 1.0, 1.0]  # cached past the history (its own prefix) counts as all
    failed = [_rec("c", 0, 100, 0), TurnRecord("c", 1, 0.0, None, 0.1, 0, None, 0, error="boom")]
    assert history_reuse(failed) == []


def test_decode_rate_counts_tokens_after_the_first() -> None:
    records = [_rec("a", 0, 10, 0, out=11, ttft=0.5, latency=1.5), _rec("a", 1, 10, 0, out=1, ttft=0.2, latency=0.3)]
    assert decode_tok_s(records) == pytest.approx(10.0)
    assert decode_tok_s([_rec("a", 0, 10, 0, out=1)]) is None


def test_llama_server_runs_with_its_slot_settings_named(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    four = targets("m.gguf", binary, 4, 2, [])
    assert [t.name for t in four] == ["agentbox", "llama-server -np 4", "llama-server -np 4 -sps 0"]
    cmd = four[2].command or []
    assert cmd[cmd.index("-np") + 1] == "4" and cmd[cmd.index("-sps") + 1] == "0"
    assert cmd[cmd.index("-c") + 1] == str(4 * 8192) and cmd[cmd.index("-t") + 1] == "2"
    assert "-sps" not in (four[1].command or [])
    one = targets("m.gguf", binary, 1, 2, [])
    assert [t.name for t in one] == ["agentbox", "llama-server -np 1"]  # one session: slot matching cannot matter
    missing = targets("m.gguf", None, 4, 2, [])
    assert all(t.command is None and "--build-server" in (t.note or "") for t in missing[1:])
    assert llama_server.parse_similarities("0, default,0.5") == [0.0, None, 0.5]
    with pytest.raises(ValueError, match="--llamacpp-sps"):
        llama_server.parse_similarities("zero")


def test_find_binary_names_a_bad_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(FileNotFoundError, match="not an executable"):
        llama_server.find_binary(str(tmp_path / "nope"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(llama_server.ENV_BINARY, raising=False)
    assert llama_server.find_binary() is None
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert llama_server.find_binary() == fake  # on PATH
    monkeypatch.setenv(llama_server.ENV_BINARY, str(fake))
    assert llama_server.find_binary() == fake


@pytest.mark.slow
def test_agent_workload_over_http(smollm2_path: Path, tmp_path: Path) -> None:
    binary = llama_server.find_binary()
    workload = AgentWorkload(sessions=(2,), turns=3, prefix_tokens=300, result_tokens=40, output_tokens=8, wait_s=0.0)
    report = compare_agents(str(smollm2_path), binary, tmp_path, workload, threads=os.cpu_count() or 1,
                            serve_args=["--device", "cpu", "--num-pages", str(4096 // CPU_PAGE_SIZE)])
    run = report["runs"]["2_sessions"]
    ours = run["rows"]["agentbox"]
    assert ours["errors"] == 0 and ours["turns"] == 6
    assert ours["history_reused_min"] > 0.9  # each session's history stays resident between its turns
    assert ours["decode_tok_s"] > 0 and ours["later_ttft_p50_s"] > 0
    assert report["cpu"]["cpu_model"]
    if binary is None:
        assert {n.split(":")[0] for n in run["notes"]} == {"llama-server -np 2", "llama-server -np 2 -sps 0"}
        assert "skipped" in report["llama_server"]
    else:
        assert set(run["speedup"]) == {"llama-server -np 2", "llama-server -np 2 -sps 0"}
        assert run["rows"]["llama-server -np 2 -sps 0"]["history_reused_median"] > 0.5
