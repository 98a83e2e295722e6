"""`agentbox bench`: owns the benchmark commands (agent trace replay, throughput, cache, grammar and the
kernel timings) over bench/. cli/main.py adds `bench_app`."""

from __future__ import annotations

from pathlib import Path

import typer

from agentbox.bench.tiny_models import TinyKind
from agentbox.cli.bench_replay import bench_replay
from agentbox.cli.common import fail
from agentbox.config import Speculative

bench_app = typer.Typer(help="Benchmarks: agent trace replay, throughput, cache.", no_args_is_help=True)


def _bench_model(model: str | None) -> str:
    """Benchmarks default to the embedded SmolLM2 (a fixed reference), not the machine's planned model."""
    if model:
        return model
    from agentbox.hub.embedded import INSTALL_HINT, embedded_model_path

    path = embedded_model_path()
    if path is None:
        fail(f"no --model given and the embedded SmolLM2 is not installed: {INSTALL_HINT}")
    return str(path)


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
    tp: int = typer.Option(1, "--tp", min=1, help="also run at this tensor-parallel size and compare with tp 1"),
    llamacpp: bool = typer.Option(False, "--llamacpp", help="also compare with llama.cpp's server on this GGUF (bench llamacpp)"),
    threads: int = typer.Option(1, "--threads", min=1, help="CPU threads for both engines in the --llamacpp comparison"),
    json_out: Path | None = typer.Option(None, "--json-out", help="also write the JSON here"),  # noqa: UP007
) -> None:
    """Prefill/decode tokens/s: our engine against transformers.

    Both run the same model; idle CPU too.
    With --tp N: the tp N / tp 1 decode step-time ratio, the per-step broadcast cost, and idle at tp N.
    With --llamacpp: single-stream rates against llama.cpp's server at --threads, as `bench llamacpp`."""
    from agentbox.bench.idle import measure_idle_cpu
    from agentbox.bench.throughput import compare_throughput, tp_comparison

    path = _bench_model(model)
    batches = tuple(sorted({1, *batch}))
    report = compare_throughput(path, tokens, prompt_len, batches, device="cpu", repeats=repeats)
    if tp > 1:
        report["tensor_parallel"] = tp_comparison(path, tp, tokens, prompt_len, batches, device="cpu", repeats=repeats)
    if llamacpp:
        from agentbox.bench.llamacpp import compare_llamacpp

        if not path.endswith(".gguf"):
            fail(f"--llamacpp needs a .gguf model (llama.cpp runs GGUF files), got {path}")
        report["llamacpp"] = compare_llamacpp(path, prompt_len, tokens, threads, max(2, repeats))
    if idle_seconds > 0:
        # A small pool: the default takes a share of free RAM, which is not what is being measured here.
        report["idle"] = measure_idle_cpu(path, idle_seconds, ["--device", "cpu", "--num-pages", "256", "--tp", str(tp)])
    _print_json(report, json_out)


@bench_app.command("soak")
def bench_soak(
    url: str | None = typer.Option(None, "--url", help="a running server (default: start one on --model)"),  # noqa: UP007
    model: str | None = typer.Option(None, "--model", help="HF model dir or .gguf (default: the embedded SmolLM2)"),  # noqa: UP007
    sessions: int = typer.Option(4, "--sessions", min=1, help="concurrent agent sessions"),
    minutes: float = typer.Option(1.0, "--minutes", min=0.05, help="how long to run"),
    max_tokens: int = typer.Option(16, "--max-tokens", min=1, help="tokens per answer"),
    json_out: Path | None = typer.Option(None, "--json-out", help="also write the JSON here"),  # noqa: UP007
) -> None:
    """Sessions with disconnects and bad requests mixed in, as JSON.

    N sessions for T minutes: requests answered, failures by type, pages leaked, RSS growth, the slowest
    /health answer, and whether the engine survived."""
    from agentbox.bench.soak import run_soak

    if url is not None:
        _print_json(run_soak(url.rstrip("/"), sessions, minutes, max_tokens), json_out)
        return
    from agentbox.bench.idle import serve_subprocess

    with serve_subprocess(_bench_model(model), ["--max-model-len", "4096"]) as (base, _):
        report = run_soak(base, sessions, minutes, max_tokens)
    _print_json(report, json_out)


