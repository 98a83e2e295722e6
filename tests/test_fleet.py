"""Two real agentbox servers behind `agentbox fleet` (the real vllm-router) on loopback: Claude-Code-shaped
(messages + metadata.user_id), Codex-shaped (responses + `session-id` + the routing header setup writes) and
chat-shaped (opencode / aider as set up) sessions, 8 of each. Every session stays on one backend and later
turns read their history from its cache; a SIGKILLed backend costs its sessions a cold turn on the survivor,
not an error; restarted, it is back in rotation.

The model is a tiny random Qwen3 that ends every turn at once (the prompt is what is measured here), with
SmolLM2's tokenizer. Which backend served a request: the X-Agentbox-Server header each server adds."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import anthropic
import httpx
import openai
import psutil
import pytest

from agentbox import fleet as fleet_mod
from agentbox.bench.tiny_models import save_turn_ending
from agentbox.clients.routing import routing_headers
from agentbox.config import CPU_PAGE_SIZE
from agentbox.server.backend_header import HEADER
from agentbox.tui.fleet_view import fleet_once

pytestmark = pytest.mark.slow
if fleet_mod.shutil.which(fleet_mod.ROUTER_EXE) is None and not (Path(sys.executable).parent / fleet_mod.ROUTER_EXE).exists():
    pytest.skip(f"vllm-router not installed: {fleet_mod.INSTALL_HINT}", allow_module_level=True)

SESSIONS = 8  # of each shape
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:  # noqa: ANN001
    return save_turn_ending(tmp_path_factory.mktemp("tiny-qwen3-fleet"), smollm2_tokenizer, 8192)


@dataclass
class Backend:
    url: str
    port: int
    env: dict[str, str]

    def serve(self, model: Path) -> None:
        r = subprocess.run([sys.executable, "-m", "agentbox.cli.main", "serve", "--model", str(model), "--port", str(self.port),
                            "--num-pages", str(32768 // CPU_PAGE_SIZE), "--max-model-len", "4096"],
                           env=self.env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr

    def kill(self) -> None:
        """SIGKILL the whole server (API process, engine core): a machine that dies, not a clean stop."""
        pid = json.loads((Path(self.env["AGENTBOX_HOME"]) / "server.json").read_text())["pid"]
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        for p in procs:
            p.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=10)

    def stop(self) -> None:
        subprocess.run([sys.executable, "-m", "agentbox.cli.main", "stop"], env=self.env, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    root = tmp_path_factory.mktemp("fleet")
    backends = []
    for i in range(2):
        port = fleet_mod.free_port()
        backends.append(Backend(f"http://127.0.0.1:{port}", port, {**os.environ, "AGENTBOX_HOME": str(root / f"b{i}")}))
    starts = [threading.Thread(target=b.serve, args=(tiny_model,)) for b in backends]
    for t in starts:
        t.start()
    for t in starts:
        t.join()
    port = fleet_mod.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "agentbox.cli.main", "fleet", *(b.url for b in backends), "--port", str(port),
                             "--log", str(root / "router.log")], env={**os.environ, "AGENTBOX_HOME": str(root)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = proc.stdout.readline() if proc.stdout else ""
        assert f"at http://127.0.0.1:{port}/v1" in first, first + (proc.stdout.read() if proc.stdout else "")
        yield f"http://127.0.0.1:{port}", backends, tiny_model
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for b in backends:
            b.stop()


@dataclass
class Session:
    shape: str
    sid: str
    system: str
    headers: dict[str, str]
    turns: list[tuple[int, int, int]] = field(default_factory=list)  # (backend, prompt tokens, cached tokens)

    def history(self, n: int) -> list[dict]:
        msgs: list[dict] = []
        for t in range(n):
            msgs += [{"role": "user", "content": f"step {t}: run the tests"}, {"role": "assistant", "content": "done"}]
        return [*msgs, {"role": "user", "content": f"step {n}: run the tests"}]


def make_sessions() -> list[Session]:
    rng = random.Random(7)
    out = []
    for shape in ("claude", "codex", "chat"):
        for _ in range(SESSIONS):
            sid = str(uuid.UUID(int=rng.getrandbits(128)))
            system = " ".join(rng.choice(WORDS) for _ in range(700))  # about 700 tokens read again every turn
            # what `agentbox setup`/`launch` make Codex and chat clients send; Claude Code's key is in its body
            headers = {"session-id": sid} if shape == "codex" else {}
            if shape != "claude":
                headers |= routing_headers(per_launch=True)
            out.append(Session(shape, sid, system, headers))
    return out


def turn(url: str, model: str, s: Session, n: int) -> tuple[str, int, int]:
    """One turn through the official client (its default retries); (the server that answered, as its
    X-Agentbox-Server header names it, prompt tokens, cached tokens)."""
    if s.shape == "claude":
        c = anthropic.Anthropic(base_url=url, api_key="unused")
        raw = c.messages.with_raw_response.create(model=model, max_tokens=8, system=s.system, messages=s.history(n),
                                                  metadata={"user_id": f"user_0f3a_account__session_{s.sid}"})
        u = raw.parse().usage
        return raw.headers[HEADER], u.input_tokens + (u.cache_read_input_tokens or 0), u.cache_read_input_tokens or 0
    o = openai.OpenAI(base_url=url + "/v1", api_key="unused")
    if s.shape == "codex":
        raw = o.responses.with_raw_response.create(model=model, instructions=s.system, input=s.history(n),
                                                   max_output_tokens=8, extra_headers=s.headers)
        ur = raw.parse().usage
        return raw.headers[HEADER], ur.input_tokens, ur.input_tokens_details.cached_tokens
    raw = o.chat.completions.with_raw_response.create(model=model, max_tokens=8, extra_headers=s.headers,
                                                      messages=[{"role": "system", "content": s.system}, *s.history(n)])
    uc = raw.parse().usage
    return raw.headers[HEADER], uc.prompt_tokens, uc.prompt_tokens_details.cached_tokens


def run_turn(url: str, model: str, backends: list[Backend], sessions: list[Session], n: int) -> None:
    """Turn n of every session, the sessions concurrently (as a team's agents run)."""
    names = [f"127.0.0.1:{b.port}" for b in backends]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda s: turn(url, model, s, n), sessions))
    for s, (server, prompt, cached) in zip(sessions, results, strict=True):
        s.turns.append((names.index(server), prompt, cached))


