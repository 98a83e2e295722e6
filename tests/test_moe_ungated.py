"""Un-gated experts (Nemotron-H's relu^2: w13 is the up projection alone, `MoEActivation.RELU2`) in the quantised
expert methods, at the layer level against relu^2 experts on the dequantised weights: GGUF experts in each form
the file's types lead to (Q4_K: the int4 form; Q8_0 and Q4_K up with a Q6_K down: the k-bit form; F32: dense),
FP8 block-128 experts, the CPU kernels' repack of them (layers/experts/cpu.py) against its twin, and tensor
parallelism's shard of an un-gated w13 (rows of up, from row 0)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_quant_gguf import quantise

from agentbox.kernels import cpu_gemv
from agentbox.layers.experts import ExpertShard, FusedMoE, MoEActivation, moe_ref, select_experts
from agentbox.layers.experts import cpu as moe_cpu
from agentbox.layers.experts.bits import BitsExperts
from agentbox.layers.experts.fp8 import Fp8BlockExperts
from agentbox.layers.experts.gguf import GGUFExperts
from agentbox.layers.experts.int4 import Int4Experts
from agentbox.layers.experts.unquantized import UnquantizedExperts
from agentbox.layers.quant import QuantConfig, QuantMethod
from agentbox.layers.quant.fp8 import dequantize_block_fp8
from agentbox.layers.quant.gguf import GGUFBlocks
from agentbox.layers.weight_loading import load_weight
from agentbox.parallel.state import set_tp_state

E, H, FFN, K = 4, 256, 256, 2  # whole 256-column K-quant blocks in both projections


def _routed(layer: FusedMoE, up: torch.Tensor, down: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's output and relu^2 experts' on the dense weights (up [E, FFN, H], down [E, H, FFN])."""
    gen = torch.Generator().manual_seed(seed)
    x, logits = torch.randn(7, H, generator=gen), torch.randn(7, E, generator=gen)
    weights, ids = select_experts(logits, K, True)
    ref = moe_ref(x, weights, ids, lambda e: (up[e], down[e]), MoEActivation.RELU2)
    return layer.forward_routed(x, weights, ids), ref


def _gguf(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> GGUFBlocks | torch.Tensor:
    if qtype is Q.F32:
        return torch.from_numpy(w)
    return GGUFBlocks(qtype, w.shape, quantise(w, qtype, rng))


def _gguf_layer(up_type: Q, down_type: Q) -> tuple[FusedMoE, torch.Tensor, torch.Tensor]:
    """An un-gated GGUF expert layer, loaded and post-processed, and its dense (up, down)."""
    rng = np.random.default_rng(0)
    layer = FusedMoE(E, K, H, FFN, renormalize=True, activation=MoEActivation.RELU2, method=GGUFExperts())
    up, down = torch.empty(E, FFN, H), torch.empty(E, H, FFN)
    for e in range(E):
        for param, shard, qtype, dense in ((layer.w13_weight, ExpertShard.UP, up_type, up),
                                           (layer.w2_weight, ExpertShard.DOWN, down_type, down)):
            w = _gguf((0.05 * rng.standard_normal(dense.shape[1:])).astype(np.float32), qtype, rng)
            load_weight(param, w, e, shard)
            dense[e] = w.dequantize() if isinstance(w, GGUFBlocks) else w
    layer.process_weights_after_loading()
    return layer, up, down


@pytest.mark.usefixtures("exact_cpu_kernels")  # the forms themselves (the CPU kernels' repack is a load step)
@pytest.mark.parametrize(("up_type", "down_type", "form"), [
    (Q.Q4_K, Q.Q4_K, Int4Experts), (Q.Q8_0, Q.Q8_0, BitsExperts), (Q.Q4_K, Q.Q6_K, BitsExperts),
    (Q.F32, Q.F32, UnquantizedExperts),
])
def test_ungated_gguf_experts_match_relu2_on_the_dequantised_weights(up_type: Q, down_type: Q, form: type) -> None:
    layer, up, down = _gguf_layer(up_type, down_type)
    assert type(layer.method) is form
    got, ref = _routed(layer, up, down)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpu_gemv.available(), reason="CPU kernels unavailable")
