"""cpu_f16_amx.c: many activation rows times fp16 / bf16 weights kept as stored, on AMX bf16 tiles with split
operands. Its products keep ~16 significant bits, so against an fp64 product each output is within a few 1e-6 of
the sum of its terms' magnitudes (the twin, fp32 oneDNN: ~2e-7; llama.cpp's fp16 rounding of the activations
alone: ~5e-4). Calls of AMX_MIN_ROWS rows or more take the tiles, fewer keep the kernel's or the twin's numbers.
Skips where the CPU lacks AMX bf16 or the OS refuses the tile state."""

from __future__ import annotations

import ctypes

import pytest
import torch

from agentbox.kernels import cpu_f16, cpu_gemv


def _calls() -> int:
    lib, why = cpu_f16._amx_library()
    if lib is None:
        pytest.skip(why)
    if not cpu_gemv.available():
        pytest.skip("CPU kernels unavailable")
    return ctypes.c_int64.in_dll(lib, "ab_half_amx_calls").value


def _relative_error(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    exact = x.double() @ w.double().T
    return ((got.double() - exact).abs() / (x.double().abs() @ w.double().abs().T)).max().item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "k", "n"), [
    (cpu_f16.AMX_MIN_ROWS, 144, 37),  # k = 4 x 32 + 16: a half block of columns; 37 weight rows: a part block
    (47, 512, 64),                    # the last block of activation rows: one tile and a part of another
    (300, 96, 100),                   # rows past a chunk (256)
    (40, 16, 17),                     # one half block of columns only
])
def test_the_tiles_match_an_fp64_product(m: int, k: int, n: int, dtype: torch.dtype) -> None:
    before = _calls()
    gen = torch.Generator().manual_seed(m * k + n)
    x = 3 * torch.randn(m, k, generator=gen)
    w = (0.1 * torch.randn(n, k, generator=gen)).to(dtype)
    got = cpu_f16.f16_matmul(x, w)
    assert _calls() == before + 1
    assert got.shape == (m, n)
    assert _relative_error(got, x, w) < 8e-6
    # finer than rounding the activations to the weight's type first, as llama.cpp does
    assert _relative_error(got, x, w) < _relative_error(cpu_f16.f16_matmul_ref(x.to(dtype).float(), w), x, w) / 8
    torch.testing.assert_close(got, cpu_f16.f16_matmul_ref(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rows", [1, cpu_f16.MAX_ROWS, cpu_f16.AMX_MIN_ROWS - 1])
def test_fewer_rows_keep_their_numbers(rows: int) -> None:
    """A decode step's and a speculative verify's rows never take the tiles: their outputs stay those of plain
    decoding."""
    before = _calls()
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 64, generator=gen), torch.randn(48, 64, generator=gen).half()
    torch.testing.assert_close(cpu_f16.f16_matmul(x, w), cpu_f16.f16_matmul_ref(x, w), rtol=1e-5, atol=1e-5)
    assert _calls() == before


def test_batched_rows_take_the_tiles_by_their_total() -> None:
    """A [batch, tokens, k] input counts its rows together, and comes back in its own shape."""
    before = _calls()
    x, w = torch.randn(2, 10, 32), torch.randn(24, 32).bfloat16()
    got = cpu_f16.f16_matmul(x, w)
    assert got.shape == (2, 10, 24) and _calls() == before + 1
    assert _relative_error(got.reshape(20, 24), x.reshape(20, 32), w) < 8e-6
