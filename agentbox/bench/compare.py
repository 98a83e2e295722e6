"""One comparison from one command: pick the trace, run it against every target with a progress bar,
then write the table, the JSON and the plot."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from agentbox import trace
from agentbox.bench import openhands, report, synth
from agentbox.bench.replay import ReplayOptions, total_turns
from agentbox.bench.spawn import Target, TargetRun, run_targets
from agentbox.bench.stats import TurnRecord


def build_trace(
    *,
    trace_file: Path | None,
    openhands_file: Path | None,
    synth_cfg: synth.SynthConfig,
    sessions: int | None,
    turns: int | None,
    wait: str | float | None,
    seed: int,
) -> list[trace.Session]:
    """The sessions to replay: a trace file, an OpenHands file (both cut to size), or synthetic ones."""
    if trace_file is not None or openhands_file is not None:
        loaded = trace.load(trace_file) if trace_file else openhands.convert_file(openhands_file)  # type: ignore[arg-type]
        loaded = trace.truncate(loaded, max_sessions=sessions, max_turns=turns)
        if wait == "lognormal":
            import random

            rng = random.Random(f"{seed}:waits")
            for s in loaded:
                for t in s.turns[:-1]:
                    t.wait_s = synth.sample_wait(rng)
        elif wait is not None:
            loaded = trace.with_fixed_wait(loaded, float(wait))
        return loaded
    return synth.generate(synth_cfg)


def compare(
    sessions: list[trace.Session],
    targets: list[Target],
    options: ReplayOptions,
    out_dir: Path,
    meta: dict[str, Any],
    console: Console | None = None,
) -> tuple[list[TargetRun], list[str]]:
    console = console or Console()
    out_dir.mkdir(parents=True, exist_ok=True)
    notes: list[str] = []
    n = total_turns(sessions)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[last]}"),
        console=console,
    ) as progress:

        def on_start(target: Target) -> Callable[[TurnRecord], None]:
            task = progress.add_task(target.name, total=n, last="starting")

            def on_turn(r: TurnRecord) -> None:
                last = f"error: {r.error[:60]}" if r.error else f"TTFT {r.ttft_s or 0:.2f} s"
                progress.update(task, advance=1, last=last)

            return on_turn

        runs = run_targets(sessions, targets, options, out_dir, on_start=on_start, notes=notes)
    meta = {**meta, "sessions": len(sessions), "turns": n}
    report.print_table(runs, notes, console)
    report.write_json(out_dir / "replay.json", runs, meta, notes)
    if runs:
        report.plot_ttft(out_dir / "ttft_by_turn.png", runs)
    console.print(
        f"wrote {out_dir / 'replay.json'}" + (f" and {out_dir / 'ttft_by_turn.png'}" if runs else "")
    )
    return runs, notes


def describe(sessions: list[trace.Session]) -> dict[str, Any]:
    """Sizes of a trace, estimated from its text, for the run's metadata."""
    last_prompt = [sum(trace.estimate_tokens(json.dumps(m)) for m in list(s.prompts())[-1]) for s in sessions]
    return {
        "sessions": len(sessions),
        "turns": total_turns(sessions),
        "est_final_prompt_tokens_max": max(last_prompt, default=0),
        "est_final_prompt_tokens_mean": round(sum(last_prompt) / len(last_prompt)) if last_prompt else 0,
    }
