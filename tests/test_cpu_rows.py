"""cpu_rows.c: the torch layers' RMSNorm and rotary embedding on the CPU. The norm is the fused decode's (each row's
squares summed in fp64, whatever rows come with it) and within fp32 rounding of F.rms_norm; the rotary embedding is torch's
own arithmetic, bit for bit; both read q and k heads in place from a qkv row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentbox.kernels import cpu_dense, cpu_gemv
from agentbox.layers.norm import RMSNorm
from agentbox.layers.rotary import RotaryEmbedding, _rotate_half

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="no CPU kernels here")


def test_rms_norm_rows_matches_torch_and_does_not_depend_on_its_company() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 200, generator=g) * 3, torch.randn(200, generator=g)
    got = cpu_dense.rms_norm_rows(x, w, 1e-6)
    torch.testing.assert_close(got, F.rms_norm(x, (200,), w, 1e-6), rtol=1e-5, atol=1e-6)
    # 37 rows: four blocks of eight in vector lanes and five alone; each row alone takes the one-row loop
    alone = torch.cat([cpu_dense.rms_norm_rows(x[i : i + 1], w, 1e-6) for i in range(37)])
    assert torch.equal(got, alone)


def test_rms_norm_rows_reads_heads_in_place_from_a_qkv_row() -> None:
    g = torch.Generator().manual_seed(1)
    t, hq, hkv, d = 11, 6, 2, 32
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    wq = torch.randn(d, generator=g)
    for heads, view in ((hq, q.reshape(t, hq, d)), (hkv, k.reshape(t, hkv, d))):
        assert not view.is_contiguous()
        got = cpu_dense.rms_norm_rows(view, wq, 1e-6)
        assert got.shape == (t, heads, d)
        assert torch.equal(got, cpu_dense.rms_norm_rows(view.contiguous(), wq, 1e-6))
        torch.testing.assert_close(got, F.rms_norm(view, (d,), wq, 1e-6), rtol=1e-5, atol=1e-6)


def test_rms_norm_module_takes_the_kernel_on_the_cpu_only_for_fp32() -> None:
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.linspace(0.5, 1.5, 64)
    x = torch.randn(5, 64)
    assert torch.equal(norm(x), cpu_dense.rms_norm_rows(x, norm.weight, 1e-5))
    assert cpu_dense.rms_norm_rows(x.bfloat16(), norm.weight, 1e-5) is None
    h, res = norm(x, torch.ones(5, 64))
    assert torch.equal(res, x + 1) and torch.equal(h, cpu_dense.rms_norm_rows(x + 1, norm.weight, 1e-5))


def test_rope_rows_is_torchs_arithmetic_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(2)
    rope = RotaryEmbedding(32, 256, theta=10000.0)
    positions = torch.tensor([0, 3, 4, 9, 100, 255, 17])
    t = len(positions)
    qkv = torch.randn(t, 9 * 32, generator=g)
    qk = qkv[:, : 7 * 32].view(t, 7, 32)  # q and k heads side by side in the qkv row (Llama's one call)
    cos, sin = rope._gather(positions, torch.float32)
    want = qk * cos + _rotate_half(qk) * sin
    got = cpu_dense.rope_rows(qk, cos, sin)
    assert got is not None and torch.equal(got, want)
    assert torch.equal(rope.rotate(positions, qk), want)
    part = RotaryEmbedding(16, 256)  # partial rotary: the first 16 channels of each 32-channel head
    c16, s16 = part._gather(positions, torch.float32)
    head = qk[..., :16]
    assert torch.equal(cpu_dense.rope_rows(head, c16, s16), head * c16 + _rotate_half(head) * s16)
    assert cpu_dense.rope_rows(qk.double(), cos.double(), sin.double()) is None
