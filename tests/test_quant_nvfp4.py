"""NVFP4 checkpoints (tests/nvfp4_reference.py: ModelOpt via hf_quant_config.json, ModelOpt via config.json,
compressed-tensors nvfp4-pack-quantized) of a tiny dense Qwen3 and a tiny Qwen3-MoE, loaded by our loader on the
exact CPU path: logits match transformers running the dequantised twin, greedy tokens are identical, at tp 1
and tp 2; the layers a checkpoint leaves unquantised are named in the log; experts stay 4.5-bit."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from moe_harness import PROMPT, engine_greedy_matches, hf_logits, paged_logits, save_random, tp_logits
from nvfp4_reference import LAYOUTS, quantise_saved
from test_models_qwen3_moe import TINY_MOE
from transformers import Qwen3Config, Qwen3MoeConfig

from agentbox.layers.experts import FusedMoE
from agentbox.layers.experts.nvfp4 import NvFp4Experts
from agentbox.layers.quant import QuantConfig, QuantMethod
from agentbox.layers.quant.formats import NvFp4Layout
from agentbox.layers.quant.nvfp4 import NvFp4Kernel, NvFp4LinearMethod, nvfp4_kernel_for
from agentbox.models.loader import load_model

pytestmark = pytest.mark.usefixtures("exact_cpu_kernels")

DENSE = Qwen3Config(
    hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False,
    architectures=["Qwen3ForCausalLM"],
)
MOE = Qwen3MoeConfig(**TINY_MOE, norm_topk_prob=True, mlp_only_layers=[1])
MODELS = {"dense": DENSE, "moe": MOE}
CASES = [(m, layout) for m in MODELS for layout in LAYOUTS]


def write(path: Path, model: str, layout: str) -> torch.nn.Module:
    save_random(MODELS[model], path)
    return quantise_saved(path, layout)


@pytest.fixture(scope="module", params=CASES, ids=[f"{m}-{layout}" for m, layout in CASES])
def quantised(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    model, layout = request.param
    path = tmp_path_factory.mktemp("nvfp4") / f"{model}-{layout}"
    twin = write(path, model, layout)
    return model, layout, path, twin, load_model(str(path), torch.float32, "cpu")


def test_logits_and_greedy_tokens_match_the_dequantised_twin(quantised) -> None:  # noqa: ANN001
    model, layout, path, twin, ours = quantised
    qkv = ours.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, NvFp4LinearMethod) and qkv.quant_method.kernel is NvFp4Kernel.DENSE
    skipped = ours.model.model.layers[1].self_attn.o_proj
    assert skipped.quant_method.kind is QuantMethod.UNQUANTIZED
    if model == "moe":
        moe = [m for m in ours.model.modules() if isinstance(m, FusedMoE)]
        assert moe and all(isinstance(m.method, NvFp4Experts) for m in moe)
        codes = "w13_weight" if layout != "compressed-tensors" else "w13_weight_packed"
        assert getattr(moe[0], codes).dtype is torch.uint8  # experts stay 4-bit in memory
    torch.testing.assert_close(paged_logits(ours), hf_logits(twin), atol=1e-4, rtol=1e-4)
    engine_greedy_matches(path, twin, ours)


def test_unquantised_layers_and_the_path_are_named_in_the_log(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from agentbox.layers.quant import nvfp4

    write(tmp_path / "m", "dense", "modelopt")
    nvfp4._logged.clear()  # the path is logged once per process
    with caplog.at_level(logging.INFO, logger="agentbox.layers.quant"):
        load_model(str(tmp_path / "m"), torch.float32, "cpu")
    assert "model.layers.1.self_attn.o_proj: left unquantised by the nvfp4 checkpoint" in caplog.text
    assert "layers.0.self_attn.o_proj" not in caplog.text
    assert "NVFP4 linears on cpu: dense" in caplog.text  # the path taken


def test_fp8_kv_cache_scales_are_left_and_said(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A ModelOpt export with kv_cache_quant_algo FP8 carries k_scale / v_scale; the KV cache here stays in the
    compute dtype: the scales are skipped (counted in the log) and the logits still match the twin."""
    import json

    from safetensors.torch import load_file, save_file

    path = tmp_path / "m"
    twin = write(path, "dense", "modelopt")
    hq = json.loads((path / "hf_quant_config.json").read_text())
    hq["quantization"]["kv_cache_quant_algo"] = "FP8"
    (path / "hf_quant_config.json").write_text(json.dumps(hq))
    state = load_file(str(path / "model.safetensors"))
    for i in range(DENSE.num_hidden_layers):
        state[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(0.02)
        state[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(0.02)
    save_file(state, str(path / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="agentbox.models.weight_loader"):
        ours = load_model(str(path), torch.float32, "cpu")
    assert f"skipped {2 * DENSE.num_hidden_layers} FP8 KV-cache scales" in caplog.text
    torch.testing.assert_close(paged_logits(ours), hf_logits(twin), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_tensor_parallel_2_matches_the_dequantised_twin(tmp_path: Path) -> None:
    dirs = [tmp_path / f"{m}-{layout}" for m, layout in CASES]
    expected = [hf_logits(write(d, m, layout)) for d, (m, layout) in zip(dirs, CASES, strict=True)]
    for case, want, ranks in zip(CASES, expected, tp_logits(dirs), strict=True):
        for got in ranks:  # every rank holds every logit (the head all-gathers the vocabulary)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m, c=case: f"{c}: {m}")
            assert torch.equal(got.argmax(-1), want.argmax(-1)), case  # the greedy token at every position


def test_configs_are_read_and_refused_by_the_field_that_says_so() -> None:
    from nvfp4_reference import compressed_tensors_config, modelopt_config

    class Cfg:
        def __init__(self, q: dict | None) -> None:
            self.quantization_config = q

    ct = QuantConfig.of(Cfg(compressed_tensors_config(["lm_head"])))
    assert (ct.method, ct.nvfp4_layout, ct.input_scales) == (QuantMethod.NVFP4, NvFp4Layout.COMPRESSED_TENSORS, True)
    mo = QuantConfig.of(Cfg(None), {"producer": {}, "quantization": modelopt_config(["lm_head"])})
    assert (mo.method, mo.nvfp4_layout, mo.skip_modules) == (QuantMethod.NVFP4, NvFp4Layout.MODELOPT, ("lm_head",))
    with pytest.raises(ValueError, match="kv_cache_quant_algo"):
        QuantConfig.of(Cfg({"quant_method": "modelopt", **modelopt_config([]), "kv_cache_quant_algo": "NVFP4"}))
    with pytest.raises(ValueError, match="quant_algo 'FP8'"):
        QuantConfig.of(Cfg({"quant_method": "modelopt", **modelopt_config([]), "quant_algo": "FP8"}))
    bad = compressed_tensors_config([])
    bad["config_groups"]["group_0"]["weights"]["group_size"] = 32
    with pytest.raises(ValueError, match="is not NVFP4"):
        QuantConfig.of(Cfg(bad))


def test_the_kernel_a_device_takes() -> None:
    assert nvfp4_kernel_for("cpu", None, True) is NvFp4Kernel.DENSE
    assert nvfp4_kernel_for("cuda", (12, 0), True) is NvFp4Kernel.FP4_GEMM  # RTX 5090 with flashinfer
    assert nvfp4_kernel_for("cuda", (10, 0), True) is NvFp4Kernel.FP4_GEMM  # B200
    assert nvfp4_kernel_for("cuda", (12, 0), False) is NvFp4Kernel.TRITON_W4A16  # no flashinfer / NVFP4A16
    assert nvfp4_kernel_for("cuda", (8, 9), True) is NvFp4Kernel.TRITON_W4A16  # RTX 4090: no FP4 cores
    assert nvfp4_kernel_for("cuda", (9, 0), True) is NvFp4Kernel.TRITON_W4A16  # H100: FP8 cores only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(("model", "layout"), CASES)
def test_nvfp4_on_cuda_in_bf16_matches_the_fp32_twin(model: str, layout: str, tmp_path: Path) -> None:
    """On CUDA the linears take the FP4 GEMM (sm_100 / sm_120 with flashinfer) or the Triton W4A16 kernel, the
    experts the torch reference; bf16 logits match transformers' fp32 run of the dequantised twin."""
    from model_harness import PagedRunner
    from test_gpu import _assert_close_bf16

    twin = write(tmp_path / "m", model, layout)
    ours = load_model(str(tmp_path / "m"), torch.bfloat16, "cuda")
    kernel = ours.model.model.layers[0].self_attn.qkv_proj.quant_method.kernel
    assert kernel in (NvFp4Kernel.FP4_GEMM, NvFp4Kernel.TRITON_W4A16)
    with torch.no_grad():
        expected = twin(torch.tensor([PROMPT])).logits[0]
    got = PagedRunner(ours, device="cuda").step({0: PROMPT})[0].cpu()
    if kernel is NvFp4Kernel.FP4_GEMM:  # W4A4 rounds every activation to e2m1: a looser, relative bound
        assert (got.float() - expected).norm() / expected.norm() < 0.1
    else:
        _assert_close_bf16(got, expected)
