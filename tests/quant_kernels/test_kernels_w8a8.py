"""kernels/w8a8_block.py (block FP8 with per-token-group fp8 activations) against its torch twins, the twin
against the weight-only product it approximates, the FP8 method's kernel choice by compute capability, and
a whole FP8 model through it."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from model_harness import PagedRunner
from quant_checkpoints import PROMPT, write_fp8

from agentbox.kernels import w8a8_block
from agentbox.kernels.w8a8_block import (
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_ref,
    w8a8_block_matmul,
    w8a8_block_matmul_ref,
)
from agentbox.kernels.w8a16 import w8a16_block_matmul_ref
from agentbox.layers.quant import QuantMethod
from agentbox.layers.quant.fp8 import FP8Kernel, fp8_kernel_for
from agentbox.models import loader

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(n, k, generator=gen) * 100).to(torch.float8_e4m3fn)
    return w, torch.rand(-(-n // 128), -(-k // 128), generator=gen) * 0.01 + 1e-4


@pytest.mark.parametrize(("m", "k", "dtype"), [(3, 256, torch.float32), (5, 200, torch.float16)])
def test_group_quantisation_matches_its_twin(m: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 2, k)).to(dtype)  # groups of unlike range
    x[1, :128] = 0  # an all-zero group
    q, s = per_token_group_quant_fp8(x.to(DEVICE), 128)
    q_ref, s_ref = per_token_group_quant_fp8_ref(x, 128)
    torch.testing.assert_close(s.cpu(), s_ref, atol=0, rtol=1e-6)
    differ = q.cpu().view(torch.uint8) != q_ref.view(torch.uint8)
    if DEVICE == "cpu":
        assert not differ.any()  # the interpreter computes what the twin does, bit for bit
    else:  # a GPU's division may round the quotient differently: then one e4m3 step, rarely
        assert (q.cpu().float() - q_ref.float()).abs().le(q_ref.float().abs() * 2**-3).all()
        assert differ.float().mean() < 0.01


def test_e4m3_rounding_is_the_casts_at_every_code_and_tie() -> None:
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[codes.isfinite() & (codes >= 0)].sort().values  # 0 .. 448, subnormals included
    mids = (values[1:] + values[:-1]) / 2  # ties: to the even code
    probe = torch.cat([values, mids, mids * (1 + 2**-20), mids * (1 - 2**-20)])
    probe = torch.cat([probe, -probe])
    x = torch.cat([torch.tensor([448.0]), probe])  # the group's max is 448: its scale is exactly 1
    x = torch.nn.functional.pad(x, (0, -len(x) % 128)).reshape(-1, 128)
    x[:, 0] = 448.0
    q, s = per_token_group_quant_fp8(x.to(DEVICE), 128)
    assert bool((s == 1).all())
    assert torch.equal(q.cpu().view(torch.uint8), x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize(("m", "n", "k", "dtype"), [(1, 128, 256, torch.float32), (9, 200, 384, torch.float16)])
def test_w8a8_matches_its_twin(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    w, scale = _weight(n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    ref = w8a8_block_matmul_ref(x, w, scale, (128, 128))
    got = w8a8_block_matmul(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), (128, 128))
    tol = 1e-4 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), ref.float(), atol=tol * ref.abs().max().item(), rtol=tol)


def test_the_twin_is_the_weight_only_product_up_to_activation_rounding() -> None:
    gen = torch.Generator().manual_seed(1)
    w, scale = _weight(256, 512, gen)
    x = torch.randn(7, 512, generator=gen)
    exact = w8a16_block_matmul_ref(x, w, scale, (128, 128))
    approx = w8a8_block_matmul_ref(x, w, scale, (128, 128))
    rel = (approx - exact).norm() / exact.norm()
    assert 1e-4 < rel < 0.05, rel  # e4m3 activations (3 mantissa bits): a few percent, never exact


def test_w8a8_is_chosen_only_where_the_gpu_has_fp8() -> None:
    assert fp8_kernel_for("cpu", None) is FP8Kernel.DENSE
    assert fp8_kernel_for("cuda", (8, 0)) is FP8Kernel.TRITON  # A100: weight-only
    assert fp8_kernel_for("cuda", (8, 6)) is FP8Kernel.TRITON  # RTX 3090
    for cap in ((8, 9), (9, 0), (10, 0), (12, 0)):  # L40S / 4090, H100, B200, RTX 5090
        assert fp8_kernel_for("cuda", cap) is FP8Kernel.W8A8


def test_fp8_model_through_the_w8a8_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf = write_fp8(tmp_path)
    real = loader.quant_config
    monkeypatch.setattr(loader, "quant_config", lambda src, cfg, cls=None: replace(real(src, cfg, cls), kernel=FP8Kernel.W8A8))
    ours = loader.load_model(str(tmp_path), torch.float32, DEVICE)
    layers = [m for m in ours.model.modules() if getattr(getattr(m, "quant_method", None), "kind", None)
              is QuantMethod.FP8_BLOCK]
    assert len(layers) == 8 and all(m.weight.dtype is torch.float8_e4m3fn for m in layers)
    assert all(m.quant_method.kernel is FP8Kernel.W8A8 for m in layers)
    got = PagedRunner(ours).step({0: PROMPT})[0].cpu()
    # the same model with every product through the torch twin: the kernel must be it, end to end
    monkeypatch.setattr(w8a8_block, "w8a8_block_matmul", w8a8_block_matmul_ref)
    twin = PagedRunner(ours).step({0: PROMPT})[0].cpu()
    torch.testing.assert_close(got, twin, atol=1e-4, rtol=1e-4)
    # and against the dequantised weights in fp32 (transformers): what rounding the activations costs
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    rel = (got - expected).norm() / expected.norm()
    assert 1e-3 < rel < 0.1, rel
