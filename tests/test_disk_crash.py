"""The disk tier after `kill -9` of the whole server tree in the middle of a write storm (issue 26's proof): a
real server (`agentbox serve --foreground`, API process and engine core) over a tiny random Llama, with a pool
small enough that every turn evicts to disk, is driven by several HTTP clients at once and killed with
SIGKILL to its process group (both processes, mid-write). One chunk the index names is then torn by hand (what
a power loss can leave). A new server over the same state directory serves at once, counts the chunks it
dropped in /v1/stats, reads the rest back, and its greedy answers to 20 prompts equal a cold engine's
(no disk tier, in-process: the same engine without the HTTP start)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from agentbox.bench.spawn import agentbox_command, spawned
from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from tests.word_tokenizer import save_word_tokenizer

pytestmark = pytest.mark.slow
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024, rms_norm_eps=1e-6)
PS = 4
PAGES = 48  # a pool of 48 pages of 4 tokens: the 20 prompts do not all fit, so every turn evicts and writes
SERVE = ["--page-size", str(PS), "--num-pages", str(PAGES), "--max-num-seqs", "4", "--dtype", "float32", "--device", "cpu", "--host-cache-gb", "0", "--disk-cache-gb", "0.01",
         "--speculative", "off"]


def prompts() -> list[list[int]]:
    """20 short prompts: 5 shared stems (an agent's history) times 4 endings (ids >= 2: 0 and 1 are special)."""
    return [[2 + (s * 31 + i * 7) % 250 for i in range(24)] + [3 + s, 4 + e, 5 + e * s % 200]
            for s in range(5) for e in range(4)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a word-level tokenizer: token i is the word `w<i>`, so an answer's text names
    its token ids."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny-disk")
    save_word_tokenizer(path, TINY["vocab_size"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])).save_pretrained(path)
    return path


def _complete(client: httpx.Client, prompt: list[int], max_tokens: int, session: str) -> list[int]:
    r = client.post("/v1/completions", headers={"x-session-id": session}, json={
        "model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return [int(w[1:]) for w in r.json()["choices"][0]["text"].split()]


def _storm(url: str, stop: threading.Event, seed: int) -> None:
    """One agent of the storm: random continuations of the 20 prompts, each turn evicting older pages."""
    rng, ps = random.Random(seed), prompts()
    with httpx.Client(base_url=url, timeout=60) as client:
        while not stop.is_set():
            p = rng.choice(ps) + [rng.randrange(2, 250) for _ in range(rng.randrange(4, 40))]
            try:
                _complete(client, p, 2, f"storm-{seed}")
            except (httpx.HTTPError, AssertionError):
                return  # the server is gone (the kill)


def test_kill_9_of_the_server_tree_in_a_write_storm(tiny: Path, tmp_path: Path) -> None:
    home = str(tmp_path / "home")
    root = Path(home) / "kvcache"
    cmd = agentbox_command(str(tiny), SERVE)
    with spawned(cmd, tmp_path / "storm.log", home=home) as (url, proc):
        stop = threading.Event()
        agents = [threading.Thread(target=_storm, args=(url, stop, i)) for i in range(3)]
        for a in agents:
            a.start()
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # until the index names a good number of chunks
                idx = next(root.glob("*/index.json"), None)
                if idx is not None and idx.stat().st_size > 2500 and len(list(root.glob("*/chunks/*.kv"))) > 8:
                    break
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGKILL)  # the whole tree (API process and engine core), mid-write
            proc.wait(timeout=30)
        finally:
            stop.set()
            for a in agents:
                a.join(60)
    chunks = sorted(root.glob("*/chunks/*.kv"))
    assert len(chunks) > 8, "the storm wrote too little to test anything"
    torn = chunks[len(chunks) // 2]
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2] + b"\0" * (torn.stat().st_size // 2 + 3))

    with spawned(cmd, tmp_path / "restart.log", home=home) as (url, _), httpx.Client(base_url=url, timeout=60) as c:
        before = c.get("/v1/stats").json()["cache"]
        got = [_complete(c, p, 4, f"p{i}") for i, p in enumerate(prompts())]
        after = c.get("/v1/stats").json()["cache"]
    cold_config = EngineConfig(model=str(tiny), device="cpu", dtype="float32", page_size=PS, num_pages=PAGES,
                               max_num_seqs=4, host_cache_gb=0.0, speculative="off")
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(cold_config) as cold:  # one prompt at a time, as the server got them
        want = [cold.generate([p], greedy)[0].token_ids for p in prompts()]
    want = [[t for t in w if t > 1] for w in want]  # special tokens are not shown as text
    assert before["disk_pages"] > 0 and before["disk_torn"] >= 1  # the index survived; the torn chunk is out
    assert got == want  # never a different token than a cold engine
    assert after["disk_restored"] > 0  # and the disk was actually read
    print(f"\nafter kill -9 of the server tree: {before['disk_pages']} pages on disk, {before['disk_torn']} "
          f"chunks dropped as torn; 20 prompts equal a cold engine's, {after['disk_restored']} pages read back")