def test_sessions_stick_survive_a_killed_backend_and_return(fleet) -> None:  # noqa: ANN001
    url, backends, model_dir = fleet
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    sessions = make_sessions()
    for n in range(3):
        run_turn(url, model, backends, sessions, n)
    for s in sessions:
        homes = {b for b, _, _ in s.turns}
        assert len(homes) == 1, f"{s.shape} session {s.sid} moved between backends: {s.turns}"
        for _, prompt, cached in s.turns[1:]:
            assert cached >= 0.9 * prompt, f"{s.shape} session {s.sid}: {s.turns}"
    # spread over both boxes (the ring depends on the backends' ports: 24 sessions all on one is 2^-23)
    assert {s.turns[0][0] for s in sessions} == {0, 1}

    # `top` over the router's URL shows both backends and their sessions; `doctor --url` passes
    snaps, _ = fleet_once([url])
    assert sorted(s["url"] for s in snaps) == sorted(b.url for b in backends)
    assert all(s["up"] and s["router_healthy"] and s["sessions"] for s in snaps), snaps
    assert all(f.ok for f in fleet_mod.diagnose([url])), fleet_mod.diagnose([url])

    # SIGKILL backend 1 while turn 3 is in flight: every request still succeeds (the router retries chat; on
    # messages and responses it answers 502 and the client's own retry lands on the survivor). The sessions
    # that lived on 1 go on cold on backend 0; turn 4 runs with 1 gone.
    dead = backends[1]
    killer = threading.Timer(0.3, dead.kill)
    killer.start()
    run_turn(url, model, backends, sessions, 3)
    killer.join()
    run_turn(url, model, backends, sessions, 4)
    for s in sessions:
        home = s.turns[0][0]
        assert s.turns[4][0] == 0 and s.turns[3][0] in (home, 0), s.turns
        if home == 1:
            first = next(t for t in (3, 4) if s.turns[t][0] == 0)
            _, prompt, cached = s.turns[first]
            assert cached < 0.5 * prompt, f"moved {s.shape} session read {cached}/{prompt} from a cache it never had"
        else:
            assert all(c >= 0.9 * p for _, p, c in s.turns[3:]), s.turns

    bad = [f for f in fleet_mod.diagnose([url]) if not f.ok]
    assert bad and all(dead.url in f.what for f in bad), bad

    # restarted, backend 1 is back in rotation: its sessions hash to it again
    dead.serve(model_dir)
    moved = [s for s in sessions if s.turns[0][0] == 1]
    deadline = time.monotonic() + 60
    while True:
        run_turn(url, model, backends, moved[:3], len(moved[0].turns))
        if all(s.turns[-1][0] == 1 for s in moved[:3]):
            break
        assert time.monotonic() < deadline, [s.turns for s in moved[:3]]
        time.sleep(2)
    listed = fleet_mod.workers(url)
    assert listed is not None and all(w["is_healthy"] for w in listed), listed
