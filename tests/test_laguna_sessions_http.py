"""Laguna sessions over HTTP, the way agents talk: a tiny random Laguna (XS.2's pattern: a global layer, then three
sliding layers of a 64-token window) behind a real server with XS.2's own chat template (the one llama.cpp vendors).
4 conversations at once, 8 turns each, the whole history sent every turn; the system prompts are about 1k to 5k
tokens, so every prompt is many windows long and each turn resumes the sliding layers' rings from a snapshot, the
global layer's pages from the radix cache. Run twice: with snapshots off (`--state-snapshots 0`: a later turn
resumes nothing, so every answer there is a cold run), then with snapshots on: each later turn's cached share, and
every answer against the cold run's."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import threading
from pathlib import Path

import openai
import pytest
import torch
import transformers
from agents import run_agents
from laguna_models import randomize, tiny_config

pytestmark = pytest.mark.slow
TEMPLATE = (Path(__file__).parent / "fixtures" / "laguna_xs2_chat_template.jinja").read_text()
SPECIAL = ["〈|EOS|〉", "<system>", "</system>", "<user>", "</user>", "<assistant>", "</assistant>", "<think>",
           "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOOLS = "You are a coding agent. Tools: read_file(path), write_file(path, text), run(cmd). "  # ~20 tokens
WINDOW = 64


def system(k: int) -> str:
    return f"Agent {k} of 4. " + TOOLS * (60 + 53 * k)  # about 1.4k, 2.8k, 4.2k, 5.6k tokens


def tool_result(k: int, turn: int) -> str:
    return "".join(f"test_{k}_{turn}_{i}: {'ok' if i % 3 else 'FAILED'}\n" for i in range(5 + (k + 2 * turn) % 7))


def save_model(d: Path, smollm2_tokenizer) -> Path:  # noqa: ANN001
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = TEMPLATE
    config = tiny_config("head", vocab_size=len(tok), sliding_window=WINDOW, max_position_embeddings=16384,
                         eos_token_id=tok.convert_tokens_to_ids("</assistant>"))
    randomize(transformers.LagunaForCausalLM(config).float().eval()).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def serve(model: Path, home: Path, *flags: str) -> tuple[str, dict]:
    port = int(subprocess.check_output([sys.executable, "-c", "import socket; s=socket.socket(); "
                                        "s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"]))
    env = {**os.environ, "AGENTBOX_HOME": str(home)}
    cmd = [sys.executable, "-m", "agentbox.cli.main", "serve", "--model", str(model), "--port", str(port),
           "--num-pages", "2200", "--max-model-len", "8192", "--exact-cpu", "--host-cache-gb", "0", *flags]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return f"http://127.0.0.1:{port}", env


def stop(env: dict) -> None:
    subprocess.run([sys.executable, "-m", "agentbox.cli.main", "stop"], env=env, capture_output=True, timeout=60)


Answers = dict[tuple[int, int], str]


def conversations(url: str) -> tuple[list[float], list[int], Answers, list[int]]:
    """Each later turn's cached share of its prompt, every turn's prompt length, every answer by (agent, turn), and
    each later turn's cached tokens less its previous prompt's length."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    shares: list[float] = []
    lengths: list[int] = []
    answers: Answers = {}
    beyond: list[int] = []
    lock = threading.Lock()

    def agent(k: int) -> None:
        messages = [{"role": "system", "content": system(k)}, {"role": "user", "content": f"Task {k}: fix test {k}."}]
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


def test_laguna_sessions_over_http(tmp_path: Path, smollm2_tokenizer) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = save_model(tmp_path / "laguna-tiny", smollm2_tokenizer)
    results = {}
    for name, flags in (("off", ("--state-snapshots", "0")), ("on", ("--state-snapshots", "32"))):
        url, env = serve(model, tmp_path / f"home-{name}", *flags)
        try:
            results[name] = conversations(url)
        finally:
            stop(env)
    (off, _, cold, _), (on, lengths, warm, beyond) = results["off"], results["on"]
    unlike = sum(warm[key] != cold[key] for key in cold)
    print(f"\nprompts {min(lengths)}..{max(lengths)} tokens; later turns' cached share: snapshots on min {min(on):.3f} "
          f"mean {sum(on) / len(on):.3f}; off max {max(off):.3f} mean {sum(off) / len(off):.3f}; answers unlike the "
          f"cold run: {unlike} of {len(cold)}; cached less the previous prompt: {min(beyond)}..{max(beyond)}")
    assert min(lengths) >= 15 * WINDOW and len(cold) == len(warm) == 32
    assert unlike == 0
    assert min(on) >= 0.9
    assert max(off) == 0.0
