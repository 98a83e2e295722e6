"""GGUF Q2_K and Q3_K kept quantised on CPU (issues 43, 44): `bits_groups` maps their blocks exactly onto 2- and
3-bit codes with a scale (and, for Q2_K, an offset) per 16 columns; dense linears and MoE experts in those types
run kernels/cpu_bits.c (layers/quant/gguf.py, layers/experts/gguf.py and cpu.py), and a tiny Qwen3-MoE whose
experts are Q2_K / Q3_K, served with `--cpu-moe`, computes what its dequantised twin does: logits within the
int8 activations' tolerance on the kernel path, the same greedy tokens on the exact one. On a GPU these types
are still dequantised at load (no GPU kernel runs them)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from model_harness import PagedRunner
from moe_harness import engine_greedy_matches, hf_logits, paged_logits
from test_gguf_moe import _experts, qwen3moe_config, twin, write_qwen3moe
from test_quant_gguf import quantise, write_quantised
from test_quant_gguf import twin as llama_twin

from agentbox.kernels import cpu_bits, cpu_gemv
from agentbox.layers.experts.bits import BitsExperts
from agentbox.layers.experts.cpu import CpuExperts, _linear_ref
from agentbox.layers.experts.placement import ALL_LAYERS, ExpertPlacement
from agentbox.layers.quant import bits, int4, resident_weight_bytes
from agentbox.layers.quant.gguf import CPU_BITS_OF, GGUFBlocks, GGUFLinearMethod, bits_groups
from agentbox.layers.quant.quant_rows import BitsRows
from agentbox.models.loader import load_model

Q = GGMLQuantizationType
needs_kernels = pytest.mark.skipif(not cpu_gemv.available(), reason=f"CPU kernels: {cpu_gemv.unavailable_reason()}")
# llama.cpp's Q2_K file type keeps ffn_down in Q3_K; a layer of each type alone; gate and up of different types
# (w13 promoted exactly to 3 bits with Q2_K's offsets) beside a Q6_K down
LAYER_TYPES = [(Q.Q2_K, Q.Q2_K, Q.Q3_K), (Q.Q3_K,) * 3, (Q.Q2_K,) * 3, (Q.Q2_K, Q.Q3_K, Q.Q6_K)]


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K], ids=lambda q: q.name)
def test_bits_groups_are_exactly_gguf_dequantize(qtype: Q) -> None:
    rng = np.random.default_rng(5)
    w = np.zeros((13, 768), dtype=np.float32)  # odd rows, three super-blocks
    blocks = GGUFBlocks(qtype, w.shape, quantise(w, qtype, rng))
    g = bits_groups(blocks)
    assert (g.bits, g.group, g.offset is not None) == (CPU_BITS_OF[qtype], 16, qtype is Q.Q2_K)
    assert int(g.codes.max()) < 2**g.bits and len(torch.unique(g.codes)) == 2**g.bits  # every bit decoded
    assert torch.equal(g.dequantize(), blocks.dequantize())  # bit for bit: gguf's own fp32 products


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("q2k-moe") / "tiny-q2k.gguf"
    return path, twin(write_qwen3moe(path, seed=2, layer_types=LAYER_TYPES), qwen3moe_config(len(LAYER_TYPES)))


@needs_kernels
def test_q2_k_q3_k_experts_with_cpu_moe_run_the_kernel(tiny_moe) -> None:  # noqa: ANN001
    path, hf = tiny_moe
    placement = ExpertPlacement.of(True, 0)
    loaded = load_model(str(path), torch.float32, "cpu", placement)
    layers = _experts(loaded)
    assert all(isinstance(m.method, CpuExperts) for m in layers) and placement.host_layers == ALL_LAYERS
    forms = [(m.method.forms["w13"].bits, m.method.forms["w2"].bits) for m in layers]
    assert forms == [(2, 3), (3, 3), (2, 2), (3, 6)]
    # Q3_K is symmetric in the kernel's form (its offset was its centre); Q2_K keeps its mins
    assert [m.method.forms["w2"].has_offset for m in layers] == [False, False, True, False]
    assert layers[3].method.forms["w13"].has_offset  # the merged w13: Q2_K's mins, Q3_K's centre as an offset
    # resident at the kernel form's bits: 2.75 (Q2_K) and 3.625 (Q3_K) a weight, 2 x 256 x 256 + 256 x 256 each
    per_expert = {2: 2.75, 3: 3.625}
    for m, (b13, b2) in zip(layers[:3], forms, strict=False):
        want = m.num_experts * 256 * 256 * (2 * per_expert[b13] + per_expert[b2]) / 8
        assert sum(p.numel() for p in m.parameters() if p.dtype is torch.uint8) == want
    expected = hf_logits(hf)
    got = paged_logits(loaded)
    # int8-rounded activations (as llama.cpp): close to the twin, not equal
    assert (got - expected).abs().max() < 0.02 * expected.abs().max()
    assert placement.clock.calls > 0
    # the twin of the kernel path: the same loop over the dequantised experts, on the same rounded activations
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))  # seeded: a tie in int8 rounding is rare, not never
    ids, weights = torch.tensor([[0, 1], [2, 3], [1, 2], [0, 3], [3, 1]]), torch.rand(5, 2)
    for m in layers:
        ref = m.method.apply(m, x, weights, ids, linear=_linear_ref)
        torch.testing.assert_close(m.method.apply(m, x, weights, ids), ref, atol=1e-5 * ref.abs().max(), rtol=1e-5)


def test_q2_k_q3_k_experts_with_cpu_moe_exact_path(tiny_moe) -> None:  # noqa: ANN001
    """--exact-cpu: the experts stay quantised (k-bit form, fp32 scales) and the reference dequantises each
    routed expert: the twin's logits, and transformers' greedy tokens through the engine."""
    path, hf = tiny_moe
    with int4.cpu_kernel(int4.Int4Kernel.DENSE):
        loaded = load_model(str(path), torch.float32, "cpu", ExpertPlacement.of(True, 0))
    layers = _experts(loaded)
    assert all(isinstance(m.method, BitsExperts) for m in layers)
    assert [m.method.forms["w13"].bits for m in layers] == [2, 3, 2, 3]
    torch.testing.assert_close(paged_logits(loaded), hf_logits(hf), atol=1e-4, rtol=1e-4)
    with engine_greedy_matches(path, hf, loaded):
        pass


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K], ids=lambda q: q.name)
def test_dense_linears_in_q2_k_q3_k_run_the_cpu_kernel(qtype: Q, tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    tables = {"embed_tokens": qtype, "lm_head": Q.Q3_K if qtype is Q.Q2_K else Q.Q2_K}
    state = write_quantised(path, qtype, overrides=tables)
    hf = llama_twin(state)
    ours = load_model(str(path), torch.float32, "cpu")
    layers = [m for m in ours.model.modules() if isinstance(getattr(m, "quant_method", None), GGUFLinearMethod)]
    assert layers and all(m.bits_kernel is bits.BitsKernel.CPU_SIMD and m.bits == CPU_BITS_OF[qtype] for m in layers)
    assert all(isinstance(m.bits_cpu, cpu_bits.BitsCPU) for m in layers)
    weights = sum(m.input_size * m.output_size for m in layers)
    assert sum(resident_weight_bytes(m) for m in layers) * 8 == weights * {Q.Q2_K: 2.75, Q.Q3_K: 3.625}[qtype]
    # the vocabulary tables stay quantised too, in the same kernel's rows: a lookup is the file's rows exactly
    embed, head = ours.model.model.embed_tokens, ours.model.lm_head
    assert isinstance(embed.quant, BitsRows) and isinstance(head.quant, BitsRows)
    ids = torch.tensor([[3, 127], [0, 64]])
    assert torch.equal(embed(ids), state["model.embed_tokens.weight"][ids])
    x = torch.randn(3, 256)
    ref = torch.nn.functional.linear(cpu_gemv.round_activations(x), state["lm_head.weight"])
    torch.testing.assert_close(head(x), ref, atol=1e-5 * ref.abs().max(), rtol=1e-5)
    prompt = torch.tensor([[5, 17, 100, 3, 99, 42, 7, 120]])
    with torch.no_grad():
        expected = hf(prompt).logits[0]
    got = PagedRunner(ours, page_size=4).step({0: prompt[0].tolist()})[0]
    assert (got - expected).abs().max() < 0.02 * expected.abs().max()


def test_each_rank_holds_its_half_of_every_q2_k_q3_k_expert(tiny_moe) -> None:  # noqa: ANN001
    """tp 2 without processes: rank r's Q2_K / Q3_K experts (on CPU, the k-bit form at 2 / 3 bits) dequantise to
    rows [r I/2, (r+1) I/2) of the twin's gate and up and the same columns of its down (128 of a super-block's
    256, cut at a 16-column group)."""
    from agentbox.parallel.state import set_tp_state

    path, hf = tiny_moe
    half = 256 // 2
    try:
        for rank in (0, 1):
            set_tp_state(rank, 2)
            with int4.cpu_kernel(int4.Int4Kernel.DENSE):
                ours = load_model(str(path), torch.float32, "cpu")
            for layer, (moe, ref) in enumerate(zip(_experts(ours), hf.model.layers, strict=True)):
                assert isinstance(moe.method, BitsExperts) and moe.method.forms["w13"].bits in (2, 3)
                gate_up, down = ref.mlp.experts.gate_up_proj, ref.mlp.experts.down_proj
                rows = torch.cat([torch.arange(half) + rank * half, 256 + torch.arange(half) + rank * half])
                for e in range(moe.num_experts):
                    w13, w2 = moe.method.dequantized_expert(moe, e, torch.float32)
                    assert torch.equal(w13, gate_up[e, rows]), f"layer {layer} w13"
                    assert torch.equal(w2, down[e, :, rank * half : (rank + 1) * half]), f"layer {layer} w2"
    finally:
        set_tp_state(0, 1)
