"""kernels/cpu_dense.py: the many-row fp32 product through oneDNN gives F.linear's numbers to summation order; and
the torch MLP's SiLU-and-mul in C (cpu_dense.silu_mul_rows) gives torch's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentbox.kernels import cpu_dense, cpu_gemv


@pytest.mark.parametrize("shape", [(1, 64), (37, 144), (2, 5, 96)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(shape: tuple[int, ...], with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(len(shape) + shape[-1])
    x = torch.randn(*shape, generator=gen)
    w = torch.randn(129, shape[-1], generator=gen)
    bias = torch.randn(129, generator=gen) if with_bias else None
    got = cpu_dense.linear(x, w, bias)
    assert got.shape == (*shape[:-1], 129)
    torch.testing.assert_close(got, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def test_linear_takes_strided_input() -> None:
    x = torch.randn(64, 40)[:, :32]  # rows 40 apart
    w = torch.randn(24, 32)
    torch.testing.assert_close(cpu_dense.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_other_dtypes_run_f_linear() -> None:
    x, w = torch.randn(8, 32).to(torch.bfloat16), torch.randn(16, 32).to(torch.bfloat16)
    assert torch.equal(cpu_dense.linear(x, w), F.linear(x, w))
    assert cpu_dense.linear(torch.empty(0, 32), torch.randn(16, 32)).shape == (0, 16)


@pytest.mark.skipif(not cpu_gemv.available(), reason="CPU kernels unavailable")
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (37, 2 * 20), (2, 3, 2 * 64)])
def test_silu_mul_rows_matches_torch(shape: tuple[int, ...]) -> None:
    gate_up = 4 * torch.randn(*shape, generator=torch.Generator().manual_seed(shape[-1]))
    gate, up = gate_up.chunk(2, dim=-1)
    got = cpu_dense.silu_mul_rows(gate_up)
    assert got is not None and got.shape == up.shape
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    assert cpu_dense.silu_mul_rows(gate_up.double()) is None  # not fp32: the caller runs torch
