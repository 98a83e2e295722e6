"""Gemma 4 from a `gemma4` GGUF (tests/gemma4_gguf.py: llama.cpp's converter layout, Q8_0 linears and embedding):
logits of chunked prefill and decode past the 8-token window equal the transformers twin, dense (image-text
checkpoint, per-layer inputs, K=V globals, soft-capped logits) and MoE (fused gate/up experts, router scales);
greedy through the engine too, with the linears kept as the file's blocks; and Gemma 4 12B's text model out of its
unified checkpoint (`gemma4_unified`, which llama.cpp's converter writes as `gemma4`)."""

from __future__ import annotations

import pytest
import torch
from gemma4_gguf import write_gemma4_gguf
from gemma4_models import configs, save_gemma4, unified_config
from hybrid_models import hf_greedy, hf_logits
from model_harness import PagedRunner

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.layers.quant import int4
from agentbox.models.loader import load_config, load_model, resolve_model

LONG = [(i * 37 + 11) % 256 for i in range(30)]
PROMPT = [5, 17, 200, 3, 99, 42, 7, 128, 64, 1, 250, 33, 8]
ATOL = 2e-4


@pytest.mark.parametrize("kind", [*configs(), "unified"])
def test_gguf_matches_transformers(kind: str, tmp_path) -> None:  # noqa: ANN001
    hf = save_gemma4(unified_config() if kind == "unified" else configs()[kind], tmp_path / "hf")
    path = write_gemma4_gguf(hf, tmp_path / f"{kind}.gguf")
    config = load_config(resolve_model(str(path)))
    assert config.architectures == ["Gemma4ForCausalLM"]
    with int4.cpu_kernel(int4.Int4Kernel.DENSE):  # compared with an fp32 twin: the exact CPU path
        ours = load_model(str(path), torch.float32, "cpu")
    runner = PagedRunner(ours, page_size=4)
    out = [runner.step({0: LONG[:13]})[0], runner.step({0: LONG[13:20]})[0]]
    out += [runner.step({0: [t]})[0] for t in LONG[20:]]
    torch.testing.assert_close(torch.cat(out), hf_logits(hf, LONG), atol=ATOL, rtol=ATOL)
    llm = LLM(EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch"), loaded=ours)
    got = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0]
    assert got.token_ids == hf_greedy(hf, PROMPT, 10)
