"""The fused-MoE kernels over quantised experts (kernels/fused_moe_quant.py) against their torch twins: on
CPU under Triton's interpreter (fp32, fp16; small shapes), on CUDA compiled, with bf16 at real expert shapes
in the gpu-marked tests. Each twin is first checked against the format's definition elsewhere in the tree
(int4.dequantize, the dense FP8 method's dequantiser, gpt-oss's MXFP4 layer), so kernel == twin means
kernel == format. A tiny MXFP4 gpt-oss also runs through the kernel end to end."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from agentbox.kernels._quant_triton import WeightFormat
from agentbox.kernels.fused_moe import fused_moe_ref
from agentbox.kernels.fused_moe_quant import (
    fused_moe_fp8,
    fused_moe_fp8_ref,
    fused_moe_int4,
    fused_moe_int4_ref,
    fused_moe_mxfp4,
    fused_moe_mxfp4_ref,
)
from agentbox.kernels.w8a16 import w8a16_block_matmul, w8a16_block_matmul_ref
from agentbox.layers.experts import MoEActivation, activate, mxfp4
from agentbox.layers.quant.fp8 import dequantize_block_fp8
from agentbox.layers.quant.int4 import dequantize, pack_rows_int32

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def routed(t: int, e: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.topk(torch.softmax(torch.randn(t, e, generator=g), -1), k, dim=-1)
    return weights.to(DEVICE), ids.to(DEVICE)


def gpt_oss_act(gate_up: torch.Tensor) -> torch.Tensor:
    return activate(gate_up, MoEActivation.SWIGLU_OAI, 1.702, 7.0)


def close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype is torch.float32:
        torch.testing.assert_close(got.float(), ref.float(), atol=1e-4, rtol=1e-4)
    else:  # fp16 / bf16 against the output's own scale: both sides round each product differently
        tol = (0.02 if dtype is torch.float16 else 0.04) * ref.float().abs().max().item()
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=0.0)


# ---- random experts in each layout, with the dense [E, out, in] weights they stand for ----


def int4_experts(e: int, n: int, k: int, group: int, dtype: torch.dtype, g: torch.Generator):
    """(qweight [E, K/8, N], scale, offset [E, K/g, N], dense [E, N, K] fp32): one expert at a time
    through int4.pack_rows_int32 and int4.dequantize, as contract 1 defines them."""
    q = torch.randint(0, 16, (e, n, k), generator=g, dtype=torch.uint8)
    scale = (torch.rand(e, n, k // group, generator=g) * 0.02 + 0.005).to(dtype)
    offset = (-8 * scale.float() + 0.01 * torch.randn(e, n, k // group, generator=g)).to(dtype)
    qweight = torch.stack([pack_rows_int32(q[i].t().contiguous()) for i in range(e)])
    dense_w = torch.stack([dequantize(q[i], scale[i], offset[i]) for i in range(e)])
    return qweight, scale.transpose(1, 2).contiguous(), offset.transpose(1, 2).contiguous(), dense_w


def fp8_experts(e: int, n: int, k: int, block: tuple[int, int], g: torch.Generator):
    w = (torch.randn(e, n, k, generator=g) * 64).to(torch.float8_e4m3fn)  # normals and subnormals
    scale = torch.rand(e, -(-n // block[0]), -(-k // block[1]), generator=g) * 0.004 + 0.001
    dense_w = torch.stack([dequantize_block_fp8(w[i], scale[i], block) for i in range(e)])
    return w, scale, dense_w


def mxfp4_experts(e: int, n: int, k: int, g: torch.Generator):
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(121, 125, (e, n, k // 32), generator=g, dtype=torch.uint8)  # 2^-6 .. 2^-3
    return blocks, scales


def to(*ts: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(DEVICE) for t in ts]


def floats(*ts: torch.Tensor | None) -> list[torch.Tensor | None]:
    return [None if t is None else t.float() for t in ts]


CASES = [  # (t, e, k, h, inter, dtype, gpt-oss act + biases)
    (1, 4, 2, 64, 64, torch.float32, False),
    (9, 4, 2, 128, 64, torch.float16, True),
]


def biases(e: int, h: int, inter: int, dtype: torch.dtype, g: torch.Generator, on: bool):
    if not on:
        return None, None
    return to((0.1 * torch.randn(e, 2 * inter, generator=g)).to(dtype), (0.1 * torch.randn(e, h, generator=g)).to(dtype))


def act_for(on: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    return gpt_oss_act if on else (lambda gu: activate(gu, MoEActivation.SILU, 0.0, 0.0))


@pytest.mark.parametrize(("t", "e", "k", "h", "inter", "dtype", "oai"), CASES)
def test_int4_experts_equal_their_twin(t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype, oai: bool) -> None:
    g = torch.Generator().manual_seed(t)
    group = 32
    q13, s13, o13, d13 = int4_experts(e, 2 * inter, h, group, dtype, g)
    q2, s2, o2, d2 = int4_experts(e, h, inter, group, dtype, g)
    x = torch.randn(t, h, generator=g).to(dtype)
    b13, b2 = biases(e, h, inter, dtype, g, oai)
    weights, ids = routed(t, e, k, seed=t)
    args = (*to(x, q13, s13, o13, q2, s2, o2), group, weights, ids, act_for(oai), b13, b2)
    ref = fused_moe_int4_ref(*args)
    dense = fused_moe_ref(*to(x.float(), d13, d2), weights, ids, act_for(oai), *floats(b13, b2))
    close(ref, dense, dtype)
    close(fused_moe_int4(*args), ref, dtype)


def test_int4_act_order_experts_equal_their_twin() -> None:
    """GPTQ act-order: each expert's stored K rows are a permutation of its inputs (contract 1's w13_perm /
    w2_perm); the kernel gathers x's columns, the twin puts the dequantised rows back."""
    g = torch.Generator().manual_seed(11)
    t, e, k, h, inter, group = 5, 4, 2, 64, 64, 32
    q13, s13, o13, d13 = int4_experts(e, 2 * inter, h, group, torch.float32, g)
    q2, s2, o2, d2 = int4_experts(e, h, inter, group, torch.float32, g)
    p13 = torch.stack([torch.randperm(h, generator=g) for _ in range(e)])
    p2 = torch.stack([torch.randperm(inter, generator=g) for _ in range(e)])
    # d* hold stored-order columns; the checkpoint's weight has stored column j at input perm[j]
    d13 = torch.empty_like(d13).scatter_(2, p13.unsqueeze(1).expand_as(d13), d13)
    d2 = torch.empty_like(d2).scatter_(2, p2.unsqueeze(1).expand_as(d2), d2)
    x = torch.randn(t, h, generator=g)
    weights, ids = routed(t, e, k, seed=t)
    args = (*to(x, q13, s13, o13, q2, s2, o2), group, weights, ids)
    perms = dict(w13_perm=p13.to(DEVICE), w2_perm=p2.to(DEVICE))
    ref = fused_moe_int4_ref(*args, **perms)
    close(ref, fused_moe_ref(*to(x, d13, d2), weights, ids), torch.float32)
    close(fused_moe_int4(*args, **perms), ref, torch.float32)
    assert not torch.allclose(fused_moe_int4(*args), ref, atol=1e-2)  # the permutation matters