@pytest.mark.parametrize(("up_type", "down_type"), [(Q.Q4_K, Q.Q4_K), (Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0)])
def test_ungated_experts_on_the_cpu_kernels_equal_their_twin(up_type: Q, down_type: Q) -> None:
    layer, up, down = _gguf_layer(up_type, down_type)
    assert moe_cpu.install(layer) and isinstance(layer.method, moe_cpu.CpuExperts)
    gen = torch.Generator().manual_seed(3)
    x, ids = torch.randn(3, H, generator=gen), torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(3)])
    weights = torch.rand(3, K, generator=gen)
    got = layer.method.apply(layer, x, weights, ids)
    twin = layer.method.apply(layer, x, weights, ids, linear=moe_cpu._linear_ref)
    ref = moe_ref(x, weights, ids, lambda e: (up[e], down[e]), MoEActivation.RELU2)
    # each projection equals its twin to summation order; the twin rounds activations to int8 (llama.cpp's way)
    assert (got - twin).abs().max() < 1e-2 * twin.abs().max()
    assert (twin - ref).abs().max() < 5e-2 * ref.abs().max()


def test_ungated_fp8_experts_match_relu2_on_the_dequantised_weights() -> None:
    config = QuantConfig(QuantMethod.FP8_BLOCK, 8)
    layer = FusedMoE(E, K, H, FFN, renormalize=True, activation=MoEActivation.RELU2, method=Fp8BlockExperts(config))
    assert layer.w13_weight.shape == (E, FFN, H)  # up alone
    gen = torch.Generator().manual_seed(1)
    up, down = torch.empty(E, FFN, H), torch.empty(E, H, FFN)
    for e in range(E):
        for name, shard, dense in (("w13", ExpertShard.UP, up), ("w2", ExpertShard.DOWN, down)):
            rows, cols = dense.shape[1:]
            w = (0.5 * torch.randn(rows, cols, generator=gen)).to(torch.float8_e4m3fn)
            scale = 0.01 + 0.1 * torch.rand(rows // 128, cols // 128, generator=gen)
            load_weight(getattr(layer, f"{name}_weight"), w, e, shard)
            load_weight(getattr(layer, f"{name}_weight_scale_inv"), scale, e, shard)
            dense[e] = dequantize_block_fp8(w, scale, (128, 128))
    got, ref = _routed(layer, up, down)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_a_gate_shard_is_refused_by_ungated_experts() -> None:
    layer = FusedMoE(E, K, H, FFN, renormalize=True, activation=MoEActivation.RELU2)
    with pytest.raises(ValueError, match="relu2 experts have no gate projection"):
        load_weight(layer.w13_weight, torch.zeros(FFN, H), 0, ExpertShard.GATE)


@pytest.mark.usefixtures("exact_cpu_kernels")
def test_each_rank_holds_its_rows_of_up() -> None:
    """Rank r of 2 keeps rows [r FFN/2, (r+1) FFN/2) of every expert's up (w13 from row 0: no gate half before it)
    and the same columns of its down, in the k-bit form (Q8_0) and the FP8 one."""
    rng = np.random.default_rng(2)
    up = [(0.05 * rng.standard_normal((FFN, H))).astype(np.float32) for _ in range(E)]
    down = [(0.05 * rng.standard_normal((H, FFN))).astype(np.float32) for _ in range(E)]
    blocks = [(GGUFBlocks(Q.Q8_0, u.shape, quantise(u, Q.Q8_0, rng)), GGUFBlocks(Q.Q8_0, d.shape, quantise(d, Q.Q8_0, rng)))
              for u, d in zip(up, down, strict=True)]
    half = FFN // 2
    try:
        for rank in (0, 1):
            set_tp_state(rank, 2)
            layer = FusedMoE(E, K, H, FFN, renormalize=True, activation=MoEActivation.RELU2, method=GGUFExperts())
            for e, (u, d) in enumerate(blocks):
                load_weight(layer.w13_weight, u, e, ExpertShard.UP)
                load_weight(layer.w2_weight, d, e, ExpertShard.DOWN)
            layer.process_weights_after_loading()
            assert isinstance(layer.method, BitsExperts)
            for e, (u, d) in enumerate(blocks):
                w13, w2 = layer.method.dequantized_expert(layer, e, torch.float32)
                torch.testing.assert_close(w13, u.dequantize()[rank * half : (rank + 1) * half], atol=0, rtol=0)
                torch.testing.assert_close(w2, d.dequantize()[:, rank * half : (rank + 1) * half], atol=0, rtol=0)
    finally:
        set_tp_state(0, 1)
