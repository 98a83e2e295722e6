"""The agent workload against llama.cpp's own server (`agentbox bench llamacpp --server`): sessions of turns over
one shared system prompt, each turn re-sending its whole history with a tool result appended, replayed over HTTP
against agentbox and against llama-server on the same GGUF, one server at a time.

llama-server runs with its multi-session settings in its name: `-np N` slots for N sessions, with its default
slot matching and with `-sps 0` (each request to the slot that holds most of its prompt). Every number comes
from the replay's own records: wall time, the share of each later turn's previous history the server reported
as cached (`prompt_tokens_details.cached_tokens`), time to first token of later turns, and decode tok/s (tokens
after the first over the time after the first)."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentbox.bench import llama_server, synth
from agentbox.bench.cpu_rows import cpu_info
from agentbox.bench.replay import ReplayOptions
from agentbox.bench.spawn import Target, TargetRun, agentbox_command, run_targets
from agentbox.bench.stats import TurnRecord, percentile
from agentbox.trace import Session, flatten_tools

CTX_PER_SLOT = 8192  # the longest history of the default workload (~5k tokens) with room for its answer


@dataclass(frozen=True)
class AgentWorkload:
    """The shape of the comparison (the issue's: 8 turns over a 2,000-token prompt, ~300-token tool results)."""

    sessions: tuple[int, ...] = (1, 4)
    turns: int = 8
    prefix_tokens: int = 2000
    result_tokens: int = 300
    output_tokens: int = 60
    wait_s: float = 0.5  # the tool's time between turns (the median gap measured is about 0.42 s)
    seed: int = 0
    # Tools and tool turns as plain text for both servers: a chat template without a tools section (SmolLM2's,
    # which the test GGUFs carry) makes llama-server drop the tool definitions (1,468 prompt tokens where
    # agentbox, which writes them into the system turn, computed 2,099), so the two did unequal work.
    tools_as_text: bool = True

    def trace(self, sessions: int) -> list[Session]:
        generated = self._generate(sessions)
        return flatten_tools(generated) if self.tools_as_text else generated

    def _generate(self, sessions: int) -> list[Session]:
        return synth.generate(synth.SynthConfig(
            sessions=sessions, turns=self.turns, turn_sigma=0.0, prefix_tokens=self.prefix_tokens,
            result_tokens_median=self.result_tokens, result_sigma=0.3, result_tokens_max=4 * self.result_tokens,
            output_tokens_median=self.output_tokens, output_sigma=0.3, output_tokens_max=4 * self.output_tokens,
            wait=self.wait_s, seed=self.seed))


def history_reuse(records: list[TurnRecord]) -> list[float]:
    """Per later turn: the cached share of the previous turn's prompt (the history it re-sends)."""
    by_key = {(r.session, r.turn): r for r in records}
    shares = []
    for r in records:
        prev = by_key.get((r.session, r.turn - 1))
        if r.turn == 0 or prev is None or not (r.ok and prev.ok and r.usage and prev.usage) or not prev.prompt_tokens:
            continue
        shares.append(min(1.0, (r.cached_tokens or 0) / prev.prompt_tokens))
    return shares


def decode_tok_s(records: list[TurnRecord]) -> float | None:
    """Tokens after each answer's first over the time after its first token, summed over the run."""
    tokens = sum(r.output_tokens - 1 for r in records if r.ok and r.ttft_s is not None and r.output_tokens > 1)
    seconds = sum(r.latency_s - r.ttft_s for r in records if r.ok and r.ttft_s is not None and r.output_tokens > 1)
    return tokens / seconds if seconds > 0 else None


def row(run: TargetRun) -> dict[str, Any]:
    reuse = history_reuse(run.records)
    later = [r.ttft_s for r in run.records if r.ok and r.turn > 0 and r.ttft_s is not None]
    return {
        "wall_s": run.stats.wall_s, "errors": run.stats.errors, "turns": run.stats.turns,
        "history_reused_median": statistics.median(reuse) if reuse else None,
        "history_reused_min": min(reuse) if reuse else None,
        "later_ttft_p50_s": percentile(later, 50), "decode_tok_s": decode_tok_s(run.records), **run.stats.extra,
    }


def targets(gguf: str, binary: Path | None, sessions: int, threads: int, serve_args: list[str]) -> list[Target]:
    ours = Target(name="agentbox", command=agentbox_command(gguf, serve_args), ready_paths=("/health",),
                  meta={"engine": "agentbox"}, stats_path="/v1/stats")
    # One session: slot matching cannot matter, so llama-server runs with its defaults only.
    slot_settings = [llama_server.Slots(sessions)] + ([llama_server.Slots(sessions, 0.0)] if sessions > 1 else [])
    theirs = [llama_server.target(binary, gguf, CTX_PER_SLOT, threads, s) if binary is not None
              else llama_server.missing_target(s) for s in slot_settings]
    return [ours, *theirs]


def compare_agents(gguf: str, binary: Path | None, out_dir: Path, workload: AgentWorkload | None = None,
                   threads: int = 2, serve_args: list[str] | None = None) -> dict[str, Any]:
    """Each session count's replay against every target; `speedup` is a llama-server wall over agentbox's."""
    workload = workload or AgentWorkload()
    report: dict[str, Any] = {
        "model": gguf, "workload": asdict(workload), "cpu": cpu_info(), "agentbox_serve_args": serve_args or [],
        "llama_server": llama_server.build_info(binary) if binary is not None else {"skipped": llama_server.NOT_FOUND},
        "runs": {},
    }
    for sessions in workload.sessions:
        notes: list[str] = []
        runs = run_targets(workload.trace(sessions), targets(gguf, binary, sessions, threads, serve_args or []),
                           ReplayOptions(force_length=True), out_dir / f"sessions-{sessions}", notes=notes)
        rows = {run.stats.name: row(run) for run in runs}
        ours = rows.get("agentbox")
        speedup = {name: r["wall_s"] / ours["wall_s"] for name, r in rows.items()
                   if name != "agentbox" and ours is not None and not r["errors"] and not ours["errors"]}
        report["runs"][f"{sessions}_sessions"] = {"rows": rows, "speedup": speedup, "notes": notes}
    return report