@bench_app.command("step")
def bench_step(
    json_out: Path | None = typer.Option(None, "--json-out", help="also write the JSON here"),  # noqa: UP007
) -> None:
    """Host time per decode step, the model excluded.

    Scheduling + input preparation at 1k and 32k tokens of
    context, batch 1 and 32, on a tiny random model; the 32k/1k ratio should stay near 1. Then the whole
    decode step of the torch attention backend at 512, 4k and 8k tokens, its view path against its gather path."""
    from agentbox.bench.step_bench import decode_report, step_report

    report = step_report()
    report["torch_decode_step"] = decode_report()
    _print_json(report, json_out)
@bench_app.command("tiny-model")
def bench_tiny_model(
    out: Path = typer.Argument(..., help="directory to save it in (an HF directory `serve --model` takes)"),
    agent: bool = typer.Option(False, "--agent", help="end every turn at once, so a real client's turn finishes"),
    kind: TinyKind = typer.Option(TinyKind.DENSE, "--kind", help="without --agent: a Qwen3 (dense) or a Qwen3.5 (hybrid: Gated DeltaNet)"),
    context: int = typer.Option(131072, "--context", min=16, help="positions the model supports (its context)"),
) -> None:
    """Save a tiny random model with SmolLM2's tokenizer.

    For trying clients, servers and benchmarks on a CPU box without downloading weights (a few seconds,
    a few MiB). --agent: the turn-ending one; try a real client on it (docs/clients.md):
    agentbox bench tiny-model ~/tiny-agent --agent && agentbox serve --model ~/tiny-agent --max-model-len 65536"""
    from agentbox.bench.tiny_models import save_tiny, save_turn_ending, smollm2_tokenizer

    if agent and kind is not TinyKind.DENSE:
        fail("--agent makes a dense model only (a hybrid's recurrent state cannot be wired to end its turn)")
    if out.exists() and any(out.iterdir()):
        fail(f"{out} is not empty; pick a new directory")
    try:
        tok = smollm2_tokenizer()
    except RuntimeError as exc:
        fail(str(exc))
    out.mkdir(parents=True, exist_ok=True)
    if agent:
        save_turn_ending(out, tok, context)
    else:
        save_tiny(kind, out, tok, context)
    what = "turn-ending" if agent else f"random {kind.value}"
    typer.echo(f"saved a tiny {what} model with {context:,} positions in {out}")
    from agentbox.invocation import agentbox_cmd

    typer.echo(f"  serve it: {agentbox_cmd()} serve --model {out} --max-model-len {context}")


@bench_app.command("warm")
def bench_warm(
    contexts: list[int] = typer.Option([2048, 8192, 32768, 65536, 131072], "--context", help="conversation lengths in tokens (repeatable)"),
    warm_turns: int = typer.Option(5, "--warm-turns", min=1, help="warm turns per context; the median is kept"),
    http: bool = typer.Option(True, "--http/--no-http", help="also time cold and warm turns over HTTP on a served model"),
    prefill: bool = typer.Option(True, "--prefill/--no-prefill", help="also time cold prefill at 2k and 32k (SmolLM2-shaped)"),
    pause_ms: float = typer.Option(100.0, "--pause-ms", min=0, help="idle time before each paused warm turn (an agent's tool call); rounds back to back alternate with them"),
    json_out: Path | None = typer.Option(None, "--json-out", help="also write the JSON here"),  # noqa: UP007
) -> None:
    """Warm vs cold time to first token, by context length.

    On a tiny random 128k-context Qwen3. Host time of a warm turn by stage (parse, render, tokenize, lookup, schedule, forward), then cold
    chunked-prefill tokens/s at 2k and 32k on SmolLM2-shaped layers."""
    from agentbox.bench.warm import warm_report

    _print_json(warm_report(tuple(sorted(set(contexts))), warm_turns, http, prefill, pause_ms), json_out)