@pytest.mark.parametrize(("t", "e", "k", "h", "inter", "dtype", "oai", "block"), [
    (*CASES[0][:3], 128, 128, torch.float32, False, (128, 128)),
    (*CASES[1][:3], 128, 96, torch.float16, True, (32, 64)),  # blocks of 32 outputs x 64 inputs
])
def test_fp8_experts_equal_their_twin(
    t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype, oai: bool, block: tuple[int, int]
) -> None:
    g = torch.Generator().manual_seed(t)
    w13, s13, d13 = fp8_experts(e, 2 * inter, h, block, g)
    w2, s2, d2 = fp8_experts(e, h, inter, block, g)
    x = torch.randn(t, h, generator=g).to(dtype)
    b13, b2 = biases(e, h, inter, dtype, g, oai)
    weights, ids = routed(t, e, k, seed=t)
    args = (*to(x, w13, s13, w2, s2), block, weights, ids, act_for(oai), b13, b2)
    ref = fused_moe_fp8_ref(*args)
    dense = fused_moe_ref(*to(x.float(), d13, d2), weights, ids, act_for(oai), *floats(b13, b2))
    close(ref, dense, dtype)
    close(fused_moe_fp8(*args), ref, dtype)


@pytest.mark.parametrize("fmt", [WeightFormat.FP8, WeightFormat.FP8_NATIVE])
def test_both_e4m3_decodes_are_exact(fmt: WeightFormat) -> None:
    """Every e4m3 byte (NaN aside) through the shared tile decoder, by arithmetic and by Triton's fp8 type
    (which the interpreter of Triton 3.9 also runs); a diagonal x makes the product the decoded weight."""
    if fmt is WeightFormat.FP8_NATIVE and DEVICE == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton converts e4m3 natively from sm_89 on")
    codes = torch.arange(256, dtype=torch.uint8)
    codes = torch.where((codes & 0x7F) == 0x7F, 0, codes).view(8, 32).view(torch.float8_e4m3fn)  # [N=8, K=32]
    scale = torch.ones(1, 1)
    x = torch.eye(32)
    got = w8a16_block_matmul(*to(x, codes, scale), (128, 128), fmt).cpu()
    torch.testing.assert_close(got, w8a16_block_matmul_ref(x, codes, scale, (128, 128)), atol=0, rtol=0)


