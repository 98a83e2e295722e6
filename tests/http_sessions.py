"""Agents over HTTP for the session tests of a stateful model: a real server (`agentbox serve`) on an ephemeral
port, 4 conversations at once, 8 turns each, the whole history sent every turn with a system prompt of about 1.4k,
2.8k, 4.2k and 5.6k tokens (other sizes by `base` and `step`: TOOLS repeated base + step x k times) and tool results
of their own lengths. Shared by the session tests of Laguna, Nemotron-H, DeepSeek-V4 and GLM-5.3-Flash."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import openai
from agents import run_agents

from agentbox.config import CPU_PAGE_SIZE

TOOLS = "You are a coding agent. Tools: read_file(path), write_file(path, text), run(cmd). "  # ~20 tokens


def system(k: int, base: int = 60, step: int = 53) -> str:
    return f"Agent {k} of 4. " + TOOLS * (base + step * k)  # by default about 1.4k, 2.8k, 4.2k, 5.6k tokens


def tool_result(k: int, turn: int) -> str:
    return "".join(f"test_{k}_{turn}_{i}: {'ok' if i % 3 else 'FAILED'}\n" for i in range(5 + (k + 2 * turn) % 7))


def serve(model: Path, home: Path, *flags: str, pool_tokens: int = 35200) -> tuple[str, dict]:
    port = int(subprocess.check_output([sys.executable, "-c", "import socket; s=socket.socket(); "
                                        "s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"]))
    env = {**os.environ, "AGENTBOX_HOME": str(home)}
    cmd = [sys.executable, "-m", "agentbox.cli.main", "serve", "--model", str(model), "--port", str(port),
           "--num-pages", str(pool_tokens // CPU_PAGE_SIZE), "--max-model-len", "8192", "--exact-cpu", "--host-cache-gb", "0", *flags]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return f"http://127.0.0.1:{port}", env


def stop(env: dict) -> None:
    subprocess.run([sys.executable, "-m", "agentbox.cli.main", "stop"], env=env, capture_output=True, timeout=60)


Answers = dict[tuple[int, int], str]


def conversations(url: str, base: int = 60, step: int = 53) -> tuple[list[float], list[int], Answers, list[int]]:
    """Each later turn's cached share of its prompt, every turn's prompt length, every answer by (agent, turn), and
    each later turn's cached tokens less its previous prompt's length."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    shares: list[float] = []
    lengths: list[int] = []
    answers: Answers = {}
    beyond: list[int] = []
    lock = threading.Lock()

    def agent(k: int) -> None:
        messages = [{"role": "system", "content": system(k, base, step)}, {"role": "user", "content": f"Task {k}: fix test {k}."}]
        previous = 0
        for turn in range(8):
            r = client.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0,
                                               extra_headers={"X-Session-Id": f"agent-{k}"})
            text, usage = r.choices[0].message.content or "", r.usage.model_dump()
            with lock:
                answers[k, turn] = text
                lengths.append(usage["prompt_tokens"])
                cached = usage["prompt_tokens_details"]["cached_tokens"]
                if turn:
                    shares.append(cached / usage["prompt_tokens"])
                    beyond.append(cached - previous)
            previous = usage["prompt_tokens"]
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": tool_result(k, turn)}]

    run_agents(agent, 4)
    return shares, lengths, answers, beyond


def cold_and_warm(model: Path, tmp: Path, base: int = 60, step: int = 53,
                  pool_tokens: int = 35200) -> dict[str, tuple[list[float], list[int], Answers, list[int]]]:
    """The conversations served twice: "off" with snapshots off (`--state-snapshots 0`: a later turn resumes
    nothing, as a stateful model must when no snapshot describes its state, so every answer is a cold run), "on"
    with them on."""
    results = {}
    for name, flags in (("off", ("--state-snapshots", "0")), ("on", ("--state-snapshots", "32"))):
        url, env = serve(model, tmp / f"home-{name}", *flags, pool_tokens=pool_tokens)
        try:
            results[name] = conversations(url, base, step)
        finally:
            stop(env)
    return results


def report(results: dict[str, tuple[list[float], list[int], Answers, list[int]]]) -> tuple[list[float], list[float], int, list[int]]:
    """Prints the numbers; returns (warm shares, cold shares, answers unlike the cold run, prompt lengths)."""
    (off, _, cold, _), (on, lengths, warm, beyond) = results["off"], results["on"]
    unlike = sum(warm[key] != cold[key] for key in cold)
    assert len(cold) == len(warm) == 32
    print(f"\nprompts {min(lengths)}..{max(lengths)} tokens; later turns' cached share: snapshots on min {min(on):.3f} "
          f"mean {sum(on) / len(on):.3f}; off max {max(off):.3f} mean {sum(off) / len(off):.3f}; answers unlike the "
          f"cold run: {unlike} of {len(cold)}; cached less the previous prompt: {min(beyond)}..{max(beyond)}")
    return on, off, unlike, lengths