@bench_app.command("llamacpp")
def bench_llamacpp(
    model: str | None = typer.Option(None, "--model", help="a .gguf (default: the embedded SmolLM2)"),  # noqa: UP007
    tokens: int = typer.Option(64, "--tokens", min=2, help="tokens generated per request"),
    prompt_len: int = typer.Option(128, "--prompt-len", min=1, help="prompt tokens per request"),
    threads: int = typer.Option(1, "--threads", min=1, help="CPU threads for both engines (--server: llama-server's)"),
    repeats: int = typer.Option(2, "--repeats", min=1, help="requests per side; the fastest is kept"),
    default_only: bool = typer.Option(False, "--default-only", help="time only our default kernel, not dense / int4-cpu"),
    llama_server_path: str | None = typer.Option(None, "--llama-server", help="llama.cpp's llama-server binary (default: $AGENTBOX_LLAMA_SERVER, PATH, or one --build-server made)"),  # noqa: UP007
    build_server: bool = typer.Option(False, "--build-server", help="build llama-server from llama.cpp's source first (cmake; a few minutes)"),
    server: bool = typer.Option(False, "--server", help="the agent workload over HTTP instead: sessions x turns over a shared prompt, against llama-server's slots"),
    sessions: list[int] = typer.Option([1, 4], "--sessions", help="--server: session counts to run (repeatable)"),
    turns: int = typer.Option(8, "--turns", min=2, help="--server: turns per session"),
    convert: str | None = typer.Option(None, "--convert", help="an HF checkpoint folder to convert with llama.cpp's own converter (f16) and compare on"),  # noqa: UP007
    serve_arg: list[str] = typer.Option([], "--serve-arg", help="--server: an argument for agentbox serve (repeatable), e.g. --serve-arg=--speculative=off"),
    out: str | None = typer.Option(None, "--out", help="--server: folder for the servers' logs (default: a new one in the system's temporary folder)"),  # noqa: UP007
    json_out: Path | None = typer.Option(None, "--json-out", help="also write the JSON here"),  # noqa: UP007
) -> None:
    """Our engine against llama.cpp's llama-server on one GGUF.

    Single stream: prefill and decode per kernel at the same thread count. With --server: the agent workload
    (1 and 4 sessions x 8 turns over a 2,000-token prompt) against llama-server with -np N, its default slot
    matching and -sps 0: wall time, history reused, later-turn first token, decode tok/s."""
    import tempfile
    import time

    from agentbox.bench import llama_server

    try:
        binary = llama_server.build() if build_server else llama_server.find_binary(llama_server_path)
    except (FileNotFoundError, RuntimeError) as e:
        fail(str(e))
    gguf = _converted(convert) if convert else _bench_model(model)
    if server:
        from agentbox.bench.llamacpp_agents import AgentWorkload, compare_agents

        workload = AgentWorkload(sessions=tuple(sorted(set(sessions))), turns=turns)
        # Not in the working tree: a run's logs are not results (several runs' logs were committed by mistake).
        out_dir = Path(out or tempfile.mkdtemp(prefix=f"agentbox-llamacpp-agents-{time.strftime('%Y%m%d-%H%M%S')}-"))
        report = compare_agents(gguf, binary, out_dir, workload, threads=threads, serve_args=serve_arg)
    else:
        from agentbox.bench.llamacpp import compare_llamacpp

        report = compare_llamacpp(gguf, prompt_len, tokens, threads, repeats, default_only=default_only, binary=binary)
    _print_json(report, json_out)


