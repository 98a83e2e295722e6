"""The triton attention backend inside real models (under Triton's interpreter on CPU): a tiny random Qwen3
gives the torch backend's logits for prefill, chunked prefill over a cached prefix, decode over page
boundaries and a mixed batch; backend selection; and the whole SmolLM2 served in-process with
`--attention triton` gives transformers' greedy tokens (fp32)."""

from __future__ import annotations

import logging
import socket
from pathlib import Path

import pytest
import torch
from model_harness import PagedRunner
from paged_case import PROMPT

from agentbox.bench.throughput import transformers_model
from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.layers.backends import TorchAttention, TritonAttention, select_backend
from agentbox.models.loader import LoadedModel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_backend_matches_torch_backend(tiny_qwen3: LoadedModel, page_size: int) -> None:
    runners = [
        PagedRunner(tiny_qwen3, num_pages=96, page_size=page_size, backend_cls=cls, device=DEVICE)
        for cls in (TorchAttention, TritonAttention)
    ]
    steps: list[dict[int, list[int]]] = [
        {0: PROMPT[:13]},  # a prompt
        {0: PROMPT[13:20], 1: PROMPT[:5]},  # a chunk over a cached prefix, batched with a new prompt
        {0: [PROMPT[20]], 1: [PROMPT[5]]},  # decode only
        {0: [PROMPT[21]], 1: PROMPT[6:18]},  # mixed: a decode and a chunk
        {0: [3], 1: [4]},
    ]
    for chunks in steps:
        ref, got = (r.step(chunks) for r in runners)
        for seq in chunks:
            torch.testing.assert_close(got[seq], ref[seq], atol=1e-4, rtol=1e-4)


def test_backend_selection(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="agentbox.layers.backends"):
        assert select_backend("auto", "cpu") is TorchAttention
    assert "auto picked torch on cpu" in caplog.text and "triton: on CPU only under Triton's interpreter" in caplog.text
    assert select_backend("triton", DEVICE) is TritonAttention  # by name: the interpreter is on in this folder
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        select_backend("nope", "cpu")


@pytest.mark.slow
def test_smollm2_triton_greedy_matches_transformers(smollm2_loaded: LoadedModel, smollm2_path: Path) -> None:
    # Two tokens: the prompt step's and one decode step's. Under the interpreter each step of the 30 layers
    # takes 5-15 s on this 2-core machine (measured), so more tokens would add minutes, not coverage.
    prompt, n = [1, 4093, 5, 253, 1184, 28, 2030, 314, 216, 9004], 2
    hf = transformers_model(smollm2_loaded, torch.float32, "cpu")
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    expected = ref[0, len(prompt) :].tolist()
    config = EngineConfig(
        model=str(smollm2_path), device="cpu", dtype="float32", attention="triton", num_pages=8, cache_policy="none"
    )
    llm = LLM(config, loaded=smollm2_loaded)
    assert llm.core.runner.backend.name == "triton"
    got = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].token_ids
    assert got == expected


def test_triton_backend_passes_sinks_and_window() -> None:
    # The backend's forward with gpt-oss's per-layer arguments, prefill then decode, against the torch twin.
    from agentbox.kernels.attention_ref import paged_attention_ref
    from agentbox.layers.backends.base import AttentionMetadata, KVCache

    h, hkv, d, ps = 8, 2, 16, 4
    cache = KVCache.uniform(1, 8, ps, hkv, d, torch.float32, DEVICE)
    backend = TritonAttention(cache, h, hkv, d, d**-0.5)
    sinks = torch.linspace(-1, 1, h, device=DEVICE)
    gen = torch.Generator().manual_seed(2)
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32, device=DEVICE)
    for start, n in ((0, 9), (9, 1)):
        q, k, v = (torch.randn(n, x, d, generator=gen).to(DEVICE) for x in (h, hkv, hkv))
        pos = torch.arange(start, start + n, device=DEVICE)
        slots = table[0].long()[pos // ps] * ps + pos % ps
        meta = AttentionMetadata([n], [start + n], table, slots, ps)
        backend.begin(meta)
        got = backend.forward(0, q, k, v, sliding_window=3, sinks=sinks)
        expected = paged_attention_ref(
            q, cache.k[0], cache.v[0], table, meta.query_start_loc, meta.kv_lens_tensor, ps, d**-0.5, 3, sinks
        )
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_serve_refuses_an_unknown_attention_backend() -> None:
    from typer.testing import CliRunner

    from agentbox.cli.main import app

    with socket.socket() as s:  # a free port: the default 8000 may be a user's server, which serve names first
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = CliRunner().invoke(app, ["serve", "--model", "x", "--attention", "nope", "--port", str(port)])
    assert result.exit_code != 0
    assert "--attention must be one of auto, torch, triton" in result.output
