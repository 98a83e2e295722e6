"""Engine deaths, restarts and stops, on a real server (the daemon entry point, as `agentbox serve` starts
it) over a tiny random Llama: the restart budget is per time window and an exhausted one exits non-zero;
during a restart every route answers JSON 503 with Retry-After in its API's shape; SIGTERM ends open streams
with an error event and [DONE]; the API key reaches the server through its environment, never its argv."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from agentbox.bench.spawn import spawned
from agentbox.config import EngineConfig, ServerConfig
from tests.word_tokenizer import save_word_tokenizer

pytestmark = pytest.mark.slow
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=4096, rms_norm_eps=1e-6)
KEY, KEY2 = "k-" + "3" * 30, "k-" + "4" * 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:

    path = tmp_path_factory.mktemp("tiny-restart")
    save_word_tokenizer(path, TINY["vocab_size"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])).save_pretrained(path)
    return path


@contextmanager
def serve(model: Path, tmp_path: Path, **engine: object) -> Iterator[tuple[str, object]]:
    config = ServerConfig(engine=EngineConfig(model=str(model), device="cpu", dtype="float32", num_pages=128,
                                              max_num_seqs=4, cpu_threads=1, **engine))  # type: ignore[arg-type]
    arg = json.dumps(dataclasses.asdict(config)).replace('"port": 8000', '"port": {port}')
    with spawned([sys.executable, "-m", "agentbox.cli.daemon", arg], tmp_path / "serve.log") as (url, proc):
        yield url, proc


def auth() -> dict[str, str]:
    return {"authorization": f"Bearer {KEY}"}


def engine_pid(url: str) -> int:
    return httpx.get(url + "/v1/stats", headers=auth(), timeout=30).json()["engine_pid"]


def kill_engine(url: str) -> int:
    pid = engine_pid(url)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while httpx.get(url + "/health", timeout=30).status_code != 503:  # the server noticed
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return pid


def wait_healthy(url: str, old_pid: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        r = httpx.get(url + "/health", timeout=30)
        if r.status_code == 200:
            assert engine_pid(url) != old_pid
            return
        assert time.monotonic() < deadline, r.text
        time.sleep(0.1)


def completion(stream: bool = False, max_tokens: int = 4) -> dict:
    return {"model": "tiny", "prompt": "w5 w6 w7", "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def test_budget_exhausted_within_the_window_exits_nonzero(tiny: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTBOX_API_KEY", f"{KEY},{KEY2}")
    with serve(tiny, tmp_path, max_restarts=3, restart_window_s=600.0) as (url, proc):
        name = httpx.get(url + "/health").json()["model"]
        # The key is in the server's environment, not in its command line (`ps` shows every user argv).
        assert KEY not in " ".join(psutil.Process(proc.pid).cmdline())  # type: ignore[attr-defined]
        assert httpx.get(url + "/v1/stats").status_code == 401
        body = {**completion(), "model": name}
        # Two keys: each sees and deletes only its own sessions.
        other = {"authorization": f"Bearer {KEY2}"}
        r = httpx.post(url + "/v1/completions", json=body, headers={**auth(), "x-session-id": "mine"})
        assert r.status_code == 200
        assert [s["id"] for s in httpx.get(url + "/v1/sessions", headers=auth()).json()["data"]] == ["mine"]
        assert httpx.get(url + "/v1/sessions", headers=other).json()["data"] == []
        assert httpx.delete(url + "/v1/sessions/mine", headers=other).status_code == 404
        assert httpx.get(url + "/v1/sessions/mine", headers=auth()).json()["id"] == "mine"
        for death in range(1, 4):
            old = kill_engine(url)
            if death == 1:  # mid-restart: JSON 503 with Retry-After on every route, in its API's shape
                r = httpx.post(url + "/v1/completions", json=body, headers=auth())
                assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["message"]
                r = httpx.post(url + "/v1/messages", headers=auth(), json={
                    "model": name, "max_tokens": 4, "messages": [{"role": "user", "content": "w5"}]})
                assert r.status_code == 503 and r.headers["retry-after"] and r.json()["type"] == "error"
                for path in ("/v1/stats", "/v1/sessions", "/metrics"):
                    r = httpx.get(url + path, headers=auth())
                    assert r.status_code == 503 and r.headers["retry-after"] and "error" in r.json(), path
            wait_healthy(url, old)
            assert httpx.post(url + "/v1/completions", json=body, headers=auth()).status_code == 200
        os.kill(engine_pid(url), signal.SIGKILL)  # the fourth death within 600 s: past the budget of three
        assert proc.wait(timeout=60) == 1  # type: ignore[attr-defined]


def test_deaths_spread_beyond_the_window_are_restarted(tiny: Path, tmp_path: Path) -> None:
    # A budget of two: three deaths within one window would exit; spread beyond it, each is alone in it
    # (a restart takes longer than the window).
    with serve(tiny, tmp_path, max_restarts=2, restart_window_s=0.5) as (url, proc):
        for _ in range(3):
            old = kill_engine(url)
            wait_healthy(url, old)
        assert proc.poll() is None  # type: ignore[attr-defined]
        name = httpx.get(url + "/health").json()["model"]

        # SIGTERM with a stream open: the stream gets a typed error event and [DONE], then the server exits 0.
        lines: list[str] = []

        def read() -> None:
            with httpx.stream("POST", url + "/v1/completions", json={**completion(True, 3000), "model": name},
                              timeout=60) as r:
                lines.extend(line for line in r.iter_lines() if line.startswith("data:"))

        t = threading.Thread(target=read)
        t.start()
        deadline = time.monotonic() + 30
        while len(lines) < 3:
            assert time.monotonic() < deadline and t.is_alive(), lines
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # type: ignore[attr-defined]
        t.join(30)
        assert not t.is_alive()
        assert lines[-1] == "data: [DONE]"
        err = json.loads(lines[-2][5:])["error"]
        assert err["code"] == "engine_unavailable" and "shutting down" in err["message"]
        # A clean stop: 0, or the SIGTERM itself, which uvicorn re-raises once it has shut down.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)  # type: ignore[attr-defined]
