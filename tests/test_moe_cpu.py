"""Quantised MoE experts on CPU through the CPU kernels (layers/experts/cpu.py): int4 and k-bit experts repacked
at load, the same numbers as their twin (the dequantised experts on int8-rounded activations), the file's
bytes resident, and the model's predictions those of the exact path (tests/test_gguf_moe.py's tiny
Qwen3-MoE GGUF: Q4_0, Q4_1, Q4_K, Q4_K + Q6_K down, Q8_0 layers)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_harness import hf_logits, paged_logits
from test_gguf_moe import LAYER_TYPES, _experts, _file_expert_bytes, twin, write_qwen3moe
from top_tokens import assert_top_tokens_agree

from agentbox.kernels import cpu_gemv
from agentbox.layers.experts import cpu as moe_cpu
from agentbox.layers.quant import bits as kbits
from agentbox.layers.quant import int4, resident_weight_bytes
from agentbox.models.loader import load_model

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="CPU kernels unavailable")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen3moe-cpu") / "tiny.gguf"
    return path, twin(write_qwen3moe(path))


def test_int4_experts_take_the_cpu_kernel_at_the_file_size(tiny_gguf) -> None:  # noqa: ANN001
    ours = load_model(str(tiny_gguf[0]), torch.float32, "cpu")
    layers = _experts(ours)
    assert all(isinstance(m.method, moe_cpu.CpuExperts) for m in layers)
    assert [f.bits for f in layers[3].method.forms.values()] == [4, 6]  # Q4_K gate/up, Q6_K down
    # Q4_0 / Q4_1 keep the file's fp16 scales (20 bytes per 32 weights: 20/18 and 20/20 of the file);
    # Q4_K's products of two scales are not exact in fp16, so fp32 (24 bytes, as the int4 form had).
    ratios = [resident_weight_bytes(m) / _file_expert_bytes(t[0]) for m, t in zip(layers[:3], LAYER_TYPES, strict=False)]
    assert ratios == pytest.approx([20 / 18, 20 / 20, 24 / 18], rel=1e-9)
    # Q8_0 experts in cpu_bits' rows: int8 codes and the file's fp16 scales, exactly the file's bytes
    assert resident_weight_bytes(layers[4]) == _file_expert_bytes(LAYER_TYPES[4][0])


@pytest.mark.parametrize("index", [1, 3, 4], ids=["q4_1", "q4_k+q6_k", "q8_0"])
@pytest.mark.parametrize("tokens", [3, 40, -40])  # the kernel for a few rows and for many; -40: dequantise + sgemm
def test_cpu_experts_equal_their_twin(tiny_gguf, tokens: int, index: int, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    if tokens < 0:  # every expert over the row limits: the dequantise + sgemm path
        tokens = -tokens
        monkeypatch.setattr(int4, "CPU_SIMD_MAX_ROWS", 0)
        monkeypatch.setattr(kbits, "CPU_SIMD_MAX_ROWS", 0)
    ours = load_model(str(tiny_gguf[0]), torch.float32, "cpu")
    layer = _experts(ours)[index]
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, layer.hidden_size, generator=gen)
    topk_ids = torch.stack([torch.randperm(layer.num_experts, generator=gen)[:2] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, 2, generator=gen)
    got = layer.method.apply(layer, x, topk_weights, topk_ids)
    ref = layer.method.apply(layer, x, topk_weights, topk_ids, linear=moe_cpu._linear_ref)
    # Each projection equals its twin to summation order (tests/test_cpu_gemv.py); between them a last-bit
    # difference in gate_up can move one int8-rounded activation of down_proj by a step.
    assert (got - ref).abs().max() < 1e-2 * ref.abs().max()
    a_wrong_expert = layer.method.apply(layer, x, topk_weights, (topk_ids + 1) % layer.num_experts)
    assert (a_wrong_expert - ref).abs().max() > 0.1 * ref.abs().max()


@pytest.mark.parametrize("index", [3, 4], ids=["q4_k+q6_k", "q8_0"])
def test_one_token_takes_its_own_path_with_the_batch_numbers(tiny_gguf, index: int) -> None:  # noqa: ANN001
    # A decode step's single token skips the gathers (run_routed's one-token loop): its output is bit for bit
    # its row of a batch of a few tokens (the kernel's path too), and its twin's.
    ours = load_model(str(tiny_gguf[0]), torch.float32, "cpu")
    layer = _experts(ours)[index]
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, layer.hidden_size, generator=gen)
    topk_ids = torch.stack([torch.randperm(layer.num_experts, generator=gen)[:4] for _ in range(3)])
    topk_weights = torch.rand(3, 4, generator=gen)
    batch = layer.method.apply(layer, x, topk_weights, topk_ids)
    for row in range(3):
        one = layer.method.apply(layer, x[row:row + 1], topk_weights[row:row + 1], topk_ids[row:row + 1])
        assert torch.equal(one, batch[row:row + 1])
        ref = layer.method.apply(layer, x[row:row + 1], topk_weights[row:row + 1], topk_ids[row:row + 1],
                                 linear=moe_cpu._linear_ref)
        assert (one - ref).abs().max() < 1e-2 * ref.abs().max()
        swapped = layer.method.apply(layer, x[row:row + 1], topk_weights[row:row + 1].flip(-1), topk_ids[row:row + 1])
        assert (swapped - one).abs().max() > 1e-3 * one.abs().max()  # each weight goes with its own expert


def test_the_model_predicts_as_the_exact_path(tiny_gguf) -> None:  # noqa: ANN001
    path, hf = tiny_gguf
    fast = paged_logits(load_model(str(path), torch.float32, "cpu"))
    with int4.cpu_kernel(int4.Int4Kernel.DENSE):
        exact = load_model(str(path), torch.float32, "cpu")
    assert not any(isinstance(m.method, moe_cpu.CpuExperts) for m in _experts(exact))
    expected = hf_logits(hf)
    torch.testing.assert_close(paged_logits(exact), expected, atol=1e-4, rtol=1e-4)
    # int8-rounded activations (llama.cpp's arithmetic) in every expert layer: close to the exact logits
    # (measured 6.7 % of the range at worst on this random model), the same top tokens
    # same top tokens wherever the top two are further apart than the difference (measured: 9 of 18 positions)
    assert_top_tokens_agree(fast, expected, max_err=0.1 * expected.abs().max().item(), min_decided=0.25)


@pytest.mark.parametrize("index", [3, 4], ids=["q4_k+q6_k", "q8_0"])
def test_the_c_expert_loop_is_the_torch_loop(tiny_gguf, index: int) -> None:  # noqa: ANN001
    # kernels/cpu_moe.c's ab_moe_routed (every CpuExperts call) against run_routed's torch loop over the same kernels,
    # at enough rows an expert for the AMX tiles where the CPU has them: the same experts, weights, order and roundings
    # of the adds; only the SiLU's exp differs (~1 ulp), which can move one int8-rounded activation of down by a step.
    ours = load_model(str(tiny_gguf[0]), torch.float32, "cpu")
    layer = _experts(ours)[index]
    gen = torch.Generator().manual_seed(11)
    tokens = 24 * layer.num_experts  # ~48 rows an expert at top-2
    x = torch.randn(tokens, layer.hidden_size, generator=gen)
    topk_ids = torch.stack([torch.randperm(layer.num_experts, generator=gen)[:2] for _ in range(tokens)])
    topk_weights = torch.rand(tokens, 2, generator=gen)
    got = layer.method.apply(layer, x, topk_weights, topk_ids)
    loop = moe_cpu.run_routed(layer, x, topk_weights, topk_ids, moe_cpu._linear)
    scale = loop.abs().max()
    assert (got - loop).abs().max() <= 1e-3 * scale
    assert (got - loop).abs().max(dim=1).values.median() <= 1e-6 * scale  # most rows bit for bit or an ulp
    swapped = layer.method.apply(layer, x, topk_weights.flip(1), topk_ids)  # each weight on the other expert
    assert (swapped - loop).abs().max() > 0.05 * scale
