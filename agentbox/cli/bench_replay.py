"""`agentbox bench replay`: concurrent agent sessions (a trace file, an OpenHands trajectory or a seeded synthetic
trace) replayed against servers it is given or starts (agentbox per cache policy, tiny models, llama-server).
cli/bench.py registers it on `bench_app`."""

from __future__ import annotations

import typer

from agentbox.cli.common import fail
from agentbox.config import CachePolicy


def _policies(policies: str) -> list[str]:
    """`--policies` as cache policy names, checked."""
    choices = ", ".join(p.value for p in CachePolicy)
    try:
        wanted = [CachePolicy(p.strip()).value for p in policies.split(",") if p.strip()]
    except ValueError:
        wanted = []
    if not wanted:
        raise typer.BadParameter(f"--policies: a comma-separated subset of {choices}")
    return wanted


def _spawn_args(num_pages: int | None, serve_arg: list[str] | None) -> list[str]:
    return [*(["--num-pages", str(num_pages)] if num_pages else []), *(serve_arg or [])]


def bench_replay(
    trace_file: str = typer.Option(None, "--trace", help="A trace JSONL file (docs/bench.md)."),
    openhands_file: str = typer.Option(None, "--openhands", help="An OpenHands-style trajectory file."),
    synthetic: bool = typer.Option(False, "--synthetic", help="A seeded synthetic trace (the default)."),
    sessions: int = typer.Option(None, help="Sessions (synthetic: how many; files: the first N)."),
    turns: int = typer.Option(None, help="Synthetic: median turns per session; files: the first N turns."),
    turn_spread: float = typer.Option(
        None, help="Synthetic: log-normal spread of turn counts (0: all equal)."
    ),
    scale: float = typer.Option(None, help="Synthetic: multiply every token size (0.1 for a CPU run)."),
    result_scale: float = typer.Option(None, help="Synthetic: multiply tool result sizes."),
    prefix_tokens: int = typer.Option(None, help="Synthetic: system prompt + tools size before --scale."),
    max_context: int = typer.Option(None, help="Synthetic: end a session before its history passes this."),
    wait: str = typer.Option(None, help="Tool wait: 'lognormal' (median ~0.42 s) or seconds (0.5, 5, 60)."),
    seed: int = typer.Option(0, help="Seed of the synthetic trace and sampled waits."),
    url: str = typer.Option(None, help="An OpenAI-compatible server to replay against."),
    target: list[str] = typer.Option(None, "--target", help="NAME=URL of another server (repeatable)."),
    spawn: bool = typer.Option(False, help="Start agentbox once per --policies value."),
    tiny: bool = typer.Option(
        False, help="Also start agentbox on a tiny random hybrid and dense model, per policy."
    ),
    model: str = typer.Option(None, help="Model for --spawn (a path or a profile name)."),
    policies: str = typer.Option(
        ",".join(p.value for p in CachePolicy), help="Cache policies for --spawn, comma separated."
    ),
    num_pages: int = typer.Option(None, help="--spawn: KV pool pages (set it so histories do not all fit)."),
    serve_arg: list[str] = typer.Option(
        None, "--serve-arg", help="--spawn: extra `serve` argument (repeatable)."
    ),
    llamacpp: str = typer.Option(
        None, help="Also start llama.cpp's llama-server on this GGUF (once per --llamacpp-sps value)."
    ),
    llamacpp_ctx: int = typer.Option(8192, help="llama-server context per slot."),
    llamacpp_slots: int = typer.Option(None, help="llama-server -np (default: one slot per session)."),
    llamacpp_sps: str = typer.Option(
        "0,default", help="llama-server -sps values, comma separated ('default': its own 0.10)."
    ),
    llama_server_path: str = typer.Option(
        None, "--llama-server", help="llama-server binary (default: $AGENTBOX_LLAMA_SERVER or PATH)."
    ),
    llamacpp_threads: int = typer.Option(None, help="llama-server -t (default: every core)."),
    served_model: str = typer.Option(None, help="Model name to request (default: the server's first)."),
    flatten_tools: bool = typer.Option(
        False, help="Send tools and tool turns as plain text, for every engine."
    ),
    force_length: bool = typer.Option(
        True, help="Send ignore_eos/min_tokens so answers have the recorded length."
    ),
    max_concurrency: int = typer.Option(None, help="Cap on sessions in flight (default: all at once)."),
    compare_spec: bool = typer.Option(False, help="--spawn/--tiny: also each with --speculative off."),
    save_trace: str = typer.Option(None, help="Also write the replayed trace to this JSONL file."),
    out: str = typer.Option(None, help="Output folder (default: bench/results/replay-<time>)."),
) -> None:
    """Replay concurrent agent sessions against a server.

    Reports total time, time to first token and recomputed history."""
    import shutil
    import sys
    import tempfile
    import time
    from dataclasses import fields, replace
    from pathlib import Path

    from agentbox import trace
    from agentbox.bench import compare, synth
    from agentbox.bench import spawn as spawning
    from agentbox.bench.replay import ReplayOptions

    if trace_file and openhands_file:
        raise typer.BadParameter("pass one of --trace and --openhands")
    if synthetic and (trace_file or openhands_file):
        raise typer.BadParameter("--synthetic replaces --trace / --openhands")
    wait_value: str | float | None = None
    if wait is not None:
        try:
            wait_value = "lognormal" if wait == "lognormal" else float(wait)
        except ValueError as e:
            raise typer.BadParameter(f"--wait wants 'lognormal' or seconds, got {wait!r}") from e
    knobs = {
        "sessions": sessions,
        "turns": turns,
        "turn_sigma": turn_spread,
        "scale": scale,
        "result_scale": result_scale,
        "prefix_tokens": prefix_tokens,
        "max_context_tokens": max_context,
        "wait": wait_value,
        "seed": seed,
    }
    cfg = replace(
        synth.SynthConfig(),
        **{f.name: knobs[f.name] for f in fields(synth.SynthConfig) if knobs.get(f.name) is not None},
    )
    sessions_list = compare.build_trace(
        trace_file=Path(trace_file) if trace_file else None,
        openhands_file=Path(openhands_file) if openhands_file else None,
        synth_cfg=cfg,
        sessions=sessions,
        turns=turns,
        wait=wait_value,
        seed=seed,
    )
    if flatten_tools:
        sessions_list = trace.flatten_tools(sessions_list)
    if save_trace:
        trace.save(sessions_list, save_trace)

    targets: list[spawning.Target] = []
    if url:
        targets.append(spawning.Target(name="server", url=url))
    try:
        targets += [spawning.parse_target(t) for t in target or []]
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    if spawn:
        if not model:
            raise typer.BadParameter("--spawn needs --model")
        targets += [
            spawning.agentbox_target(model, p, _spawn_args(num_pages, serve_arg)) for p in _policies(policies)
        ]
    models_dir = None
    if tiny:
        from agentbox.bench.tiny_models import tiny_targets

        models_dir = Path(
            tempfile.mkdtemp(prefix="agentbox-tiny-")
        )  # the tiny checkpoints: removed at the end
        try:
            targets += tiny_targets(models_dir, _policies(policies), _spawn_args(num_pages, serve_arg))
        except RuntimeError as e:
            fail(str(e))
    if compare_spec:
        targets = spawning.with_speculation_off(targets)
    if llamacpp:
        import os

        from agentbox.bench import llama_server

        try:
            binary = llama_server.find_binary(llama_server_path)
            similarities = llama_server.parse_similarities(llamacpp_sps)
        except (FileNotFoundError, ValueError) as e:
            raise typer.BadParameter(str(e)) from e
        for similarity in similarities:
            slots = llama_server.Slots(llamacpp_slots or len(sessions_list), similarity)
            targets.append(
                llama_server.target(
                    binary, llamacpp, llamacpp_ctx, llamacpp_threads or os.cpu_count() or 1, slots
                )
                if binary is not None
                else llama_server.missing_target(slots)
            )
    if not targets:
        raise typer.BadParameter(
            "nothing to replay against: pass --url, --target, --spawn, --tiny or --llamacpp"
        )

    out_dir = Path(out or f"bench/results/replay-{time.strftime('%Y%m%d-%H%M%S')}")
    options = ReplayOptions(model=served_model, force_length=force_length, max_concurrency=max_concurrency)
    meta = {
        "command": " ".join(["agentbox", *sys.argv[1:]]),
        "trace": compare.describe(sessions_list),
        "source": trace_file or openhands_file or "synthetic",
        "synth": {f.name: getattr(cfg, f.name) for f in fields(cfg)}
        if not (trace_file or openhands_file)
        else None,
    }
    from agentbox.cli.console import console

    try:
        runs, _ = compare.compare(sessions_list, targets, options, out_dir, meta, console())
    finally:
        if models_dir is not None:
            shutil.rmtree(models_dir, ignore_errors=True)
    if not runs:
        raise typer.Exit(1)
