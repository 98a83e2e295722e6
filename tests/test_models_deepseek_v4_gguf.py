"""DeepSeek-V4 from a GGUF that llama.cpp's own converter wrote (convert_hf_to_gguf.py of the llama.cpp vendored by
the llama-cpp-python 0.3.36 sdist, run from the unpacked sdist: tests/deepseek_v4_gguf.py). The tiny model is
written in DeepSeek's release layout, FP4 experts included (the converter repacks them into MXFP4 blocks), with
SmolLM2's tokenizer (one whose pre-tokenizer the converter knows). Loaded through the GGUF family table
(models/gguf_deepseek_v4.py): fp32 logits equal transformers' for a prefill, a chunked prefill and a decode, and
the engine's greedy tokens equal transformers' at tp 1 and tp 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from deepseek_v4_gguf import convert, converter_dir, round_experts, write_release
from deepseek_v4_models import hf_greedy, hf_logits, randomize, tiny_config
from model_harness import PagedRunner

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.models.gguf_file import gguf_config, open_gguf
from agentbox.models.loader import load_model

PROMPT = [(7 * i + 3) % 251 + 1 for i in range(101)]


@pytest.fixture(scope="module")
def gguf_twin(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer,  # noqa: ANN001
              request: pytest.FixtureRequest) -> tuple[Path, torch.nn.Module]:
    store = getattr(request.config, "cache", None)  # pytest's cache (absent under -p no:cacheprovider)
    cache = Path(store.mkdir("llama-cpp-python")) if store is not None else tmp_path_factory.mktemp("lcpp")
    llama_cpp = converter_dir(cache)
    if llama_cpp is None:
        pytest.skip("llama-cpp-python 0.3.36's sdist is not here and pip could not download it "
                    "(set AGENTBOX_LLAMA_CPP_SDIST to the .tar.gz)")
    d = tmp_path_factory.mktemp("deepseek-v4-gguf")
    hf = randomize(transformers.DeepseekV4ForCausalLM(tiny_config(vocab_size=len(smollm2_tokenizer))).float().eval())
    round_experts(hf)  # the values FP4 holds: the file and the reference have the same experts
    hf.save_pretrained(d / "hf")
    release = write_release(hf, d / "hf", d / "release", smollm2_tokenizer)
    return convert(release, d / "tiny-deepseek-v4.gguf", llama_cpp), hf


def test_the_converter_writes_deepseek4(gguf_twin: tuple[Path, torch.nn.Module]) -> None:
    path, hf = gguf_twin
    reader = open_gguf(path)
    assert reader.metadata["general.architecture"] == "deepseek4"
    types = {t.name: t.qtype.name for t in reader.tensors}
    assert types["blk.1.ffn_gate_exps.weight"] == "MXFP4" and types["blk.0.ffn_gate_tid2eid.weight"] == "I32"
    config = gguf_config(path)
    for key in ("layer_types", "compress_rates", "mlp_layer_types", "hc_mult", "index_topk", "o_groups",
                "sliding_window", "swiglu_limit", "qk_rope_head_dim", "rope_parameters"):
        assert getattr(config, key) == getattr(hf.config, key), key


def test_gguf_logits_match_transformers(gguf_twin: tuple[Path, torch.nn.Module]) -> None:
    path, hf = gguf_twin
    loaded = load_model(str(path), torch.float32, "cpu")
    ref = hf_logits(hf, PROMPT)
    torch.testing.assert_close(PagedRunner(loaded, page_size=8).step({0: PROMPT})[0], ref, atol=5e-5, rtol=5e-5)
    runner = PagedRunner(loaded, page_size=16)
    steps = [runner.step({0: PROMPT[:37]})[0], runner.step({0: PROMPT[37:70]})[0]]
    steps += [runner.step({0: [t]})[0] for t in PROMPT[70:]]
    torch.testing.assert_close(torch.cat(steps), ref, atol=5e-5, rtol=5e-5)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_gguf_engine_greedy_equals_transformers(gguf_twin: tuple[Path, torch.nn.Module], tp: int) -> None:
    path, hf = gguf_twin
    prompts = [PROMPT[:29], PROMPT]
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", num_pages=128, page_size=8,
                          tensor_parallel_size=tp, cpu_threads=1, max_num_batched_tokens=48, speculative="off")
    with LLM(config) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
