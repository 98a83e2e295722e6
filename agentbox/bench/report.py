"""A replay comparison as a terminal table, a JSON file and a PNG plot of time to first token by turn."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agentbox.bench.spawn import TargetRun


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def table(runs: list[TargetRun], title: str = "agent trace replay") -> Table:
    t = Table(title=title)
    for col in (
        "engine",
        "turns",
        "errors",
        "total s",
        "TTFT p50 s",
        "p90 s",
        "p99 s",
        "later turn s",
        "prompt tok",
        "cached tok",
        "history recomputed",
        "out tok/s",
    ):
        t.add_column(col, justify="left" if col == "engine" else "right")
    for r in runs:
        s = r.stats
        share = "-" if s.recomputed_share is None else f"{100 * s.recomputed_share:.1f} %"
        if not s.cache_reported and s.history_tokens:
            share += " (no cache report)"
        elif s.turns_without_usage:
            share += f" ({s.turns_without_usage} turns without usage)"
        t.add_row(
            s.name,
            str(s.turns),
            str(s.errors),
            f"{s.wall_s:.1f}",
            _s(s.ttft_p50_s),
            _s(s.ttft_p90_s),
            _s(s.ttft_p99_s),
            _s(s.later_latency_p50_s),
            f"{s.prompt_tokens:,}",
            f"{s.cached_tokens:,}",
            share,
            f"{s.output_tok_per_s:.1f}",
        )
    return t


def print_table(runs: list[TargetRun], notes: list[str], console: Console | None = None) -> None:
    console = console or Console()
    console.print(table(runs))
    for n in notes:
        console.print(f"[yellow]note:[/] {escape(n)}")  # notes hold brackets: `[server]`


def write_json(path: Path, runs: list[TargetRun], meta: dict[str, Any], notes: list[str]) -> None:
    doc = {
        "meta": meta,
        "notes": notes,
        "runs": [
            {"stats": r.stats.to_json(), "server": r.server_stats, "turns": [rec.__dict__ for rec in r.records]}
            for r in runs
        ],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def plot_ttft(path: Path, runs: list[TargetRun], title: str = "time to first token by turn") -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    for r in runs:
        pts = [(i, v) for i, v in enumerate(r.stats.ttft_by_turn_s) if v is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", linewidth=1.2, label=r.stats.name)
    ax.set_xlabel("turn index")
    ax.set_ylabel("median time to first token (s)")
    ax.set_title(title)
    if any(v for r in runs for v in r.stats.ttft_by_turn_s if v):
        ax.set_yscale("log")  # cold and warm turns differ by orders of magnitude
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, which="both", alpha=0.3)
    if runs:
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
