"""Session reuse on a hybrid model over HTTP, the way agents talk: 4 conversations at once, 8 turns each with
0.5 s between turns, the whole history sent every turn (with the answers as the server rendered them), in a
pool too small for every history (eviction runs). Each later turn's cached tokens and its answer against the
same prompt sent cold (a fresh session id) are measured with snapshots on and, on a second server, off."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest
import torch
from agents import run_agents
from hybrid_models import TEXT, VISION
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from agentbox.config import CPU_PAGE_SIZE

pytestmark = pytest.mark.slow
SYSTEM = "You are a coding agent. Tools: read_file(path), write_file(path, text), run(cmd). " * 12


def _save(d: Path, tokenizer) -> Path:  # noqa: ANN001
    text = dict(TEXT, vocab_size=len(tokenizer), max_position_embeddings=4096,
                eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(
        Qwen3_5Config(text_config=text, vision_config=VISION, architectures=["Qwen3_5ForConditionalGeneration"])
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name and "A_log" not in name:
                p.normal_(0, 0.08)
    model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def _serve(model: Path, home: Path, snapshots: int | None) -> tuple[str, dict]:
    port = int(subprocess.check_output([sys.executable, "-c", "import socket; s=socket.socket(); "
                                        "s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"]))
    env = {**os.environ, "AGENTBOX_HOME": str(home)}
    cmd = [sys.executable, "-m", "agentbox.cli.main", "serve", "--model", str(model), "--port", str(port),
           "--num-pages", str(2400 // CPU_PAGE_SIZE), "--max-model-len", "2048", "--exact-cpu", "--host-cache-gb", "0"]
    if snapshots is not None:
        cmd += ["--state-snapshots", str(snapshots)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return f"http://127.0.0.1:{port}", env


def _conversations(url: str) -> tuple[list[float], int]:
    """Cached share of every later turn's prompt; answers that differ from the cold run of the same prompt."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300)
    shares: list[float] = []
    mismatches = 0
    lock = threading.Lock()

    def ask(messages: list[dict], session: str) -> tuple[str, dict]:
        r = client.chat.completions.create(model="default", messages=messages, max_tokens=8, temperature=0,
                                           extra_headers={"X-Session-Id": session})
        return r.choices[0].message.content or "", r.usage.model_dump()

    def agent(k: int) -> None:
        nonlocal mismatches
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Task {k}: fix test {k}."}]
        for turn in range(8):
            text, usage = ask(messages, f"agent-{k}")
            cold, _ = ask(messages, f"cold-{uuid.uuid4().hex}")
            with lock:
                if turn:
                    shares.append(usage["prompt_tokens_details"]["cached_tokens"] / usage["prompt_tokens"])
                mismatches += text != cold
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": f"Tool result {turn}: 3 passed, {k} failed. Continue."}]
            time.sleep(0.5)

    run_agents(agent, 4)
    return shares, mismatches


def _snapshot_residency(url: str) -> tuple[dict[str, int], dict | None]:
    """Snapshot bytes per session (/v1/sessions) and the store's totals (/v1/stats)."""
    sessions = httpx.get(url + "/v1/sessions", timeout=30).json()["data"]
    return {s["id"]: s["snapshot_bytes"] for s in sessions}, httpx.get(url + "/v1/stats", timeout=30).json()["snapshots"]


def test_hybrid_sessions_over_http(tmp_path: Path, smollm2_tokenizer) -> None:  # noqa: ANN001
    model = _save(tmp_path / "qwen3.5-tiny", smollm2_tokenizer)
    results = {}
    residency = {}
    # Snapshots are LRU over a fixed number of slots (default: one per page-table row, 17 here). Between two
    # turns of one agent the other three and all cold twins save up to 14 newer ones, more when a loaded machine
    # skews the agents' pace, which can push out an agent's snapshot (seen once: a turn at 0 cached). The test is
    # about pool eviction, so it gives the snapshots room: 32 slots.
    for name, snapshots in (("on", 32), ("off", 0)):
        url, env = _serve(model, tmp_path / f"home-{name}", snapshots)
        try:
            results[name] = _conversations(url)
            residency[name] = _snapshot_residency(url)
        finally:
            subprocess.run([sys.executable, "-m", "agentbox.cli.main", "stop"], env=env, capture_output=True, timeout=60)
    (on, bad_on), (off, bad_off) = results["on"], results["off"]
    print(f"\nlater turns' cached share: snapshots on min {min(on):.3f} mean {sum(on) / len(on):.3f}; "
          f"off max {max(off):.3f} mean {sum(off) / len(off):.3f}; answers unlike a cold run: {bad_on} / {bad_off}")
    assert bad_on == 0 and bad_off == 0
    # what the snapshots hold, per session and in all, from the store: each agent keeps its turn's two
    held, stats = residency["on"]
    assert stats is not None and stats["used_bytes"] == stats["count"] * stats["slot_bytes"] > 0
    assert all(held[f"agent-{k}"] == 2 * stats["slot_bytes"] for k in range(4))
    assert sum(held.values()) <= stats["used_bytes"]
    held_off, stats_off = residency["off"]
    assert stats_off is None and not any(held_off.values())
    assert min(on) >= 0.9
    assert max(off) == 0.0
