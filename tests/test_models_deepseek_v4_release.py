"""DeepSeek-V4 as DeepSeek releases it: FP8 (e4m3 with an E8M0 `scale` per 128 x 128 block) for the weights the
release quantises, bf16/fp32 for the ones it keeps, routed experts as FP4 with an E8M0 `scale` per 32 values
(MXFP4), quantization_config fp8 with `scale_fmt: ue8m0` and `expert_dtype: fp4` (tests/deepseek_v4_gguf.py
`write_release(..., fp8=True)`). The twin's weights are rounded in place to what the file holds, so fp32 logits of
the engine on the release equal transformers' on the twin (prefill, chunked prefill, decode) and the greedy tokens
do, with the experts in host RAM (`--cpu-moe`) too, and at tensor parallel 2. What the loader cannot hold is
refused, naming the tensor.
The experts are 128 wide here (32 in the other tests): the shared expert's gate and up, merged into one FP8 linear,
must each start on a 128-row block, as the release's 2,048 do."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from deepseek_v4_gguf import FP8_RELEASE, round_experts, round_fp8, write_release
from deepseek_v4_models import hf_greedy, hf_logits, randomize, tiny_config
from model_harness import PagedRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.layers.experts.mxfp4 import Mxfp4Experts
from agentbox.layers.experts.placement import ExpertHome
from agentbox.layers.quant import QuantConfig, QuantMethod
from agentbox.layers.quant.fp8 import FP8BlockLinearMethod
from agentbox.layers.quant.unquantized import UnquantizedLinearMethod
from agentbox.models.checkpoint_scan import TensorInfo, unquantised_linears
from agentbox.models.deepseek_v4 import DeepseekV4ForCausalLM
from agentbox.models.loader import LoadedModel, load_model

PROMPT = [(7 * i + 3) % 251 + 1 for i in range(101)]
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, LoadedModel, torch.Tensor]:
    d = tmp_path_factory.mktemp("deepseek-v4-release")
    hf = randomize(transformers.DeepseekV4ForCausalLM(tiny_config(moe_intermediate_size=128)).float().eval())
    unrounded = hf_logits(hf, PROMPT)
    round_experts(hf)
    assert round_fp8(hf) == 4 * 5 + 2 + 4 * 3  # wq_a wq_b wkv wo_a wo_b a layer, 2 CSA indexers, 3 shared
    hf.save_pretrained(d / "hf")
    path = write_release(hf, d / "hf", d / "release", fp8=True)
    return path, hf, load_model(str(path), torch.float32, "cpu"), unrounded


def test_the_file_holds_what_the_release_holds(release: tuple[Path, torch.nn.Module, LoadedModel, torch.Tensor]) -> None:
    path, _, loaded, _ = release
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}
    # E8M0 scales in both dtypes a checkpoint may hold them in: float8_e8m0fnu here, uint8 for the experts
    assert dtypes["layers.0.attn.wq_a.weight"] == "F8_E4M3" and dtypes["layers.0.attn.wq_a.scale"] == "F8_E8M0"
    assert dtypes["layers.1.ffn.experts.2.w2.weight"] == "I8" and dtypes["layers.1.ffn.experts.2.w2.scale"] == "U8"
    assert dtypes["layers.0.attn.compressor.wkv.weight"] == "F32" and "layers.0.attn.compressor.wkv.scale" not in dtypes
    assert sum(n.endswith(".weight") and dtypes[n] == "F8_E4M3" for n in dtypes) == 34
    attn = loaded.model.layers[0].attn
    fp8 = [attn.wq_a, attn.wq_b, attn.wkv, attn.wo_a, attn.wo_b, attn.indexer.wq_b, loaded.model.layers[0].ffn.shared_experts.w13]
    kept = [attn.compressor.wkv, attn.compressor.wgate, attn.indexer.weights_proj, attn.indexer.compressor.wkv]
    assert all(isinstance(m.quant_method, FP8BlockLinearMethod) for m in fp8)
    assert all(isinstance(m.quant_method, UnquantizedLinearMethod) for m in kept)
    assert all(isinstance(block.ffn.experts.method, Mxfp4Experts) for block in loaded.model.layers)


def test_release_logits_match_the_rounded_twin(release: tuple[Path, torch.nn.Module, LoadedModel, torch.Tensor]) -> None:
    _, hf, loaded, unrounded = release
    ref = hf_logits(hf, PROMPT)
    assert (ref - unrounded).abs().max() > 1e-2  # FP8 and FP4 rounding move the logits: a test that can fail
    torch.testing.assert_close(PagedRunner(loaded, page_size=8).step({0: PROMPT})[0], ref, **TOL)
    runner = PagedRunner(loaded, page_size=16)
    steps = [runner.step({0: PROMPT[:37]})[0], runner.step({0: PROMPT[37:70]})[0]]
    steps += [runner.step({0: [t]})[0] for t in PROMPT[70:]]
    torch.testing.assert_close(torch.cat(steps), ref, **TOL)


@pytest.mark.parametrize("cpu_moe", [False, True])
def test_release_engine_greedy_equals_transformers(release: tuple[Path, torch.nn.Module, LoadedModel, torch.Tensor],
                                                   cpu_moe: bool) -> None:
    path, hf, _, _ = release
    prompts = [PROMPT[:29], PROMPT]
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", num_pages=128, page_size=8, cpu_threads=1,
                          max_num_batched_tokens=48, speculative="off", cpu_moe=cpu_moe)
    with LLM(config) as llm:
        homes = {m.home for m in llm.core.runner.loaded.model.modules() if hasattr(m, "home")}
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert homes == {ExpertHome.HOST if cpu_moe else ExpertHome.DEVICE}
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]


def _rewrite(release_dir: Path, to: Path, name: str, tensor: torch.Tensor) -> Path:
    shutil.copytree(release_dir, to)
    tensors = load_file(to / "model.safetensors")
    tensors[name] = tensor
    save_file(tensors, to / "model.safetensors", metadata={"format": "pt"})
    return to


def test_what_cannot_be_held_is_refused_by_name(release: tuple[Path, torch.nn.Module, LoadedModel, torch.Tensor],
                                                tmp_path: Path) -> None:
    path, _, _, _ = release
    name = "layers.2.attn.wo_b.weight"
    assert FP8_RELEASE.search(name)
    bf16 = _rewrite(path, tmp_path / "bf16", name, torch.zeros(64, 32, dtype=torch.bfloat16))  # hidden x o_groups*rank
    with pytest.raises(ValueError, match=r"layers\.2\.attn\.wo_b\.weight: torch\.bfloat16 where"):
        load_model(str(bf16), torch.float32, "cpu")
    scale = _rewrite(path, tmp_path / "scale", "layers.1.ffn.experts.3.w1.scale", torch.ones(128, 2))
    with pytest.raises(ValueError, match=r"layers\.1\.ffn\.experts\.3 \(gate\) scale: .*not torch\.float32"):
        load_model(str(scale), torch.float32, "cpu")


def test_unquantised_linears_are_read_off_the_tensors() -> None:
    fp8, scale = TensorInfo("F8_E4M3", 2), TensorInfo("F8_E8M0", 2)
    infos = {
        "layers.0.attn.wq_a.weight": fp8, "layers.0.attn.wq_a.scale": scale,
        "layers.0.attn.compressor.wkv.weight": TensorInfo("F32", 2),
        "model.layers.0.ffn.shared_experts.w1.weight": TensorInfo("BF16", 2),  # transformers' names, a fused part
        "layers.0.attn.wo_b.weight": fp8,  # FP8 without its scale stays FP8: the load names the missing scale
        "layers.0.attn_norm.weight": TensorInfo("F32", 1),
        "layers.0.ffn.experts.0.w1.weight": TensorInfo("I8", 2),  # the experts' method decides those
    }
    assert unquantised_linears(infos, DeepseekV4ForCausalLM) == {"layers.0.attn.compressor.wkv",
                                                                  "layers.0.ffn.shared_experts.w13"}


def test_the_config_chooses_the_methods() -> None:
    base = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    of = lambda q, **kw: QuantConfig.of(transformers.PretrainedConfig(quantization_config=q, **kw))  # noqa: E731
    assert of(base | {"scale_fmt": "ue8m0"}, expert_dtype="fp4").experts is QuantMethod.MXFP4
    assert of(base | {"expert_dtype": "fp4"}).experts is QuantMethod.MXFP4  # V4.1 keeps it inside
    assert of(base).experts is None  # the experts are FP8 as the linears are (Qwen3-*-FP8)
    for bad, match in (({"expert_dtype": "int4"}, "expert_dtype 'int4'"), ({"fmt": "e5m2"}, "fmt 'e5m2'"),
                       ({"scale_fmt": "e4m3"}, "scale_fmt 'e4m3'")):
        with pytest.raises(ValueError, match=match):
            of(base | bad)


def test_the_release_config_is_what_transformers_reads(release: tuple[Path, torch.nn.Module, LoadedModel, torch.Tensor]) -> None:
    path, _, _, _ = release
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.quantization_config["expert_dtype"] == "fp4"  # transformers moves V4's into quantization_config
    assert json.loads((path / "config.json").read_text())["expert_dtype"] == "fp4"


@pytest.mark.slow
def test_release_tp2_greedy_equals_transformers(tmp_path: Path) -> None:
    """Tensor parallel 2 splits wq_b's rows, wo_a's groups, wo_b's and the shared expert's inputs and the experts'
    intermediate size: each FP8 shard must be whole 128-blocks, so the dims here are twice the release's block
    (heads x head_dim 256, o_groups x o_lora_rank 256, experts 256 wide)."""
    config = tiny_config(head_dim=64, o_lora_rank=128, moe_intermediate_size=256)
    hf = randomize(transformers.DeepseekV4ForCausalLM(config).float().eval())
    round_experts(hf)
    round_fp8(hf)
    hf.save_pretrained(tmp_path / "hf")
    path = write_release(hf, tmp_path / "hf", tmp_path / "release", fp8=True)
    prompts = [PROMPT[:29], PROMPT]
    engine = EngineConfig(model=str(path), device="cpu", dtype="float32", num_pages=128, page_size=8,
                          tensor_parallel_size=2, cpu_threads=1, max_num_batched_tokens=48, speculative="off")
    with LLM(engine) as llm:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 6) for p in prompts]