def _converted(hf_dir: str) -> str:
    """`hf_dir` written as an f16 GGUF by llama.cpp's converter (cached beside it in the llama.cpp cache)."""
    import subprocess
    import sys

    from agentbox.bench import llama_server

    src = Path(hf_dir).expanduser()
    if not (src / "config.json").is_file():
        fail(f"--convert {hf_dir}: no config.json there (an HF checkpoint folder is needed)")
    tree = llama_server.vendored_tree(llama_server.cache_root(), converter_only=True)
    if tree is None:
        fail("llama.cpp's converter is not here and pip could not download the llama-cpp-python 0.3.36 sdist; "
             f"set {llama_server.ENV_SDIST} to a copy")
    target = llama_server.cache_root() / "converted" / f"{src.resolve().name}-f16.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        # --no-mtp: the draft layers stay out of the comparison (agentbox drafts from GGUF with suffix only), and
        # the converter refuses a Qwen3.5 whose config names no MTP layer without it.
        done = subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(src), "--outfile", str(target),
                               "--outtype", "f16", "--no-mtp"], capture_output=True, text=True)
        if done.returncode:
            fail(f"llama.cpp's converter failed on {src}:\n{(done.stdout + done.stderr)[-2000:]}")
    return str(target)


@bench_app.command("spec")
def bench_spec(
    model: str | None = typer.Option(None, "--model", help="HF model dir or .gguf (default: the embedded SmolLM2)"),  # noqa: UP007
    speculative: Speculative = typer.Option(Speculative.AUTO, help="the draft mode compared with off"),
    max_tokens: int = typer.Option(256, "--max-tokens", min=2, help="tokens generated per request"),
    repeats: int = typer.Option(2, "--repeats", min=1, help="runs per side; the fastest decode is kept"),
    exact_cpu: bool = typer.Option(False, "--exact-cpu", help="CPU: dequantised layers (exact fp32)"),
    workloads: Path | None = typer.Option(None, "--workloads", help="JSON {name: [token ids]} to run instead"),  # noqa: UP007
    json_out: Path | None = typer.Option(None, "--json-out", help="also write the JSON here"),  # noqa: UP007
) -> None:
    """Decode tok/s with and without speculative decoding.

    Edit, tool-call and prose workloads in the same run, with the acceptance rate, tokens per step
    and each draft source's accepted tokens per step (--speculative mtp: the model's own MTP head)."""
    from agentbox.bench.spec import spec_report

    if speculative is Speculative.OFF:
        fail("--speculative off compares nothing: pick auto, suffix, ngram or mtp")
    import json

    prompts = None
    if workloads is not None:
        try:
            prompts = {str(k): [int(t) for t in v] for k, v in json.loads(workloads.read_text()).items()}
        except (OSError, ValueError, TypeError, AttributeError) as e:
            fail(f"--workloads {workloads}: not a JSON object of name -> token ids ({e})")
    _print_json(spec_report(_bench_model(model), speculative, max_tokens, repeats, exact_cpu, prompts), json_out)


@bench_app.command("cpu-rows")
def bench_cpu_rows(
    threads: int = typer.Option(1, "--threads", min=1, help="CPU threads"),
    json_out: Path | None = typer.Option(None, "--json-out", help="also write the JSON here"),  # noqa: UP007
    isa: str | None = typer.Option(None, "--isa", help="kernel variant to run (avx512-amx, avx512-vnni, avx-vnni, avx2; default: the picked one)"),  # noqa: UP007
) -> None:
    """Per-row cost of the CPU kernels at 1 to 16 rows.

    Per GGUF type, weights cold, at 1, 2, 4, 8 and 16 rows, with the CPU and the kernel variant named."""
    from agentbox.bench.cpu_rows import report
    from agentbox.kernels.cpu_gemv import Isa, cpu_flags

    variants = ", ".join(i.value for i in Isa)
    variant = next((i for i in Isa if i.value == isa), None)
    if isa is not None and variant is None:
        fail(f"--isa {isa}: pick one of {variants}")
    if variant is not None and not variant.cpu_flags <= cpu_flags():
        fail(f"--isa {isa}: this CPU lacks {', '.join(sorted(variant.cpu_flags - cpu_flags()))}")
    _print_json(report(threads=threads, isa=variant), json_out)


