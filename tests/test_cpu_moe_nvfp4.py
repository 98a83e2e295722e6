"""NVFP4 experts on the CPU kernel (layers/experts/nvfp4_cpu.py, kernels/cpu_nvfp4.c): a tiny Qwen3-MoE NVFP4
checkpoint (tests/nvfp4_reference.py's quantiser) with its experts in host RAM (`--cpu-moe`) computes what it
computes without, on the kernel; the kernel's int8-rounded activations stay within a small bound of the exact
path (--exact-cpu: the dequantising reference, itself equal to transformers on the dequantised twin), whose
greedy tokens --cpu-moe does not change. A tiny GLM-5.3-Flash with NVFP4 routed experts (the profile's estimated
variant: experts quantised, the rest bf16) does the same with its experts in RAM, its exact path equal to
transformers on the dequantised twin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_harness import PROMPT, hf_logits, paged_logits, save_random
from nvfp4_reference import quantise_saved
from test_quant_nvfp4 import MOE

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.kernels import cpu_nvfp4
from agentbox.layers.experts import FusedMoE, nvfp4_cpu
from agentbox.layers.experts.nvfp4 import NvFp4Experts
from agentbox.layers.experts.placement import ExpertHome, ExpertPlacement
from agentbox.layers.quant import int4
from agentbox.models.loader import load_model

pytestmark = pytest.mark.skipif(not cpu_nvfp4.available(), reason="the CPU NVFP4 kernel does not build here")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("nvfp4-moe") / "modelopt"
    save_random(MOE, path)
    return path, quantise_saved(path, "modelopt")


def _experts(loaded) -> list[FusedMoE]:  # noqa: ANN001 - LoadedModel
    return [m for m in loaded.model.modules() if isinstance(m, FusedMoE)]


def test_cpu_moe_equals_without_on_the_kernel_and_stays_near_the_exact_path(checkpoint, monkeypatch) -> None:  # noqa: ANN001
    path, twin = checkpoint
    calls = []
    kernel = cpu_nvfp4.nvfp4_matmul
    monkeypatch.setattr(cpu_nvfp4, "nvfp4_matmul", lambda *a: calls.append(1) or kernel(*a))
    plain = paged_logits(load_model(str(path), torch.float32, "cpu"))
    assert calls  # the experts ran on the kernel, not the reference
    placement = ExpertPlacement.of(True, 0)
    host = load_model(str(path), torch.float32, "cpu", placement)
    layers = _experts(host)
    assert layers and all(m.home is ExpertHome.HOST and isinstance(m.method, NvFp4Experts) for m in layers)
    assert all(m.w13_weight.dtype is torch.uint8 for m in layers)  # 4.5 bits in RAM, as loaded
    torch.testing.assert_close(paged_logits(host), plain, atol=1e-5, rtol=1e-5)
    assert placement.clock.calls > 0
    with int4.cpu_kernel(int4.Int4Kernel.DENSE):  # --exact-cpu: the reference, equal to transformers' twin
        exact = paged_logits(load_model(str(path), torch.float32, "cpu", ExpertPlacement.of(True, 0)))
    torch.testing.assert_close(exact, hf_logits(twin), atol=1e-4, rtol=1e-4)
    # int8 activations per 32 (the kernels' rounding): a bound, not identity. A random router near a tie may pick
    # another expert at a position (this checkpoint: the last decode step's second MoE layer), so one position may
    # leave the bound; every other stays within 1 % and keeps its greedy token.
    close = (plain - exact).abs().amax(-1) < 0.01 * exact.abs().max()
    assert int(close.sum()) >= len(close) - 1
    assert torch.equal(plain.argmax(-1)[close], exact.argmax(-1)[close])


def test_engine_greedy_tokens_with_cpu_moe_equal_without(checkpoint) -> None:  # noqa: ANN001
    path, _ = checkpoint
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for exact in (True, False):
        for cpu_moe in (False, True):
            config = EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch", cpu_moe=cpu_moe,
                                  exact_cpu=exact)
            with LLM(config) as llm:
                tokens[exact, cpu_moe] = llm.generate([PROMPT], params)[0].token_ids
    assert tokens[True, True] == tokens[True, False]  # the exact path: --cpu-moe changes nothing
    assert tokens[False, True] == tokens[False, False]  # the kernel path: neither


def test_the_layer_equals_its_twin_on_few_and_many_rows(checkpoint, monkeypatch) -> None:  # noqa: ANN001
    path, _ = checkpoint
    layer = _experts(load_model(str(path), torch.float32, "cpu", ExpertPlacement.of(True, 0)))[0]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, layer.hidden_size, generator=g)
    ids = torch.randint(0, layer.num_experts, (6, 2), generator=g)
    weights = torch.rand(6, 2, generator=g)
    assert nvfp4_cpu.runs(layer, x)
    twin = nvfp4_cpu.apply(layer, x, weights, ids, linear=nvfp4_cpu._linear_ref)
    torch.testing.assert_close(layer.forward_routed(x, weights, ids), twin, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(int4, "CPU_SIMD_MAX_ROWS", 0)  # every expert over the row limit: dequantise + sgemm
    torch.testing.assert_close(nvfp4_cpu.apply(layer, x, weights, ids), twin, atol=1e-5, rtol=1e-5)
    with int4.cpu_kernel(int4.Int4Kernel.DENSE):
        assert not nvfp4_cpu.runs(layer, x)  # --exact-cpu keeps the reference


def test_host_experts_of_a_bf16_model_run_the_kernel_in_float32(checkpoint) -> None:  # noqa: ANN001
    """A bf16 model (what a GPU runs) with its NVFP4 experts on the host: the globals stay float32 there, the
    hidden state crosses in bf16 and the kernel's output comes back in bf16, as the float32 model's rounded."""
    path, _ = checkpoint
    layer = _experts(load_model(str(path), torch.bfloat16, "cpu", ExpertPlacement.of(True, 0)))[0]
    assert layer.host_dtype is torch.float32 and layer.w13_weight_scale_2.dtype is torch.float32
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, layer.hidden_size, generator=g).bfloat16()
    ids = torch.randint(0, layer.num_experts, (4, 2), generator=g)
    weights = torch.rand(4, 2, generator=g)
    out = layer.forward_routed(x, weights, ids)
    assert out.dtype is torch.bfloat16
    twin = nvfp4_cpu.apply(layer, x.float(), weights, ids, linear=nvfp4_cpu._linear_ref)
    torch.testing.assert_close(out.float(), twin, atol=1e-2, rtol=1e-2)


def _glm_nvfp4(path: Path) -> torch.nn.Module:
    """A tiny GLM-5.3-Flash with its routed experts in NVFP4 (ModelOpt layout) and the rest bf16, as the profile's
    estimated release; returns transformers' model of the dequantised twin."""
    import json
    import re

    import transformers
    from glm5_next_models import save_glm5_next
    from nvfp4_reference import INPUT_AMAX, modelopt_config, pack, quantise
    from safetensors.torch import load_file, save_file

    save_glm5_next(path)
    state = load_file(str(path / "model.safetensors"))
    out, twin = {}, {}
    for name, t in state.items():
        out[name] = twin[name] = t
        if re.search(r"\.mlp\.experts\.\d+\.\w+_proj\.weight$", name):
            codes, scale, stored, twin[name] = quantise(t.float(), "modelopt")
            base = name.removesuffix(".weight")
            out[name], out[f"{base}.weight_scale"] = pack(codes), scale
            out[f"{base}.weight_scale_2"] = torch.tensor(stored)
            out[f"{base}.input_scale"] = torch.tensor(INPUT_AMAX / 2688)
    twin_dir = path.with_name(path.name + "-twin")
    twin_dir.mkdir()
    save_file(twin, str(twin_dir / "model.safetensors"))
    (twin_dir / "config.json").write_text((path / "config.json").read_text())
    save_file(out, str(path / "model.safetensors"))
    unquantised = ["lm_head", "*.mlp.gate", "*self_attn*", "*shared_experts*", "*layers.0.mlp*", "*visual*"]
    (path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt", "version": "0.33.0"},
                                                           "quantization": modelopt_config(unquantised)}))
    return transformers.Glm5NextForConditionalGeneration.from_pretrained(twin_dir, dtype=torch.float32).eval()


