"""The context you ask for is the context you get (issue 50): on CPU `--max-model-len` sizes the KV pool (it
was cut to 32,768 tokens silently), bounded by RAM with an error naming the context that fits; the startup line
and `GET /v1/models` say the context and why."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from agentbox.bench.tiny_models import save_turn_ending
from agentbox.config import EngineConfig
from agentbox.engine.ipc.messages import EngineReady
from agentbox.server.context import ContextSource, served_context


def ready(served: int, model: int, device: str = "cpu", pages: int = 8193) -> EngineReady:
    return EngineReady("m", served, 100, [0], pages, 16, "torch", device, "float32", model_max_len=model)


def test_the_context_says_where_it_comes_from() -> None:
    cases = [  # (engine config, what the engine reported) -> source, the line's words
        (EngineConfig(max_model_len=65536), ready(65536, 131072), ContextSource.FLAG, "(--max-model-len)"),
        (EngineConfig(), ready(8192, 8192), ContextSource.MODEL, "(the model's own)"),
        (EngineConfig(), ready(32768, 131072), ContextSource.CPU_DEFAULT,
         "(agentbox's default on CPU; the model supports 131,072: --max-model-len 131072 raises it)"),
        (EngineConfig(kv_cache_gb=0.1), ready(12000, 131072), ContextSource.KV_POOL,
         "cut from 131,072 to what the KV pool holds in the RAM given to it: --kv-cache-gb raises it"),
        (EngineConfig(max_model_len=65536), ready(40000, 131072, "cuda:0"), ContextSource.KV_POOL,
         "cut from 65,536 to what the KV pool holds in the free GPU memory"),
        (EngineConfig(num_pages=400), ready(6384, 8192), ContextSource.KV_POOL,
         "cut from 8,192 to what the KV pool holds in the RAM given to it: --num-pages raises it"),
    ]
    for engine, info, source, words in cases:
        ctx = served_context(engine, info)
        assert ctx.source is source, (engine, info)
        line = ctx.describe(info.device)
        assert line.startswith(f"context {info.max_model_len:,} tokens ") and words in line, line


@pytest.fixture(scope="module")
def tiny_128k(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:  # noqa: ANN001
    """The model `agentbox bench tiny-model --agent` makes, at its default 131,072 positions."""
    return save_turn_ending(tmp_path_factory.mktemp("tiny-128k"), smollm2_tokenizer, 131072)


def test_a_context_past_free_ram_is_refused_with_one_that_fits(tiny_128k: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import psutil

    from agentbox.engine.llm import LLM

    real = psutil.virtual_memory()
    # 1 GiB is kept beside the pool; 8 MiB more is room for half of the 16 MiB this model's 131k tokens take (the
    # default CPU pool is fp16)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=(1 << 30) + (8 << 20)))
    with pytest.raises(ValueError) as e:
        LLM(EngineConfig(model=str(tiny_128k), max_model_len=131072, device="cpu"))
    assert str(e.value) == ("a context of 131,072 tokens needs a KV pool of 0.02 GiB; this machine has 0.01 GiB of "
                            "RAM to spare: serve a shorter one (--max-model-len 64512) or free memory")
    # a machine with RAM to spare (this test's result must not hang on what else runs here)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: real._replace(available=64 << 30))
    with LLM(EngineConfig(model=str(tiny_128k), max_model_len=65536, device="cpu")) as llm:
        assert llm.core.max_model_len == 65536 and (llm.core.runner.num_pages - 1) * llm.core.runner.page_size == 65536
    with LLM(EngineConfig(model=str(tiny_128k), device="cpu")) as llm:
        assert llm.core.max_model_len == 32768  # no flag: the plan's context on CPU, as the note says


@pytest.mark.slow
def test_serve_max_model_len_65536_on_cpu_serves_a_48k_token_chat(tiny_128k: Path, tmp_path: Path,
                                                                  smollm2_tokenizer) -> None:  # noqa: ANN001
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "AGENTBOX_HOME": str(tmp_path)}
    cli = [sys.executable, "-m", "agentbox.cli.main"]
    r = subprocess.run([*cli, "serve", "--model", str(tiny_128k), "--max-model-len", "65536", "--port", str(port),
                        "--disk-cache-gb", "0"], env=env, capture_output=True, text=True, timeout=600)
    try:
        assert r.returncode == 0, r.stderr
        assert re.search(r"agentbox is serving \S+ at http://127.0.0.1:\d+/v1 \(pid \d+\)\n"
                         r"  context 65,536 tokens \(--max-model-len\)\n", r.stdout), r.stdout
        url = f"http://127.0.0.1:{port}"
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
        assert model["max_model_len"] == 65536 and model["context_note"] == "context 65,536 tokens (--max-model-len)"
        words = "the cache keeps every agent session resident between its turns " * 6000
        text = smollm2_tokenizer.decode(smollm2_tokenizer(words)["input_ids"][:48000])
        reply = OpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0).chat.completions.create(
            model="agentbox", messages=[{"role": "user", "content": text}], max_tokens=8)
        assert reply.usage is not None and 48000 <= reply.usage.prompt_tokens < 65536, reply.usage
        assert reply.choices[0].finish_reason == "stop"  # the model ends its turn: the request went through whole
    finally:
        subprocess.run([*cli, "stop"], env=env, capture_output=True, timeout=120)