@pytest.mark.parametrize(("t", "e", "k", "h", "inter", "dtype", "oai"), CASES)
def test_mxfp4_experts_equal_their_twin(t: int, e: int, k: int, h: int, inter: int, dtype: torch.dtype, oai: bool) -> None:
    g = torch.Generator().manual_seed(t)
    bl13, sc13 = mxfp4_experts(e, 2 * inter, h, g)
    bl2, sc2 = mxfp4_experts(e, h, inter, g)
    x = torch.randn(t, h, generator=g).to(dtype)
    b13, b2 = biases(e, h, inter, dtype, g, oai)
    weights, ids = routed(t, e, k, seed=t)
    args = (*to(x, bl13, sc13, bl2, sc2), weights, ids, act_for(oai), b13, b2)
    close(fused_moe_mxfp4(*args), fused_moe_mxfp4_ref(*args), dtype)


def test_tiny_mxfp4_gpt_oss_through_the_kernel_matches_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole MXFP4 gpt-oss (published layout) with every MoE layer on the fused kernel: prefill logits
    equal transformers' own dequantised load of the same files."""
    from model_harness import PagedRunner
    from moe_harness import PROMPT
    from test_models_gpt_oss import write_mxfp4

    from agentbox.models.loader import load_model

    hf = write_mxfp4(tmp_path)
    ours = load_model(str(tmp_path), torch.float32, DEVICE)
    calls = []
    monkeypatch.setattr(mxfp4, "kernel_runs", lambda x: calls.append(x.shape) or True)
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    got = PagedRunner(ours, device=DEVICE).step({0: PROMPT})[0]
    assert len(calls) == 2  # both layers' experts took the kernel
    torch.testing.assert_close(got.cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the tests above compile them for this GPU")
def test_kernels_compile_to_cubin_without_a_gpu() -> None:
    """The interpreter runs Python, not the compiler: build the real sm_80 / sm_90 binaries too."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}
    script = Path(__file__).with_name("cubin_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("B of cubin") == 9


# ---- bf16 at real expert shapes: CUDA only (the interpreter's bf16 tl.dot is wrong) ----

QWEN3_30B = dict(t=16, e=128, k=8, h=2048, inter=768)  # Qwen3-30B-A3B / Qwen3-Coder-30B-A3B experts
GPT_OSS_20B = dict(t=16, e=32, k=4, h=2880, inter=2880)


@pytest.mark.gpu
@gpu
@torch.inference_mode()
def test_quantised_experts_bf16_at_real_shapes() -> None:
    """Each kernel in bf16 against its twin in fp32 (dequantised experts, fp32 products). The experts are
    drawn on the device (a random int32 word is eight random int4 codes) to keep the GPU check short."""
    torch.manual_seed(0)
    bf, dev = torch.bfloat16, DEVICE

    def rand(*shape: int, lo: float = 0.0, hi: float = 1.0) -> torch.Tensor:
        return torch.rand(*shape, device=dev) * (hi - lo) + lo

    def words(*shape: int) -> torch.Tensor:
        return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device=dev)

    t, e, k, h, inter = (QWEN3_30B[n] for n in ("t", "e", "k", "h", "inter"))
    x = torch.randn(t, h, device=dev, dtype=bf)
    weights, ids = routed(t, e, k, seed=1)
    s13, s2 = rand(e, h // 128, 2 * inter, lo=0.005, hi=0.02).to(bf), rand(e, inter // 128, h, lo=0.005, hi=0.02).to(bf)
    w = (words(e, h // 8, 2 * inter), s13, (-8 * s13).to(bf), words(e, inter // 8, h), s2, (-8 * s2).to(bf),
         128, weights, ids)
    close(fused_moe_int4(x, *w), fused_moe_int4_ref(x.float(), *w), bf)
    w = ((torch.randn(e, 2 * inter, h, device=dev) * 64).to(torch.float8_e4m3fn), rand(e, 2 * inter // 128, h // 128, hi=0.004),
         (torch.randn(e, h, inter, device=dev) * 64).to(torch.float8_e4m3fn), rand(e, h // 128, inter // 128, hi=0.004),
         (128, 128), weights, ids)
    close(fused_moe_fp8(x, *w), fused_moe_fp8_ref(x.float(), *w), bf)

    t, e, k, h, inter = (GPT_OSS_20B[n] for n in ("t", "e", "k", "h", "inter"))
    x = torch.randn(t, h, device=dev, dtype=bf)
    weights, ids = routed(t, e, k, seed=2)

    def u8(*shape: int, lo: int = 0, hi: int = 256) -> torch.Tensor:
        return torch.randint(lo, hi, shape, dtype=torch.uint8, device=dev)

    w = (u8(e, 2 * inter, h // 32, 16), u8(e, 2 * inter, h // 32, lo=121, hi=125),
         u8(e, h, inter // 32, 16), u8(e, h, inter // 32, lo=121, hi=125), weights, ids, gpt_oss_act)
    b13, b2 = (0.1 * torch.randn(e, 2 * inter, device=dev)).to(bf), (0.1 * torch.randn(e, h, device=dev)).to(bf)
    close(fused_moe_mxfp4(x, *w, b13, b2), fused_moe_mxfp4_ref(x.float(), *w, b13.float(), b2.float()), bf)


def test_gpu_bench_report_assembles_on_cpu_at_a_tiny_shape() -> None:
    """agentbox.bench.gpu_moe_quant (the GPU check's moe_quant block) end to end, interpreted, in fp32."""
    from agentbox.bench.gpu_moe_quant import ExpertFormat, MoEShape, report

    tiny = MoEShape("tiny", 4, 2, 128, 128, tuple(ExpertFormat))
    row = report(DEVICE, torch.float32, (tiny,), tokens=(1,), iters=1)["tiny"][0]
    for fmt in ExpertFormat:
        assert row[fmt.value]["rel_err_vs_twin"] < 1e-4
        assert row[fmt.value]["kernel_us"] > 0 and row[fmt.value]["vs_dense_kernel"] > 0
    assert row["int4_g128"]["resident_vs_dense"] == pytest.approx((0.5 + 2 * 4 / 128) / 4)  # all fp32
    assert row["fp8_block128"]["resident_vs_dense"] == pytest.approx((1 + 4 / 128**2) / 4)
    assert row["mxfp4"]["resident_vs_dense"] == pytest.approx((0.5 + 1 / 32) / 4)
    # int4 gate/up (2/3 of the weights: 0.5 + 8 / 32 bytes each), a Q6_K down (0.75 + 4 / 16), over 4 bytes
    assert row["gguf_q4_k_m_q6_k_down"]["resident_vs_dense"] == pytest.approx((2 / 3 * 0.75 + 1 / 3 * 1.0) / 4)
    assert row["mxfp4"]["vs_torch_dequant_per_expert"] > 0
    assert row["experts_routed"] == 2 and row["int4_g128"]["read_gb_s"] > 0  # one token, top 2
