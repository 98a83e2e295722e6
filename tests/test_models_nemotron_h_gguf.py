"""Nemotron-H from a GGUF that llama.cpp's own converter wrote (`nemotron_h_moe`: conversion/nemotron.py of the llama.cpp
the llama-cpp-python 0.3.36 sdist vendors, run from the unpacked sdist: tests/deepseek_v4_gguf.py finds or fetches it),
through the GGUF family table (models/gguf_nemotron_h.py): the layer kinds read back from the tensors, A back from
-exp(A_log), and fp32 logits of a prefill, a chunked prefill and decodes equal the transformers twin's; greedy through
the engine too. The converter's Q8_0 file keeps its un-gated experts quantised (the k-bit expert form, up alone in
w13) and equals transformers with the file's dequantised weights, with its experts on the device or in host RAM."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers
from deepseek_v4_gguf import convert, converter_dir
from model_harness import PagedRunner
from nemotron_h_models import hf_greedy, hf_logits, save_nemotron_h, tiny_config

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.layers.experts import FusedMoE
from agentbox.layers.experts.bits import BitsExperts
from agentbox.layers.experts.placement import ExpertHome, ExpertPlacement
from agentbox.models.gguf_file import gguf_config
from agentbox.models.gguf_nemotron_h import nemotron_h_weights
from agentbox.models.gguf_reader import GGUFFile
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


def dequantised_twin(path: Path, config: transformers.NemotronHConfig) -> torch.nn.Module:
    """transformers' model holding the file's weights dequantised (per-expert tensors stacked as it keeps them)."""
    state: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for name, w in nemotron_h_weights(GGUFFile(path), config, keep_quantised=False):
        name = re.sub(r"^backbone\.", "model.", name)
        if (m := re.match(r"(.*\.experts)\.(\d+)\.(up|down)_proj\.weight$", name)) is not None:
            experts.setdefault(f"{m.group(1)}.{m.group(3)}_proj", {})[int(m.group(2))] = w
        else:
            state[name] = w
    state.update({name: torch.stack([ws[e] for e in sorted(ws)]) for name, ws in experts.items()})
    hf = transformers.NemotronHForCausalLM(config).float().eval()
    hf.load_state_dict(state, strict=not config.tie_word_embeddings)
    return hf


@pytest.mark.usefixtures("exact_cpu_kernels")  # the k-bit form itself (the default CPU path repacks it)
def test_converter_q8_0_experts_stay_quantised(llama_cpp: Path, tmp_path: Path, smollm2_tokenizer) -> None:  # noqa: ANN001
    hf = save_nemotron_h(tmp_path / "hf", tiny_config(vocab_size=len(smollm2_tokenizer)))
    smollm2_tokenizer.save_pretrained(tmp_path / "hf")
    path = convert(tmp_path / "hf", tmp_path / "nemotron-h-q8_0.gguf", llama_cpp, "q8_0")
    ours = load_model(str(path), torch.float32, "cpu")
    moes = [m for m in ours.model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 1 and isinstance(moes[0].method, BitsExperts)
    assert moes[0].w13_qweight.shape[-1] == hf.config.moe_intermediate_size  # up alone: no gate rows
    twin = dequantised_twin(path, hf.config)
    expected = hf_logits(twin, LONG)
    assert not torch.allclose(expected, hf_logits(hf, LONG), atol=1e-4)  # Q8_0 moved the weights
    torch.testing.assert_close(PagedRunner(ours, page_size=4).step({0: LONG})[0], expected, atol=2e-4, rtol=2e-4)
    llm = LLM(EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch"), loaded=ours)
    got = llm.generate([LONG[:25]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert got.token_ids == hf_greedy(twin, LONG[:25], 8)
    # the experts in host RAM (`--cpu-moe`): a FusedMoE the loader places, computing the same
    host = load_model(str(path), torch.float32, "cpu", ExpertPlacement.of(True, 0))
    assert [m.home for m in host.model.modules() if isinstance(m, FusedMoE)] == [ExpertHome.HOST]
    torch.testing.assert_close(PagedRunner(host, page_size=4).step({0: LONG})[0], expected, atol=2e-4, rtol=2e-4)
