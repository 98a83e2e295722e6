"""The CPU NVFP4 kernel (kernels/cpu_nvfp4.c) against its torch twin and against the format's reference
(dequantize_nvfp4, then a matmul of the same int8-rounded activations), on odd shapes, in every instruction-set
variant this CPU runs: the AVX2 build and the VNNI ones give the same bits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentbox.kernels import cpu_gemv as cg
from agentbox.kernels import cpu_nvfp4 as nv
from agentbox.kernels.nvfp4_codes import dequantize_nvfp4

pytestmark = pytest.mark.skipif(not nv.available(), reason=f"CPU kernels unavailable: {cg.unavailable_reason()}")
RUNNABLE = [i for i in cg.Isa if i.cpu_flags <= cg.cpu_flags()]


def _weight(n: int, k: int, seed: int, per_row: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every code (both signs, both zeros) and e4m3 scales across the format's range, subnormals included."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // 16, generator=g) * 448).to(torch.float8_e4m3fn)
    scale[0, 0] = torch.tensor(2.0**-9).to(torch.float8_e4m3fn)  # the smallest subnormal
    gs = torch.rand(n if per_row else 1, generator=g) * 1e-3 + 1e-4
    return codes, scale, gs if per_row else gs[0]


@pytest.mark.parametrize("isa", RUNNABLE, ids=[i.value for i in RUNNABLE])
@pytest.mark.parametrize(("n", "k"), [(13, 96), (1, 32), (37, 544)])
def test_matmul_equals_its_twin_and_the_dequantised_reference(isa: cg.Isa, n: int, k: int) -> None:
    codes, scale, gs = _weight(n, k, seed=n * k)
    dense = dequantize_nvfp4(codes, scale, gs)
    for m in (1, 3, 15):  # chunks of 2 + 1 and 8 + 4 + 2 + 1 activation rows
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
        with cg.use_isa(isa):
            got = nv.nvfp4_matmul(x, codes, scale, gs)
        twin = nv.nvfp4_matmul_ref(x, codes, scale, gs)
        ref = F.linear(nv.round_activations(x), dense)  # what a many-row caller computes
        size = ref.abs().max()
        torch.testing.assert_close(got, twin, atol=2e-6 * size, rtol=1e-5)
        torch.testing.assert_close(got, ref, atol=2e-6 * size, rtol=1e-5)
        # and the rounding is only the activations': within int8's step of the unrounded product
        exact = F.linear(x, dense)
        assert (got - exact).abs().max() < 0.03 * exact.abs().max()


@pytest.mark.parametrize("isa", RUNNABLE, ids=[i.value for i in RUNNABLE])
def test_every_variant_gives_the_avx2_bits_and_a_row_its_own_numbers_in_any_batch(isa: cg.Isa) -> None:
    codes, scale, gs = _weight(9, 160, seed=3, per_row=False)  # one global scale for the tensor
    x = torch.randn(11, 160, generator=torch.Generator().manual_seed(1))
    with cg.use_isa(cg.Isa.AVX2):
        want = nv.nvfp4_matmul(x, codes, scale, gs)
    with cg.use_isa(isa):
        assert torch.equal(nv.nvfp4_matmul(x, codes, scale, gs), want)
        assert torch.equal(nv.nvfp4_matmul(x[4:5], codes, scale, gs), want[4:5])  # a row alone: the same bits
    with cg.use_isa(isa), pytest.raises(ValueError, match="multiple of 32"):
        nv.nvfp4_matmul(torch.randn(2, 48), *_weight(3, 48, seed=0)[:2], gs)  # NVFP4's 16, not the kernel's 32


def test_zero_activations_and_zero_rows() -> None:
    codes, scale, gs = _weight(5, 64, seed=7)
    assert torch.equal(nv.nvfp4_matmul(torch.zeros(2, 64), codes, scale, gs), torch.zeros(2, 5))
    assert nv.nvfp4_matmul(torch.zeros(0, 64), codes, scale, gs).shape == (0, 5)


@pytest.mark.parametrize("isa", RUNNABLE, ids=[i.value for i in RUNNABLE])
def test_every_e4m3_scale_decodes_as_torchs(isa: cg.Isa) -> None:
    """Row r's every block scale is the byte r (both NaNs and the subnormals among them), its codes all 1.0: K 544
    runs two 8-block chunks of the vector decoding and one block of the table's."""
    n, k = 256, 544
    codes = torch.full((n, k // 2), 0x22, dtype=torch.uint8)  # code 2 (1.0) in both nibbles
    scale = torch.arange(256, dtype=torch.uint8)[:, None].expand(n, k // 16).contiguous().view(torch.float8_e4m3fn)
    gs = torch.ones(n)
    x = torch.ones(1, k)
    with cg.use_isa(isa):
        got = nv.nvfp4_matmul(x, codes, scale, gs)
    want = F.linear(nv.round_activations(x), dequantize_nvfp4(codes, scale, gs))
    assert int(want.isnan().sum()) == 2  # 0x7F and 0xFF
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0, equal_nan=True)