@bench_app.command("cache")
def bench_cache(
    model: str | None = typer.Option(None, "--model", help="HF model dir or .gguf (default: the embedded SmolLM2)"),  # noqa: UP007
    prefix_tokens: int = typer.Option(6000, "--prefix-tokens", min=16, help="tokens of the shared prefix"),
    json_out: Path | None = typer.Option(None, "--json-out", help="also write the JSON here"),  # noqa: UP007
) -> None:
    """Cold vs warm time to first token on a long prefix.

    And the hit rate on a byte-identical prefix."""
    from agentbox.bench.cache_bench import cache_report

    _print_json(cache_report(_bench_model(model), prefix_tokens), json_out)


# `replay` lives in cli/bench_replay.py (its options are half this file); listed here, after `cache`.
bench_app.command("replay")(bench_replay)


@bench_app.command("restart")
def bench_restart_cmd(
    model: str = typer.Option(None, help="HF model dir or .gguf (default: the embedded SmolLM2)"),
    sessions: int = typer.Option(3, help="synthetic sessions"),
    turns: int = typer.Option(6, help="turns per session"),
    restart_after: int = typer.Option(3, help="stop and start the server after this many turns"),
    scale: float = typer.Option(0.05, help="multiply every token size of the synthetic trace"),
    num_pages: int = typer.Option(None, help="KV pool pages"),
    json_out: Path | None = typer.Option(None, "--json-out", help="also write the JSON here"),  # noqa: UP007
) -> None:
    """Recomputed history when the server restarts mid-replay.

    Next to the same replay without a restart, and with --no-restore. A graceful stop writes the cache to
    disk; the next start reads it."""
    import json
    import time

    from agentbox.bench import compare, synth
    from agentbox.bench.restart import bench_restart

    if not 0 < restart_after < turns:
        raise typer.BadParameter(f"--restart-after must be between 1 and --turns - 1 (got {restart_after})")
    cfg = synth.SynthConfig(sessions=sessions, turns=turns, turn_sigma=0.0, scale=scale, wait=0.0)
    trace = compare.build_trace(trace_file=None, openhands_file=None, synth_cfg=cfg, sessions=sessions,
                                turns=turns, wait=0.0, seed=0)
    extra = ["--num-pages", str(num_pages)] if num_pages else []
    out = Path(f"bench/results/restart-{time.strftime('%Y%m%d-%H%M%S')}")
    result = bench_restart(trace, _bench_model(model), extra, restart_after, out)
    text = json.dumps(result, indent=2)
    typer.echo(text)
    if json_out is not None:
        json_out.write_text(text)


@bench_app.command("grammar")
def bench_grammar_cmd(
    model: str | None = typer.Option(None, help="tokenizer source (default: the embedded SmolLM2)"),
    parser: str = typer.Option("hermes", help="tool-call syntax to compile for"),
    num_tools: int = typer.Option(8, help="tools in the compiled set"),
    tokens: int = typer.Option(256, help="tokens to mask in the overhead measurement"),
) -> None:
    """Grammar compile time and per-token mask overhead, as JSON.

    Compile time uncached and cached."""
    import json

    from agentbox.bench.grammar import bench_grammar
    from agentbox.models.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(_bench_model(model))) if model else None
    typer.echo(json.dumps(bench_grammar(tok, parser=parser, num_tools=num_tools, tokens=tokens), indent=2))


@bench_app.command("agreement")
def bench_agreement(
    arch: list[str] = typer.Option([], "--arch", help="architectures to run (repeatable; default all: bench/agreement.py ARCHS)"),
    positions: int = typer.Option(256, "--positions", min=1, help="teacher-forced positions per architecture"),
    models_dir: Path | None = typer.Option(None, "--models-dir", help="keep the tiny models here (default: a temporary dir)"),  # noqa: UP007
    json_out: Path | None = typer.Option(None, "--json-out", help="also write the JSON here"),  # noqa: UP007
) -> None:
    """Default CPU path against --exact-cpu: top-1 agreement.

    Per architecture, teacher-forced over the same positions, as JSON."""
    from agentbox.bench.agreement import ARCHS, agreement_report

    if unknown := set(arch) - set(ARCHS):
        fail(f"unknown --arch {sorted(unknown)}: one of {', '.join(ARCHS)}")
    _print_json(agreement_report(arch or list(ARCHS), positions, models_dir), json_out)
