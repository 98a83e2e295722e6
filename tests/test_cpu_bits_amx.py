"""cpu_bits_amx.c, cpu_q4_amx.c and cpu_kbits_amx.c: the 8-bit (GGUF Q8_0), 4-bit (Q4_0 / Q4_1 / Q4_K) and 2- to
6-bit (Q6_K, Q5_K, Q5_0, Q3_K, Q2_K) many-row products on AMX int8 tiles. Their integer sums are the VNNI kernels',
their fp32 sums one accumulator a scale group where the VNNI kernels keep two halves, so the two agree to fp32 rounding and both match the dequantised twin; calls that should take the
tiles do, and the fused decode's calls (tiles 0) and a speculative verify's few rows never do. Skips where the
kernels' variant is not avx512-amx or the OS refuses the tile state; the variant's sources compile on every machine
(test_cpu_isa)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator

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


@pytest.fixture
def vnni() -> Iterator[Callable[[Callable[[], torch.Tensor]], torch.Tensor]]:
    """Runs a product with the tiles' row floor past any call: the VNNI kernel's result."""
    min_rows = ctypes.c_int.in_dll(_amx(), "ab_amx_min_rows")
    saved = min_rows.value

    def run(f: Callable[[], torch.Tensor]) -> torch.Tensor:
        min_rows.value = 1 << 30
        try:
            return f()
        finally:
            min_rows.value = saved

    yield run
    min_rows.value = saved


def _agree(tiles: torch.Tensor, vnni: torch.Tensor, ref: torch.Tensor) -> None:
    """The tiles' numbers are the VNNI kernel's to fp32 rounding (~1e-7 of a row's scale: a kernel that lost a
    block or a row's scale is off by orders more) and the dequantised twin's as closely as the VNNI kernel's."""
    scale = ref.abs().max().item()
    torch.testing.assert_close(tiles, vnni, rtol=0.0, atol=2e-6 * scale)
    torch.testing.assert_close(tiles, ref, rtol=1e-5, atol=1e-4)
    assert not torch.equal(tiles, torch.zeros_like(tiles))


@pytest.mark.parametrize("form", [None, cb.ScaleForm.F16, cb.ScaleForm.F32], ids=lambda f: f.name if f else "I8")
def test_amx_8bit_tiles_agree_with_the_vnni_kernel(form: cb.ScaleForm | None, vnni) -> None:
    calls = ctypes.c_int64.in_dll(cg._lib(), "ab_amx_calls")
    min_rows = ctypes.c_int.in_dll(cg._lib(), "ab_amx_min_rows").value
    g = torch.Generator().manual_seed(7)
    # (rows, N, K): two tiles of rows, one weight tile; a short last row tile, K 288 (a short record); the fewest
    # rows that take the tiles with N 22 (16 rows on tiles, 6 on the VNNI kernel); K 576 (two records and a short one)
    for m, n, k in [(32, 16, 32), (37, 48, 288), (min_rows, 22, 320), (70, 64, 576)]:
        codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
        scale = (torch.rand(n, k // 32, generator=g) / 64 + 1e-3).half().float()
        w = cb.pack_bits_cpu(codes, 8, scale, None, form)
        x = torch.randn(m, k, generator=g) * 3
        x[m // 2] = 0.0  # an all-zero row: its blocks' d is 0
        before = calls.value
        tiles = cb.bits_matmul(x, w)
        assert calls.value == before + 1, (m, n, k)
        plain = vnni(lambda x=x, w=w: cb.bits_matmul(x, w))
        assert calls.value == before + 1
        _agree(tiles, plain, cb.bits_matmul_ref(x, w))
        assert torch.equal(tiles[m // 2], torch.zeros(n))


@pytest.mark.parametrize("half", [True, False], ids=["fp16-scales", "fp32-scales"])
def test_amx_4bit_tiles_agree_with_the_vnni_kernel(half: bool, vnni) -> None:
    calls = ctypes.c_int64.in_dll(cg._lib(), "ab_amx_calls")
    min_rows = ctypes.c_int.in_dll(cg._lib(), "ab_amx_min_rows").value
    g = torch.Generator().manual_seed(9)
    # (rows, N, K, group): SmolLM2's qkv at a warm turn's rows; N 40 (32 rows on tiles, 8 on the VNNI kernel) at the
    # floor; a group of 64 (a Q4_K-like scale per two blocks) and one of the whole row; K 1536 (the down projection)
    for m, n, k, group in [(65, 960, 576, 32), (min_rows, 40, 128, 32), (33, 48, 256, 64), (20, 16, 128, 128),
                           (40, 32, 1536, 32)]:
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scale, offset = torch.rand(n, k // group, generator=g) / 32 + 1e-3, -torch.rand(n, k // group, generator=g) / 8
        if half:
            scale, offset = scale.half().float(), offset.half().float()
        codes, so = cg.pack_q4(q, scale, offset)
        assert (so.dtype == torch.float16) == half
        x = torch.randn(m, k, generator=g) * 3
        before = calls.value
        tiles = cg.q4_matmul(x, codes, so, n)
        assert calls.value == before + 1, (m, n, k, group)
        _agree(tiles, vnni(lambda x=x, c=codes, s=so, n=n: cg.q4_matmul(x, c, s, n)), cg.q4_matmul_ref(x, codes, so, n))


def test_the_fused_decodes_calls_and_a_verifys_rows_keep_the_vnni_bits(vnni) -> None:
    """tiles = 0 (cpu_moe.c's ab_linear, the fused decode's linears): never the tiles, whatever the rows, so a
    sequence's step does not depend on its batch; and below the floor (a speculative verify) the bits are decode's."""
    lib = cg._lib()
    calls = ctypes.c_int64.in_dll(lib, "ab_amx_calls")
    min_rows = ctypes.c_int.in_dll(lib, "ab_amx_min_rows").value
    assert min_rows > 17  # a verify of spec_max_draft + 1 = 17 rows stays off the tiles
    g = torch.Generator().manual_seed(4)
    codes, so = cg.pack_q4(torch.randint(0, 16, (64, 256), generator=g), torch.rand(64, 8, generator=g) / 32,
                           torch.zeros(64, 8))
    x = torch.randn(64, 256, generator=g)
    out = torch.empty(64, 64)
    before = calls.value
    assert lib.ab_q4_matmul(x.data_ptr(), 64, 256, codes.data_ptr(), so.data_ptr(), 64, 32, out.data_ptr(), 2,
                            int(so.dtype == torch.float16), 0) == 0
    assert calls.value == before
    assert torch.equal(out, vnni(lambda: cg.q4_matmul(x, codes, so, 64)))
    few = x[: min_rows - 1]
    assert torch.equal(cg.q4_matmul(few, codes, so, 64), vnni(lambda: cg.q4_matmul(few, codes, so, 64)))
    assert calls.value == before


def test_few_rows_and_other_formats_keep_the_vnni_kernel() -> None:
    lib = _amx()
    calls = ctypes.c_int64.in_dll(lib, "ab_amx_calls")
    min_rows = ctypes.c_int.in_dll(lib, "ab_amx_min_rows").value
    g = torch.Generator().manual_seed(8)
    q8 = cb.pack_bits_cpu(torch.randint(0, 256, (32, 64), generator=g, dtype=torch.uint8),
                          8, torch.full((32, 2), 0.01), None)
    q8_16 = cb.pack_bits_cpu(torch.randint(0, 256, (32, 64), generator=g, dtype=torch.uint8),
                             8, torch.full((32, 4), 0.01), None)
    q6 = cb.pack_bits_cpu(torch.randint(0, 64, (32, 64), generator=g, dtype=torch.uint8),
                          6, torch.full((32, 4), 0.01), None)
    before = calls.value
    cb.bits_matmul(torch.randn(min_rows - 1, 64, generator=g), q8)  # a decode step's few rows
    cb.bits_matmul(torch.randn(min_rows - 1, 64, generator=g), q6)
    cb.bits_matmul(torch.randn(64, 64, generator=g), q8_16)  # 8 bits in groups of 16: no tile kernel
    assert calls.value == before


@pytest.mark.parametrize(("bits", "group", "offsets"), [(6, 16, False), (5, 32, True), (5, 32, False), (3, 16, False),
                                                        (2, 16, True), (6, 32, False), (5, 16, True)],
                         ids=["Q6_K", "Q5_K", "Q5_0", "Q3_K", "Q2_K", "6-bit-g32", "5-bit-g16-offsets"])
def test_amx_kbit_tiles_agree_with_the_vnni_kernel(bits: int, group: int, offsets: bool, vnni) -> None:
    """cpu_kbits_amx.c: codes unpacked to bytes (centred without offsets), a tile product per scale group (two K 16
    products a block for groups of 16)."""
    calls = ctypes.c_int64.in_dll(cg._lib(), "ab_amx_calls")
    min_rows = ctypes.c_int.in_dll(cg._lib(), "ab_amx_min_rows").value
    g = torch.Generator().manual_seed(bits * 100 + group)
    # (rows, N, K): a record of 8 blocks; a short last row tile and a short record (K 288); the floor with N 22 (16
    # rows on tiles, 6 on the VNNI kernel); two records and a short one
    for m, n, k in [(32, 16, 256), (37, 48, 288), (min_rows, 22, 320), (70, 64, 576)]:
        codes = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.uint8)
        scale = torch.randint(-60, 60, (n, k // group), generator=g).float() / 1024
        offset = torch.randint(-60, 60, (n, k // group), generator=g).float() / 512 if offsets else None
        w = cb.pack_bits_cpu(codes, bits, scale, offset)
        x = torch.randn(m, k, generator=g) * 3
        x[m // 2] = 0.0  # an all-zero row: its blocks' d is 0
        before = calls.value
        tiles = cb.bits_matmul(x, w)
        assert calls.value == before + 1, (m, n, k)
        _agree(tiles, vnni(lambda x=x, w=w: cb.bits_matmul(x, w)), cb.bits_matmul_ref(x, w))
        assert torch.equal(tiles[m // 2], torch.zeros(n))


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
