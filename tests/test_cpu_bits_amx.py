"""cpu_bits_amx.c: the 8-bit (GGUF Q8_0) many-row product on AMX int8 tiles gives the VNNI kernel's bits, and the
calls that should take the tiles do. Skips where the kernels' variant is not avx512-amx or the OS refuses the
tile state; the variant's sources compile on every machine (test_cpu_isa)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from agentbox.kernels import cpu_bits as cb
from agentbox.kernels import cpu_gemv as cg


def _amx() -> ctypes.CDLL:
    if cg.isa() is not cg.Isa.AVX512_AMX:
        pytest.skip(f"the kernels here are {cg.isa().value if cg.isa() else 'unavailable'}, not avx512-amx")
    lib = cg._lib()
    if not lib.ab_bits_amx_ready():
        pytest.skip("the OS did not grant the AMX tile state (Linux 5.16+ arch_prctl)")
    return lib


@pytest.mark.parametrize("form", [None, cb.ScaleForm.F16, cb.ScaleForm.F32], ids=lambda f: f.name if f else "I8")
def test_amx_tiles_give_the_vnni_kernels_bits(form: cb.ScaleForm | None) -> None:
    lib = _amx()
    min_rows = ctypes.c_int.in_dll(lib, "ab_amx_min_rows")
    calls = ctypes.c_int64.in_dll(lib, "ab_amx_calls")
    g = torch.Generator().manual_seed(7)
    # (rows, N, K): one tile; three with a short last one and K 288 (a short record); the fewest rows that take
    # the tiles with N 22 (16 rows on tiles, 6 on the VNNI kernel); K 576 (two records and a short one)
    for m, n, k in [(16, 16, 32), (37, 48, 288), (min_rows.value, 22, 320), (70, 64, 576)]:
        codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
        scale = (torch.rand(n, k // 32, generator=g) / 64 + 1e-3).half().float()
        w = cb.pack_bits_cpu(codes, 8, scale, None, form)
        x = torch.randn(m, k, generator=g) * 3
        x[m // 2] = 0.0  # an all-zero row: its blocks' d is 0
        before = calls.value
        tiles = cb.bits_matmul(x, w)
        assert calls.value == before + 1, (m, n, k)
        saved, min_rows.value = min_rows.value, 1 << 30
        try:
            vnni = cb.bits_matmul(x, w)
        finally:
            min_rows.value = saved
        assert calls.value == before + 1
        assert torch.equal(tiles, vnni), (m, n, k)
        torch.testing.assert_close(tiles, cb.bits_matmul_ref(x, w), rtol=1e-5, atol=1e-4)


def test_few_rows_and_other_formats_keep_the_vnni_kernel() -> None:
    lib = _amx()
    calls = ctypes.c_int64.in_dll(lib, "ab_amx_calls")
    min_rows = ctypes.c_int.in_dll(lib, "ab_amx_min_rows").value
    g = torch.Generator().manual_seed(8)
    q8 = cb.pack_bits_cpu(torch.randint(0, 256, (32, 64), generator=g, dtype=torch.uint8),
                          8, torch.full((32, 2), 0.01), None)
    q6 = cb.pack_bits_cpu(torch.randint(0, 64, (32, 64), generator=g, dtype=torch.uint8),
                          6, torch.full((32, 4), 0.01), None)
    before = calls.value
    cb.bits_matmul(torch.randn(min_rows - 1, 64, generator=g), q8)  # a decode step's few rows
    cb.bits_matmul(torch.randn(64, 64, generator=g), q6)  # Q6_K: not on the tiles
    assert calls.value == before


def test_doctor_says_when_the_os_refuses_the_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    lib = _amx()
    assert "refused" not in cg.describe()

    class Refused:  # the library as it answers on a kernel that refuses arch_prctl(ARCH_REQ_XCOMP_PERM)
        def __getattr__(self, name: str) -> object:
            return getattr(lib, name)

        @staticmethod
        def ab_bits_amx_ready() -> int:
            return 0

    monkeypatch.setattr(cg, "_lib", lambda: Refused())
    assert "avx512-amx" in cg.describe() and "AMX tiles refused by the OS" in cg.describe()
