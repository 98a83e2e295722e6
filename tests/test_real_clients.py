"""The real agent clients, as themselves, through `agentbox launch`: pinned Claude Code and Codex CLIs (npm)
and aider (PyPI, its own venv), cached under ~/.cache/agentbox-test-clients between runs (first install:
about 40 s for the two npm packages, 2.5 min for aider on 2 cores; skipped with the reason where npm or the
network is absent). The model is a tiny random Qwen3-shaped one with 64k positions and SmolLM2's tokenizer
(whose template has no tools section, so the tools fallback is on the path), wired to end its turn: a
constant dimension of the residual stream that only the end-of-turn row of the head reads. Each client runs
two non-interactive turns: both complete without an API error, the prompt the server saw carries the
client's tools, and a later request reports cached tokens."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from agentbox.bench.tiny_models import save_turn_ending

pytestmark = pytest.mark.slow
# Under the user's cache (conftest keeps XDG_CACHE_HOME theirs while HOME is a fake one)
CACHE = Path(os.environ.get("AGENTBOX_TEST_CLIENTS", Path(os.environ["XDG_CACHE_HOME"]) / "agentbox-test-clients"))
NPM_PINS = {"claude": "@anthropic-ai/claude-code@2.1.332", "codex": "@openai/codex@0.171.0",
            "opencode": "opencode-ai@1.18.33"}
AIDER_PIN = "aider-chat==0.86.2"


def npm_bin(name: str) -> Path:
    """The pinned npm client, installed into the cache on first use."""
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: the Claude Code and Codex CLIs come from npm")
    exe = CACHE / "npm" / "node_modules" / ".bin" / name
    if not exe.exists():
        (CACHE / "npm").mkdir(parents=True, exist_ok=True)
        r = subprocess.run(["npm", "install", "--prefix", str(CACHE / "npm"), "--no-audit", "--no-fund",
                            *NPM_PINS.values()], capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            pytest.skip(f"npm could not install {', '.join(NPM_PINS.values())}: {r.stderr[-400:]}")
    return exe


def aider_bin() -> Path:
    """aider in its own cached venv (its pins must not touch the project's)."""
    venv = CACHE / "aider-venv"
    exe = venv / "bin" / "aider"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", AIDER_PIN], capture_output=True, text=True,
                           timeout=1200)
        if r.returncode != 0:
            pytest.skip(f"pip could not install {AIDER_PIN}: {r.stderr[-400:]}")
    return exe


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:  # noqa: ANN001
    return save_turn_ending(tmp_path_factory.mktemp("tiny-qwen3-64k"), smollm2_tokenizer, 65536)


