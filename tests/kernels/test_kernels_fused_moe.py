"""The fused-MoE Triton kernel against its torch twin: on CPU under Triton's interpreter (fp32, fp16; small
shapes), on CUDA for real. Alignment invariants checked directly: every routed pair appears once, in its
expert's tiles."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernel is decorated: before the import
pytest.importorskip("triton")

from agentbox.kernels.fused_moe import BLOCK_M, align_to_experts, fused_moe, fused_moe_ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def routed(t: int, e: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), k, dim=-1)
    return weights.to(DEVICE), ids.to(DEVICE)


def test_alignment_puts_every_pair_once_in_its_experts_tiles() -> None:
    _, ids = routed(37, 8, 2)
    pairs, block_expert = align_to_experts(ids, 8, BLOCK_M)
    n = ids.numel()
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n))
    tiles = pairs.view(-1, BLOCK_M)
    for b, e in enumerate(block_expert.tolist()):
        members = tiles[b][tiles[b] < n]
        if e < 0:
            assert members.numel() == 0
        else:
            assert (ids.flatten()[members] == e).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("t", "e", "k", "h", "inter"), [(1, 8, 2, 64, 32), (19, 8, 2, 64, 48), (40, 4, 3, 32, 64)])
def test_fused_moe_equals_reference(dtype: torch.dtype, t: int, e: int, k: int, h: int, inter: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(t, h, generator=g).to(DEVICE, dtype)
    w13 = (0.1 * torch.randn(e, 2 * inter, h, generator=g)).to(DEVICE, dtype)
    w2 = (0.1 * torch.randn(e, h, inter, generator=g)).to(DEVICE, dtype)
    weights, ids = routed(t, e, k, seed=t)
    got = fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_ref(x.float(), w13.float(), w2.float(), weights, ids)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_fused_moe_with_biases_and_another_activation() -> None:
    g = torch.Generator().manual_seed(2)
    t, e, k, h, inter = 9, 8, 2, 32, 32
    x = torch.randn(t, h, generator=g).to(DEVICE)
    w13, w2 = 0.1 * torch.randn(e, 2 * inter, h, generator=g), 0.1 * torch.randn(e, h, inter, generator=g)
    b13, b2 = 0.1 * torch.randn(e, 2 * inter, generator=g), 0.1 * torch.randn(e, h, generator=g)
    weights, ids = routed(t, e, k, seed=3)

    def act(gu: torch.Tensor) -> torch.Tensor:  # gpt-oss-like clamped gate
        gate, up = gu.chunk(2, dim=-1)
        return (up.clamp(-7, 7) + 1) * gate.clamp(max=7) * torch.sigmoid(1.702 * gate.clamp(max=7))

    args = (x, w13.to(DEVICE), w2.to(DEVICE), weights, ids, act, b13.to(DEVICE), b2.to(DEVICE))
    torch.testing.assert_close(fused_moe(*args), fused_moe_ref(*args), atol=1e-4, rtol=1e-4)
