"""GLM-5.3-Flash sessions over HTTP, the way agents talk: a tiny random GLM-5.3-Flash (KDA state, latents and
pooled indexer keys; tests/glm5_next_models.py) behind a real server with a GLM-4.7-style chat template
(tests/glm_template.py: GLM-5.3-Flash's own template is not available offline). 4 conversations at once, 8 turns
each, the whole history sent every turn; the four system prompts are about 1k, 1.5k, 2k and 2.5k tokens (prompts
of 1.3k to 3.9k), and every turn ends where the answer and a tool result of its own length put it (not on 4-token
pool boundaries). Run twice: with snapshots off (`--state-snapshots 0`: a later turn resumes nothing, as a
stateful model must when no snapshot describes its state, so every answer there is a cold run), then with
snapshots on: each later turn's cached share, and every answer against the cold run's."""

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
from glm5_next_models import randomize, tiny_config
from glm_template import SPECIAL, TEMPLATE

pytestmark = pytest.mark.slow
EOS = "<|user|>"  # GLM ends a turn by starting the next one
TOOLS = "You are a coding agent. Tools: read_file(path), write_file(path, text), run(cmd). "  # ~20 tokens


def system(k: int) -> str:
    return f"Agent {k} of 4. " + TOOLS * (50 + 25 * k)  # about 1k, 1.5k, 2k, 2.5k tokens


def tool_result(k: int, turn: int) -> str:
    return "".join(f"test_{k}_{turn}_{i}: {'ok' if i % 3 else 'FAILED'}\n" for i in range(5 + (k + 2 * turn) % 7))


def save_model(d: Path, smollm2_tokenizer) -> Path:  # noqa: ANN001
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [*SPECIAL, "[gMASK]", "<sop>", "<think>", "</think>"]})
    tok.chat_template = TEMPLATE
    config = tiny_config(vocab_size=len(tok), max_position_embeddings=16384,
                         eos_token_id=tok.convert_tokens_to_ids(EOS))
    randomize(transformers.Glm5NextForConditionalGeneration(config).float().eval()).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def serve(model: Path, home: Path, *flags: str) -> tuple[str, dict]:
    port = int(subprocess.check_output([sys.executable, "-c", "import socket; s=socket.socket(); "
                                        "s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"]))
    env = {**os.environ, "AGENTBOX_HOME": str(home)}
    cmd = [sys.executable, "-m", "agentbox.cli.main", "serve", "--model", str(model), "--port", str(port),
           "--num-pages", "900", "--max-model-len", "8192", "--exact-cpu", "--host-cache-gb", "0", *flags]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return f"http://127.0.0.1:{port}", env


def stop(env: dict) -> None:
    subprocess.run([sys.executable, "-m", "agentbox.cli.main", "stop"], env=env, capture_output=True, timeout=60)


Answers = dict[tuple[int, int], str]


def conversations(url: str) -> tuple[list[float], list[int], Answers]:
    """Each later turn's cached share of its prompt, every turn's prompt length, every answer by (agent, turn)."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    shares: list[float] = []
    lengths: list[int] = []
    answers: Answers = {}
    lock = threading.Lock()

    def agent(k: int) -> None:
        messages = [{"role": "system", "content": system(k)}, {"role": "user", "content": f"Task {k}: fix test {k}."}]
        for turn in range(8):
            r = client.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0,
                                               extra_headers={"X-Session-Id": f"agent-{k}"})
            text, usage = r.choices[0].message.content or "", r.usage.model_dump()
            with lock:
                answers[k, turn] = text
                lengths.append(usage["prompt_tokens"])
                if turn:
                    shares.append(usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"])
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": tool_result(k, turn)}]

    run_agents(agent, 4)
    return shares, lengths, answers


def test_glm5_next_sessions_over_http(tmp_path: Path, smollm2_tokenizer) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = save_model(tmp_path / "glm5-next-tiny", smollm2_tokenizer)
    results = {}
    for name, flags in (("off", ("--state-snapshots", "0")), ("on", ("--state-snapshots", "32"))):
        url, env = serve(model, tmp_path / f"home-{name}", *flags)
        try:
            results[name] = conversations(url)
        finally:
            stop(env)
    (off, _, cold), (on, lengths, warm) = results["off"], results["on"]
    unlike = sum(warm[key] != cold[key] for key in cold)
    print(f"\nprompts {min(lengths)}..{max(lengths)} tokens; later turns' cached share: snapshots on min {min(on):.3f} "
          f"mean {sum(on) / len(on):.3f}; off max {max(off):.3f} mean {sum(off) / len(off):.3f}; answers unlike the "
          f"cold run: {unlike} of {len(cold)}")
    assert min(lengths) >= 1000 and max(lengths) >= 2500 and len(cold) == len(warm) == 32
    assert sum(n % 4 != 0 for n in lengths) >= len(lengths) // 2  # turns end off the 4-token pool grid
    assert unlike == 0
    assert min(on) >= 0.9
    assert max(off) == 0.0
