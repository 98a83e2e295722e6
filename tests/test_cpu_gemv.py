"""The AVX2 weight-only kernels (kernels/cpu_gemv.c) against their torch twins, and the CPU path they make
the default for GGUF / AWQ / GPTQ weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from agentbox.kernels import cpu_gemv as cg
from agentbox.layers.quant import int4

pytestmark = pytest.mark.skipif(not cg.available(), reason=f"CPU kernels unavailable: {cg.unavailable_reason()}")


def _rows(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    return q, torch.rand(n, k // group, generator=g) / 8, torch.randn(n, k // group, generator=g) / 8


def _q4(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    return (*cg.pack_q4(*_rows(n, k, group, seed)), n)


def test_tiles_unpack_to_the_rows_they_were_packed_from() -> None:
    q, scale, offset = _rows(7, 64, 32, seed=3)  # 7 rows: the second tile is padded
    codes, so = cg.pack_q4(q, scale, offset)
    assert codes.shape == (2, 2, 2, 4, 8) and so.shape == (2, 2, 2, 4) and so.dtype == torch.float32
    back = cg.unpack_q4(codes, so, 7)
    assert torch.equal(back[0], q) and torch.equal(back[1], scale) and torch.equal(back[2], offset)
    dense = q.reshape(7, 2, 32).float() * scale.unsqueeze(-1) + offset.unsqueeze(-1)
    torch.testing.assert_close(cg.q4_dequant_ref(codes, so, 7), dense.reshape(7, 64))


@pytest.mark.parametrize(("n", "k", "group"), [(37, 64, 32), (64, 256, 128), (9, 192, 64)])
@pytest.mark.parametrize("m", [1, 3, 6, 9])  # chunks of the rows: 1, 3, 4 + 2, 8 + 1
def test_q4_matmul_equals_its_twin(n: int, k: int, group: int, m: int) -> None:
    w = _q4(n, k, group, seed=n + m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = cg.q4_matmul(x, *w)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, cg.q4_matmul_ref(x, *w), atol=1e-5, rtol=1e-5)
    # The many-row path (dequantise + one sgemm on the rounded activations) gives the same numbers.
    dense = F.linear(cg.round_activations(x), cg.q4_dequant(*w))
    torch.testing.assert_close(got, dense, atol=1e-5, rtol=1e-5)
    # Rounding activations to int8 per 32 costs well under a percent of the exact product.
    exact = x @ cg.q4_dequant_ref(*w).t()
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()


@pytest.mark.parametrize("half", [False, True])
def test_q8_matmul_rows_and_dequant_equal_their_twins(half: bool) -> None:
    g = torch.Generator().manual_seed(1)
    c8 = torch.randint(-128, 128, (21, 3, 32), dtype=torch.int8, generator=g)
    s8 = torch.rand(21, 3, generator=g)
    if half:
        s8 = s8.half().float()  # exact in fp16: packed as fp16
    codes, scale = cg.pack_q8(c8, s8)
    assert scale.dtype == (torch.float16 if half else torch.float32)
    x = torch.randn(5, 96, generator=g)
    got = cg.q8_matmul(x, codes, scale, 21)
    torch.testing.assert_close(got, cg.q8_matmul_ref(x, codes, scale, 21), atol=1e-4, rtol=1e-5)
    dense = F.linear(cg.round_activations(x), (c8.float() * s8.unsqueeze(-1)).flatten(1))
    torch.testing.assert_close(got, dense, atol=1e-4, rtol=1e-5)
    rows = torch.tensor([[4, 0], [20, 4]])
    assert torch.equal(cg.q8_rows(codes, scale, rows), (c8.float() * s8.unsqueeze(-1)).flatten(1)[rows])
    q4 = _q4(7, 96, 32, seed=2)
    torch.testing.assert_close(cg.q4_dequant(*q4), cg.q4_dequant_ref(*q4), atol=1e-6, rtol=1e-6)


def test_the_kernels_round_activations_as_their_twin_bit_for_bit() -> None:
    """An identity weight (code 1, scale 1, offset 0) returns each activation as the kernel rounded it: ties go
    to even, zeros and -0.0 give 0, and the rounding (vectorised in cpu_gemv.h) is `round_activations`'."""
    k = 64
    x = torch.randn(5, k) * 3
    x[0, :32] = torch.tensor([127.0, -0.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5] + [3.5] * 22)  # d = 1
    x[1, :32] = 0.0
    x[2, 32:] = -0.0
    eye = torch.eye(k, dtype=torch.uint8)
    w = (*cg.pack_q4(eye, torch.ones(k, 1).half(), torch.zeros(k, 1).half()), k)
    expect = cg.round_activations(x)
    assert torch.equal(cg.q4_matmul(x, *w), expect) and torch.equal(cg.q4_matmul(x[:1], *w), expect[:1])


def test_two_threads_give_the_same_bits() -> None:
    w = _q4(129, 128, 32, seed=5)
    x = torch.randn(2, 128)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cg.q4_matmul(x, *w)
        torch.set_num_threads(2)
        two = cg.q4_matmul(x, *w)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)  # rows are split over threads, never a row's sum


def test_a_failed_build_is_named_and_the_dense_path_stays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    cg._library.cache_clear()
    cg.load.cache_clear()
    try:
        assert not cg.available()
        assert "building cpu_gemv.c (avx2) failed" in cg.unavailable_reason()
        assert int4.default_cpu_kernel() is not int4.Int4Kernel.CPU_SIMD
        with pytest.raises(RuntimeError, match="unavailable"):
            cg.q4_matmul(torch.zeros(1, 32), *_q4(1, 32, 32, 0))
    finally:
        cg._library.cache_clear()
        cg.load.cache_clear()


def test_small_groups_and_reduced_dtypes_keep_the_dense_path() -> None:
    q = torch.randint(0, 16, (8, 64))
    layer = torch.nn.Module()
    int4.install(layer, q, torch.rand(8, 4), torch.rand(8, 4), int4.Int4Kernel.CPU_SIMD, torch.float32, torch.device("cpu"))
    assert layer.int4_kernel is int4.Int4Kernel.DENSE  # groups of 16 columns: not the kernel's blocks
    int4.install(layer, q, torch.rand(8, 2), torch.rand(8, 2), int4.Int4Kernel.CPU_SIMD, torch.bfloat16, torch.device("cpu"))
    assert layer.int4_kernel is int4.Int4Kernel.DENSE


def test_fp16_scales_where_exact() -> None:
    q, scale, offset = _rows(12, 64, 32, seed=9)
    codes, so16 = cg.pack_q4(q, scale.half().float(), offset.half().float())
    assert so16.dtype == torch.float16
    x = torch.randn(2, 64)
    torch.testing.assert_close(cg.q4_matmul(x, codes, so16, 12), cg.q4_matmul(x, codes, so16.float(), 12))
    torch.testing.assert_close(cg.q4_dequant(codes, so16, 12), cg.q4_dequant_ref(codes, so16, 12))
    assert cg.pack_q4(q, scale + 1e-4, offset)[1].dtype == torch.float32  # not representable: kept fp32
