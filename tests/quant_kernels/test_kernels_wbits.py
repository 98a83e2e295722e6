"""kernels/wbits.py (and so `load_bits_tile`) against its torch twin, for every width with and without offset."""

from __future__ import annotations

import pytest
import torch
from agentbox.kernels.dequant import dequant_bits, pack_bits
from agentbox.kernels.wbits import wbits_matmul, wbits_matmul_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("m", "n", "k", "group", "bits", "has_offset", "dtype"), [
    (1, 64, 64, 32, 5, False, torch.float32),  # Q5_0
    (3, 40, 64, 32, 5, True, torch.float16),  # Q5_1 / Q5_K, N not a tile multiple
    (5, 72, 96, 16, 6, False, torch.float32),  # Q6_K
    (2, 64, 64, 32, 8, False, torch.float16),  # Q8_0
    (17, 24, 32, 16, 8, True, torch.float32),  # a promoted mixed layer; M over one tile
])
def test_wbits_matches_its_twin(
    m: int, n: int, k: int, group: int, bits: int, has_offset: bool, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(bits * 10 + m)
    q = torch.randint(0, 2**bits, (k, n), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(k // group, n, generator=gen) * 0.01).to(dtype)
    offset = (torch.randn(k // group, n, generator=gen) * 0.05).to(dtype) if has_offset else None
    x = torch.randn(m, k, generator=gen).to(dtype)
    qweight, qhigh = pack_bits(q, bits)
    ref = wbits_matmul_ref(x, qweight, qhigh, scale, offset, group, bits)
    s = scale.float().repeat_interleave(group, 0)
    w = q.float() * s + offset.float().repeat_interleave(group, 0) if has_offset else (q.float() - 2 ** (bits - 1)) * s
    torch.testing.assert_close(dequant_bits(qweight, qhigh, scale, offset, group, bits), w)
    dev = [t.to(DEVICE) if t is not None else None for t in (x, qweight, qhigh, scale, offset)]
    got = wbits_matmul(*dev, group, bits)
    tol = 1e-4 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(got.cpu().float(), ref.float(), atol=tol, rtol=tol)


def test_wbits_names_a_bad_shape() -> None:
    qweight, qhigh = pack_bits(torch.zeros(64, 8, dtype=torch.uint8), 6)
    scale = torch.ones(4, 8)
    with pytest.raises(ValueError, match="qhigh"):
        wbits_matmul(torch.zeros(1, 64, device=DEVICE), qweight.to(DEVICE), qhigh[:1].to(DEVICE), scale.to(DEVICE), None, 16, 6)
