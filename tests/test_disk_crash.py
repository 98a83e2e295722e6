"""The disk tier after `kill -9` in the middle of a write storm (issue 26): an engine process evicting to disk
as fast as it can is killed with SIGKILL; one chunk the index names is then torn by hand (what a power loss
can leave). A new engine over the same directory starts, counts what it dropped, reads the rest back, and its
greedy tokens on 20 prompts equal those of an engine without a disk tier."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=1024, rms_norm_eps=1e-6)
PS = 4


def prompts() -> list[list[int]]:
    """20 short prompts: 5 shared stems (an agent's history) times 4 endings."""
    return [[2 + (s * 31 + i * 7) % 250 for i in range(24)] + [3 + s, 4 + e, 5 + e * s % 200]
            for s in range(5) for e in range(4)]


def config(model: Path, disk_gb: float) -> EngineConfig:
    # A pool of 40 pages: the 20 prompts do not all fit, so every step evicts and (with a tier) writes.
    return EngineConfig(model=str(model), device="cpu", dtype="float32", page_size=PS, num_pages=40,
                        max_num_seqs=2, cpu_threads=1, disk_cache_gb=disk_gb)


STORM = """
import random, sys
from pathlib import Path
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from tests.test_disk_crash import config, prompts
llm = LLM(config(Path(sys.argv[1]), 0.01))
rng = random.Random(0)
ps = prompts()
print("ready", flush=True)
while True:  # a write storm: every turn evicts older pages to disk
    p = rng.choice(ps)
    llm.generate([p + [rng.randrange(2, 250) for _ in range(rng.randrange(4, 40))]], SamplingParams(max_tokens=2))
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny-disk")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY, architectures=["LlamaForCausalLM"])).save_pretrained(path)
    return path


def _greedy(llm: LLM) -> tuple[list[list[int]], int]:
    outs = [llm.generate([p], SamplingParams(max_tokens=4, temperature=0.0))[0] for p in prompts()]
    return [o.token_ids for o in outs], sum(o.num_cached_tokens for o in outs)


def test_kill_9_in_a_write_storm_then_restart_serves_cold_tokens(tiny: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path))
    env = {**os.environ, "AGENTBOX_HOME": str(tmp_path), "PYTHONPATH": str(Path(__file__).parent.parent)}
    proc = subprocess.Popen([sys.executable, "-c", STORM, str(tiny)], env=env, stdout=subprocess.PIPE,
                            start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        root = tmp_path / "kvcache"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until the index names a good number of chunks
            idx = next(root.glob("*/index.json"), None)
            if idx is not None and idx.stat().st_size > 2500 and len(list(root.glob("*/chunks/*.kv"))) > 8:
                break
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole tree, mid-write
        proc.wait()
    chunks = sorted(root.glob("*/chunks/*.kv"))
    assert len(chunks) > 8, "the storm wrote too little to test anything"
    torn = chunks[len(chunks) // 2]
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2] + b"\0" * (torn.stat().st_size // 2 + 3))

    with LLM(config(tiny, 0.0)) as cold:
        want, cold_cached = _greedy(cold)
    with LLM(config(tiny, 0.01)) as warm:
        stats = warm.core.cache.stats()
        got, warm_cached = _greedy(warm)
        after = warm.core.cache.stats()
    assert stats.disk_pages > 0 and stats.disk_torn >= 1  # the index survived the kill; the torn chunk is out
    assert got == want  # never a different token than a cold engine
    assert after.disk_restored > 0 and warm_cached > cold_cached  # and the disk was actually used
    print(f"\nafter kill -9: {stats.disk_pages} pages on disk, {stats.disk_torn} chunks dropped as torn; "
          f"20 prompts: {warm_cached} tokens cached ({after.disk_restored} pages read back) vs {cold_cached} cold")
