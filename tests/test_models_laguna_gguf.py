"""Laguna from a GGUF that llama.cpp's own converter wrote (tests/laguna_gguf.py), through the GGUF family table
(models/gguf_laguna.py): the config it reads back (per-layer heads, XS.2's sliding pattern, YaRN partial rope on the
global layer, the gate's granularity from its width), and fp32 logits of a prefill, a chunked prefill and decodes
past the window equal the transformers twin's; greedy through the engine too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepseek_v4_gguf import converter_dir
from laguna_gguf import write_laguna_gguf
from laguna_models import hf_greedy, hf_logits
from model_harness import PagedRunner

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.models.gguf_file import gguf_config
from agentbox.models.loader import load_model

LONG = [(i * 37 + 11) % 250 + 1 for i in range(40)]


@pytest.fixture(scope="module")
def llama_cpp(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    store = getattr(request.config, "cache", None)  # pytest's cache (absent under -p no:cacheprovider)
    cache = Path(store.mkdir("llama-cpp-python")) if store is not None else tmp_path_factory.mktemp("lcpp")
    found = converter_dir(cache)
    if found is None:
        pytest.skip("llama-cpp-python 0.3.36's sdist is not here and pip could not download it "
                    "(set AGENTBOX_LLAMA_CPP_SDIST to the .tar.gz)")
    return found


@pytest.mark.parametrize("gating", [True, "per-element"])
def test_converter_gguf_matches_transformers(gating: bool | str, llama_cpp: Path, tmp_path: Path,
                                             smollm2_tokenizer) -> None:  # noqa: ANN001
    path, hf = write_laguna_gguf(tmp_path, llama_cpp, smollm2_tokenizer, gating)
    config, ref = gguf_config(path), hf.config
    for key in ("num_attention_heads_per_layer", "layer_types", "mlp_layer_types", "sliding_window", "head_dim",
                "num_key_value_heads", "moe_routed_scaling_factor", "shared_expert_intermediate_size"):
        assert getattr(config, key) == getattr(ref, key), key
    assert config.gating == ref.gating and config.rope_parameters["full_attention"]["rope_type"] == "yarn"
    ours = load_model(str(path), torch.float32, "cpu")
    expected = hf_logits(hf, LONG)
    torch.testing.assert_close(PagedRunner(ours, page_size=4).step({0: LONG})[0], expected, atol=2e-4, rtol=2e-4)
    runner = PagedRunner(ours, page_size=4)
    out = [runner.step({0: LONG[:13]})[0], runner.step({0: LONG[13:30]})[0]]
    out += [runner.step({0: [t]})[0] for t in LONG[30:]]
    torch.testing.assert_close(torch.cat(out), expected, atol=2e-4, rtol=2e-4)
    llm = LLM(EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch"), loaded=ours)
    got = llm.generate([LONG[:25]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert got.token_ids == hf_greedy(hf, LONG[:25], 8)