def test_glm_5_3_flash_with_nvfp4_experts_in_ram(tmp_path: Path) -> None:
    """Issue 47's model as its planned variant runs it: NVFP4 routed experts in host RAM on the kernel."""
    from hf_reference import hf_causal_logits
    from moe_harness import DECODE

    twin = _glm_nvfp4(tmp_path / "glm")
    path = str(tmp_path / "glm")
    placement = ExpertPlacement.of(True, 0)
    host = load_model(path, torch.float32, "cpu", placement)
    layers = _experts(host)
    assert len(layers) == 4 and all(isinstance(m.method, NvFp4Experts) and m.home is ExpertHome.HOST for m in layers)
    got = paged_logits(host)
    assert placement.clock.calls > 0 and nvfp4_cpu.runs(layers[0], torch.zeros(1, layers[0].hidden_size))
    torch.testing.assert_close(got, paged_logits(load_model(path, torch.float32, "cpu")), atol=1e-5, rtol=1e-5)
    with int4.cpu_kernel(int4.Int4Kernel.DENSE):
        exact = paged_logits(load_model(path, torch.float32, "cpu", ExpertPlacement.of(True, 0)))
    torch.testing.assert_close(exact, hf_causal_logits(twin, PROMPT + DECODE), atol=1e-4, rtol=1e-4)
    close = (got - exact).abs().amax(-1) < 0.02 * exact.abs().max()
    assert int(close.sum()) >= len(close) - 1
