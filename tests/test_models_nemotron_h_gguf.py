"""Nemotron-H from a GGUF that llama.cpp's own converter wrote (`nemotron_h_moe`: conversion/nemotron.py of the llama.cpp
the llama-cpp-python 0.3.36 sdist vendors, run from the unpacked sdist: tests/deepseek_v4_gguf.py finds or fetches it),
through the GGUF family table (models/gguf_nemotron_h.py): the layer kinds read back from the tensors, A back from
-exp(A_log), and fp32 logits of a prefill, a chunked prefill and decodes equal the transformers twin's; greedy through
the engine too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepseek_v4_gguf import convert, converter_dir
from model_harness import PagedRunner
from nemotron_h_models import hf_greedy, hf_logits, save_nemotron_h, tiny_config

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


def test_converter_gguf_matches_transformers(llama_cpp: Path, tmp_path: Path, smollm2_tokenizer) -> None:  # noqa: ANN001
    hf = save_nemotron_h(tmp_path / "hf", tiny_config(vocab_size=len(smollm2_tokenizer)))
    smollm2_tokenizer.save_pretrained(tmp_path / "hf")
    path = convert(tmp_path / "hf", tmp_path / "nemotron-h.gguf", llama_cpp)
    config, ref = gguf_config(path), hf.config
    for key in ("layers_block_type", "mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size",
                "num_key_value_heads", "n_group", "topk_group", "routed_scaling_factor", "intermediate_size"):
        assert getattr(config, key) == getattr(ref, key), key
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