@contextmanager
def serving(model: Path, home: Path, *extra: str) -> Iterator[tuple[str, dict, Path, Path]]:
    """`agentbox serve` of `model` with its own state dir and HOME under `home`, stopped on exit."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (home / "home").mkdir()
    (home / "work").mkdir()
    env = {**os.environ, "AGENTBOX_HOME": str(home / "state"), "HOME": str(home / "home")}
    trace = home / "trace.jsonl"
    r = subprocess.run([sys.executable, "-m", "agentbox.cli.main", "serve", "--model", str(model), "--port", str(port),
                        "--max-num-batched-tokens", "4096", "--record-trace", str(trace), *extra],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    try:
        yield f"http://127.0.0.1:{port}", env, home, trace
    finally:
        subprocess.run([sys.executable, "-m", "agentbox.cli.main", "stop"], env=env, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    with serving(tiny_qwen3, tmp_path_factory.mktemp("real-clients"), "--num-pages", "8192") as s:
        yield s


def launch(server: tuple, exe: Path, client: str, *args: str) -> subprocess.CompletedProcess:
    _, env, home, _ = server
    env = {**env, "PATH": f"{exe.parent}{os.pathsep}{env['PATH']}"}
    return subprocess.run([sys.executable, "-m", "agentbox.cli.main", "launch", client, *args], env=env, cwd=home / "work",
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)


def counters(server: tuple) -> dict:
    return httpx.get(server[0] + "/v1/stats", timeout=10).json()["counters"]


def assert_turns_ok(server: tuple, before: dict, tool_name: str | None, min_prompt: int) -> None:
    """The client's tools reached the prompt (the trace holds them; the prompts are as long as a prompt
    carrying them), and a later request was served from the cache."""
    after = counters(server)
    trace = server[3].read_text() if server[3].exists() else ""
    if tool_name is not None:
        assert f'"{tool_name}"' in trace, trace[:2000]
    prompts = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    print(f"{tool_name}: {after['requests'] - before['requests']} requests, {prompts} prompt tokens, {cached} cached")
    assert after["requests"] - before["requests"] >= 2 and prompts >= 2 * min_prompt, (before, after)
    assert after["cached_tokens"] - before["cached_tokens"] >= min_prompt // 2, (before, after)


def test_claude_code(server: tuple) -> None:
    exe = npm_bin("claude")
    before = counters(server)
    for prompt in ("Say hello.", "Say hello again."):
        r = launch(server, exe, "claude", "--force", "-p", prompt)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert "API Error" not in r.stdout + r.stderr
    assert_turns_ok(server, before, "Bash", 10_000)


def test_codex(server: tuple) -> None:
    exe = npm_bin("codex")
    before = counters(server)
    for prompt in ("Say hello.", "Say hello again."):
        r = launch(server, exe, "codex", "exec", "--skip-git-repo-check", prompt)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert "stream error" not in (r.stdout + r.stderr).lower()
    assert_turns_ok(server, before, "shell", 2_000)


def test_aider(server: tuple) -> None:
    exe = aider_bin()
    before = counters(server)
    for prompt in ("Say hello.", "Say hello again."):
        r = launch(server, exe, "aider", "--message", prompt, "--yes-always", "--no-git", "--no-auto-commits",
                   "--no-pretty", "--no-stream")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert "litellm.APIError" not in r.stdout + r.stderr
    assert_turns_ok(server, before, None, 500)  # aider edits through text formats: it sends no tools


def test_opencode(server: tuple) -> None:
    exe = npm_bin("opencode")
    before = counters(server)
    for prompt in ("Say hello.", "Say hello again."):
        r = launch(server, exe, "opencode", "run", prompt)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert "Error" not in r.stdout + r.stderr and "note:" not in r.stderr  # 64k: nothing adapted
    assert_turns_ok(server, before, "todowrite", 7_000)


def test_opencode_on_a_12k_context_ends_its_turn(tiny_qwen3: Path, tmp_path: Path) -> None:
    """At 12k opencode's own 7.7k-token prompt is past the point where it compacts at its usual output limit: it
    used to compact and resend forever. launch lowers its output limit (compaction stays on), and the turn ends."""
    exe = npm_bin("opencode")
    with serving(tiny_qwen3, tmp_path, "--max-model-len", "12288") as srv:
        try:
            r = launch(srv, exe, "opencode", "run", "say hi")
        except subprocess.TimeoutExpired:  # a loop, or a slow start on a busy machine: the count tells
            pytest.fail(f"opencode did not finish; the server saw {counters(srv)['requests']} requests")
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert "it is told an output limit of" in r.stderr and "Error" not in r.stdout + r.stderr
        # a title request and the turn: no compaction requests, no resends
        assert counters(srv)["requests"] <= 3, counters(srv)


def test_codex_follows_the_served_model_without_a_second_setup(tiny_qwen3: Path, tmp_path: Path,
                                                               smollm2_tokenizer) -> None:  # noqa: ANN001
    """`agentbox setup codex` once, on one model; `agentbox serve` of another (another context) re-syncs the
    config it wrote; plain `codex exec`, as a user runs it, then succeeds against the new model."""
    exe = npm_bin("codex")
    other = save_turn_ending(tmp_path / "tiny-32k", smollm2_tokenizer, 32768)
    home = tmp_path / "user"
    home.mkdir()
    with serving(tiny_qwen3, home, "--max-model-len", "65536") as srv:
        env = srv[1]
        setup = subprocess.run([sys.executable, "-m", "agentbox.cli.main", "setup", "codex"], env=env,
                               capture_output=True, text=True, timeout=120)
        assert setup.returncode == 0, setup.stderr
    again = subprocess.run([sys.executable, "-m", "agentbox.cli.main", "serve", "--model", str(other), "--port",
                            srv[0].rsplit(":", 1)[1]], env=env, capture_output=True, text=True, timeout=600)
    try:
        assert again.returncode == 0, again.stderr
        assert "clients: codex: updated" in again.stdout and "for context 32,768" in again.stdout, again.stdout
        config = (home / "home" / ".codex" / "config.toml").read_text()
        assert 'model = "agentbox"' in config and "model_context_window = 32768" in config
        before = counters(srv)
        r = subprocess.run([str(exe), "exec", "--skip-git-repo-check", "Say hello."], cwd=home / "work",
                           env={**env, "PATH": f"{exe.parent}{os.pathsep}{env['PATH']}"}, capture_output=True,
                           text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert "not served here" not in r.stdout + r.stderr and "stream error" not in (r.stdout + r.stderr).lower()
        assert counters(srv)["requests"] > before["requests"]
        assert httpx.get(srv[0] + "/health", timeout=10).json()["model"] == "tiny-32k"
    finally:
        subprocess.run([sys.executable, "-m", "agentbox.cli.main", "stop"], env=env, capture_output=True, timeout=60)
