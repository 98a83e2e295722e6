"""The state directory is untrusted input (issue 51's proof): a real server (SmolLM2) over a state directory whose
disk tier's index names a chunk `../../../../victim`, whose cached tokenizer.json is truncated and whose cached chat
template is broken starts, deletes nothing outside its directory, rebuilds the tokenizer from the model, refuses
the entry, logs each, and answers a chat exactly as it did over a clean directory; then over an index.json that
is garbage, rebuilt from the chunks' own headers (the log counts them), the same."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from agentbox.bench.spawn import agentbox_command, spawned

pytestmark = pytest.mark.slow
SERVE = ["--num-pages", "256", "--max-model-len", "2048", "--disk-cache-gb", "1", "--speculative", "off"]
CHAT = {"model": "default", "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "system", "content": "You are a terse assistant. " * 8},
                     {"role": "user", "content": "Name three prime numbers."}]}


def _chat(url: str) -> str:
    r = httpx.post(url + "/v1/chat/completions", json=CHAT, headers={"x-session-id": "s"}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _settle(url: str) -> None:
    """Until the write-behind has put the turn on disk."""
    deadline = time.monotonic() + 60
    while (c := httpx.get(url + "/v1/stats", timeout=60).json()["cache"])["disk_queued"] or not c["disk_pages"]:
        assert time.monotonic() < deadline, c
        time.sleep(0.2)


def test_a_tampered_state_directory_is_refused_or_rebuilt(smollm2_path: Path, tmp_path: Path) -> None:
    home = tmp_path / "home"
    cmd = agentbox_command(str(smollm2_path), SERVE)
    with spawned(cmd, tmp_path / "clean.log", home=str(home)) as (url, _):
        clean = _chat(url)
        _settle(url)
    tokenizer = next((home / "tokenizers").iterdir())
    ns = next(p for p in (home / "kvcache").iterdir() if p.is_dir())
    victim = tmp_path / "victim.kv"  # chunks/../../../../victim.kv
    index = json.loads((ns / "index.json").read_text())
    real = index["chunks"][0]
    victim.write_bytes(b"v" * (real["offset"] + real["nbytes"]))  # the size the entry claims: the old check passed
    index["chunks"].insert(0, {**real, "name": "../../../../victim", "used": 0.0})
    (ns / "index.json").write_text(json.dumps(index))
    tok_json = tokenizer / "tokenizer.json"
    tok_json.write_bytes(tok_json.read_bytes()[: tok_json.stat().st_size // 2])
    (tokenizer / "chat_template.jinja").write_text("{% for message in messages %}{{ message['content'] ")
    with spawned(cmd, tmp_path / "tampered.log", home=str(home)) as (url, _):
        assert _chat(url) == clean
    log = (tmp_path / "tampered.log").read_text()
    assert "the cached tokenizer" in log and "rebuilding it from" in log, log[-3000:]
    assert "chat_template.jinja" in log and "tokenizer.json" in log, log[-3000:]  # each file that failed, named
    assert "refused the index entry '../../../../victim'" in log and "1 index entries refused" in log, log[-3000:]
    assert victim.read_bytes() == b"v" * (real["offset"] + real["nbytes"])  # nothing outside was touched
    assert json.loads((tokenizer / "tokenizer.json").read_text())  # rebuilt whole

    (ns / "index.json").write_text("\x00garbage{")
    with spawned(cmd, tmp_path / "garbage.log", home=str(home)) as (url, _):
        pages = httpx.get(url + "/v1/stats", timeout=60).json()["cache"]["disk_pages"]
        assert _chat(url) == clean
    log = (tmp_path / "garbage.log").read_text()
    assert "index.json is unreadable" in log and "index rebuilt from the chunks' own headers" in log, log[-3000:]
    assert pages > 0  # the chunks came back
    assert victim.exists()
