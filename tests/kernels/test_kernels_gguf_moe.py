"""The int4 experts a GGUF file turns into (the Q4_K layer of the tiny qwen3moe of test_gguf_moe) through the
fused-MoE int4 kernel equal Int4Experts' torch reference (Triton's interpreter on CPU): the layout the
conversion writes is the one the kernel reads. One layer: once in the canonical form the GGUF type is gone
(test_gguf_moe checks every type's conversion exactly). The Q4_K_M layer of test_gguf_moe_bits (int4 gate/up,
Q6_K down) through fused_moe_bits, so (every k-bit form runs through it in tests/quant_kernels). Un-gated experts
(Nemotron-H's relu^2, tests/test_moe_ungated.py: w13 the up rows alone) through both kernels."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from test_gguf_moe import LAYER_TYPES, Q, write_qwen3moe
from test_gguf_moe_bits import LAYER_TYPES as BITS_LAYER_TYPES
from test_moe_ungated import _gguf_layer

from agentbox.layers.experts import FusedMoE, MoEActivation, activate, select_experts
from agentbox.layers.experts.bits import BitsExperts
from agentbox.layers.experts.gguf import GROUP
from agentbox.layers.experts.int4 import Int4Experts
from agentbox.models.loader import load_model

fused_moe_quant = pytest.importorskip("agentbox.kernels.fused_moe_quant")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else Triton's interpreter (tests/kernels/conftest.py)


@pytest.mark.usefixtures("exact_cpu_kernels")  # the canonical form (on CPU the default repacks it: moe_cpu)
def test_gguf_int4_experts_through_the_kernel_equal_the_reference(tmp_path: Path) -> None:
    write_qwen3moe(tmp_path / "tiny.gguf")
    ours = load_model(str(tmp_path / "tiny.gguf"), torch.float32, "cpu")
    moe = [m for m in ours.model.modules() if isinstance(m, FusedMoE)]
    m = moe[LAYER_TYPES.index((Q.Q4_K,) * 3)]
    assert isinstance(m.method, Int4Experts)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, m.hidden_size, generator=gen)
    weights, ids = select_experts(torch.randn(3, m.num_experts, generator=gen), m.top_k, True)
    expected = m.method.apply(m, x, weights, ids)
    params = [getattr(m, f"{w}_{p}").to(DEVICE) for w in ("w13", "w2") for p in ("qweight", "scale", "offset")]
    act = partial(activate, activation=m.activation, alpha=m.swiglu_alpha, limit=m.swiglu_limit)
    got = fused_moe_quant.fused_moe_int4(x.to(DEVICE), *params, GROUP, weights.to(DEVICE), ids.to(DEVICE), act)
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.usefixtures("exact_cpu_kernels")  # the k-bit form (on CPU the default repacks it: moe_cpu)
def test_gguf_kbit_experts_through_the_kernel_equal_the_reference(tmp_path: Path) -> None:
    write_qwen3moe(tmp_path / "tiny.gguf", seed=1, layer_types=BITS_LAYER_TYPES)
    ours = load_model(str(tmp_path / "tiny.gguf"), torch.float32, "cpu")
    gen = torch.Generator().manual_seed(0)
    moes = [m for m in ours.model.modules() if isinstance(m, FusedMoE)]
    m = moes[BITS_LAYER_TYPES.index((Q.Q4_K, Q.Q4_K, Q.Q6_K))]
    assert isinstance(m.method, BitsExperts)
    x = torch.randn(3, m.hidden_size, generator=gen)
    weights, ids = select_experts(torch.randn(3, m.num_experts, generator=gen), m.top_k, True)
    expected = m.method.apply(m, x, weights, ids)  # CPU: the reference, dequantising the routed experts
    w13, w2 = (
        fused_moe_quant.BitsWeights(*(None if t is None else t.to(DEVICE) for t in m.method.tensors(m, w)), f.group, f.bits)
        for w, f in m.method.forms.items()
    )
    act = partial(activate, activation=m.activation, alpha=m.swiglu_alpha, limit=m.swiglu_limit)
    got = fused_moe_quant.fused_moe_bits(x.to(DEVICE), w13, w2, weights.to(DEVICE), ids.to(DEVICE), act)
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.usefixtures("exact_cpu_kernels")
@pytest.mark.parametrize(("up", "down"), [(Q.Q4_K, Q.Q4_K), (Q.Q4_K, Q.Q6_K)], ids=["int4", "kbit"])
def test_ungated_experts_through_the_kernels_equal_the_reference(up: Q, down: Q) -> None:
    m, _, _ = _gguf_layer(up, down)
    assert m.activation is MoEActivation.RELU2
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, m.hidden_size, generator=gen)
    weights, ids = select_experts(torch.randn(3, m.num_experts, generator=gen), m.top_k, True)
    expected = m.method.apply(m, x, weights, ids)
    act = partial(activate, activation=m.activation, alpha=m.swiglu_alpha, limit=m.swiglu_limit)
    args = (weights.to(DEVICE), ids.to(DEVICE), act)
    if isinstance(m.method, Int4Experts):
        params = [getattr(m, f"{w}_{p}").to(DEVICE) for w in ("w13", "w2") for p in ("qweight", "scale", "offset")]
        got = fused_moe_quant.fused_moe_int4(x.to(DEVICE), *params, GROUP, *args)
    else:
        w13, w2 = (
            fused_moe_quant.BitsWeights(*(None if t is None else t.to(DEVICE) for t in m.method.tensors(m, w)),
                                        f.group, f.bits)
            for w, f in m.method.forms.items()
        )
        got = fused_moe_quant.fused_moe_bits(x.to(DEVICE), w13, w2, *args)
    torch.testing.assert_close(got.cpu(), expected, atol=2e-5, rtol=2e-5)
