"""The CPU kernels' multi-row products and instruction-set variants (kernels/cpu_gemv.c, cpu_bits.c).

A batch (decode of several sequences, a speculative verify, a chunk's tail, a prefill) runs up to 8 activation
rows per pass over a weight tile; a row's numbers must not depend on the batch it came in. The library is built per
ISA variant and the variant is picked from the CPU's flags; every variant the CPU runs gives the AVX2 bits,
and the ones it cannot run at least compile (with their VNNI dot products in them)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from agentbox.kernels import cpu_bits as cb
from agentbox.kernels import cpu_gemv as cg

pytestmark = pytest.mark.skipif(not cg.available(), reason=f"CPU kernels unavailable: {cg.unavailable_reason()}")

AVX2_EPYC = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "vaes"}  # this machine's kind: Zen 3
Matmul = Callable[[torch.Tensor], torch.Tensor]


def _gguf_types(k: int = 320, n: int = 22) -> dict[str, Matmul]:
    """One weight per GGUF type in the form the CPU path keeps it (K 320: a full record and a short one)."""
    g = torch.Generator().manual_seed(0)

    def half(*shape: int) -> torch.Tensor:
        return (torch.rand(*shape, generator=g) / 16).half().float()

    out: dict[str, Matmul] = {}
    q4 = torch.randint(0, 16, (n, k), generator=g)
    s = half(n, k // 32)
    w40 = cg.pack_q4(q4, s, -8 * s)  # Q4_0: fp16 d, offset -8 d
    w41 = cg.pack_q4(q4, s, -half(n, k // 32))  # Q4_1
    w4k = cg.pack_q4(q4, s * 0.37, -half(n, k // 32) * 0.11)  # Q4_K: products of two scales, fp32
    assert w4k[1].dtype == torch.float32
    out["Q4_0"] = lambda x: cg.q4_matmul(x, *w40, n)
    out["Q4_1"] = lambda x: cg.q4_matmul(x, *w41, n)
    out["Q4_K"] = lambda x: cg.q4_matmul(x, *w4k, n)
    w64 = cg.pack_q4(q4, half(n, k // 64), half(n, k // 64))  # a group of 64 (AWQ / GPTQ-like)
    out["Q4 group 64"] = lambda x: cg.q4_matmul(x, *w64, n)
    q8 = cg.pack_q8(torch.randint(-128, 128, (n, k // 32, 32), dtype=torch.int8, generator=g), half(n, k // 32))
    out["Q8_0"] = lambda x: cg.q8_matmul(x, *q8, n)
    from agentbox.bench.cpu_bits import TYPES, _weight

    for t in TYPES:
        w = _weight(n, k, t, seed=1)
        out[f"{t.name} (bits)"] = lambda x, w=w: cb.bits_matmul(x, w)
    return out


def test_the_variant_is_picked_from_the_cpu_flags() -> None:
    assert cg.pick_isa(AVX2_EPYC) is cg.Isa.AVX2
    assert cg.pick_isa(AVX2_EPYC | {"avx_vnni"}) is cg.Isa.AVX_VNNI  # Alder Lake, Zen 5 laptops
    zen4 = AVX2_EPYC | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}
    assert cg.pick_isa(zen4) is cg.Isa.AVX512_VNNI
    sapphire = zen4 | {"avx_vnni", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16"}
    assert cg.pick_isa(sapphire) is cg.Isa.AVX512_AMX  # its 8- and 4-bit many-row products on AMX tiles
    assert cg.pick_isa(AVX2_EPYC | {"avx512f", "avx512bw", "avx512vl"}) is cg.Isa.AVX2  # Skylake-X: no VNNI
    assert cg.pick_isa(AVX2_EPYC | {"avx512_vnni"}) is cg.Isa.AVX2  # VNNI without AVX512VL's 256-bit form
    assert cg.pick_isa(AVX2_EPYC - {"f16c"}) is None
    assert cg.pick_isa(set()) is None
    # this machine: the picked variant is the one the library reports, and the line doctor prints names it
    assert cg.isa() is cg.pick_isa(cg.cpu_flags())
    assert cg.isa().value in cg.describe()


@pytest.mark.parametrize("kind", list(_gguf_types()))
def test_a_row_gets_the_same_bits_in_any_batch(kind: str) -> None:
    mm = _gguf_types()[kind]
    x = torch.randn(16, 320, generator=torch.Generator().manual_seed(3)) * 2
    x[5] = 0.0  # an all-zero row: d = 0
    whole = mm(x)
    for m in (1, 2, 3, 5, 7, 8, 13):  # chunks of 8, 4, 3, 2 and 1 rows (Q4), 4, 2 and 1 (the others)
        assert torch.equal(mm(x[:m]), whole[:m]), m
    for i in (0, 5, 9, 15):
        assert torch.equal(mm(x[i:i + 1]), whole[i:i + 1])
    assert torch.equal(mm(x[3:11]), whole[3:11])
    # a prefill-sized step (Q4 keeps its activations in slices of 64 rows): the same bits as one row alone, except
    # where the avx512-amx build's tiles take it (one fp32 accumulator a block, cpu_bits_amx.c says why): there
    # within fp32 rounding of them
    many = torch.cat([x] * 5)  # 80 rows
    calls = ctypes.c_int64.in_dll(cg._lib(), "ab_amx_calls") if cg.isa() is cg.Isa.AVX512_AMX else None
    before = calls.value if calls is not None else 0
    got, want = mm(many), torch.cat([whole] * 5)
    if calls is not None and calls.value > before:
        torch.testing.assert_close(got, want, rtol=0.0, atol=2e-6 * want.abs().max().item())
    else:
        assert torch.equal(got, want)


def _runnable() -> list[cg.Isa]:
    return [isa for isa in cg.Isa if isa.cpu_flags <= cg.cpu_flags()]


@pytest.mark.parametrize("isa", list(cg.Isa), ids=lambda i: i.value)
def test_every_variant_this_cpu_runs_gives_the_avx2_bits(isa: cg.Isa) -> None:
    if isa not in _runnable():
        pytest.skip(f"this CPU lacks {', '.join(sorted(isa.cpu_flags - cg.cpu_flags()))}: compiled, not run")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 320, generator=g)
    kinds = _gguf_types()
    # five tiles of 4 rows, the last one short: avx512-vnni's Q4 passes take two tiles at a time, then a lone one
    q, s = torch.randint(0, 16, (18, 320), generator=g), (torch.rand(18, 10, generator=g) / 16).half().float()
    w = cg.pack_q4(q, s, -s * 3)
    kinds["Q4_1, 5 tiles"] = lambda x: cg.q4_matmul(x, *w, 18)
    rows = (9, 7, 6, 1)  # Q4 passes of 8 + 1, 4 + 3 and 4 + 2 rows; one row (a decode: q8_row on avx512-vnni)
    with cg.use_isa(cg.Isa.AVX2):
        reference = {kind: [mm(x[:m]) for m in rows] for kind, mm in kinds.items()}
    with cg.use_isa(isa):
        assert cg.isa() is isa
        for kind, mm in kinds.items():
            for m, expect in zip(rows, reference[kind], strict=True):
                assert torch.equal(mm(x[:m]), expect), (kind, m)


def test_variants_this_cpu_cannot_run_still_compile(tmp_path: Path) -> None:
    """Every variant's sources compile with its flags (at -O0: seconds, where the -O3 library takes a minute), so
    an error in a VNNI / AVX-512 path cannot hide on an AVX2 machine; its dot products are VNNI's, none AVX2's."""
    missing = [isa for isa in cg.Isa if isa not in _runnable()]
    if not missing:
        pytest.skip("this CPU runs every variant (their bits are compared above)")
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc is not None  # the kernels are available, so a compiler is here
    for isa in missing:
        with pytest.raises(ValueError, match="this CPU lacks"):
            with cg.use_isa(isa):
                pass
        out = tmp_path / isa.value
        out.mkdir()
        flags = [f for f in cg.FLAGS if f not in ("-O3", "-shared")]
        built = subprocess.run([cc, "-O0", "-S", *flags, *isa.cc_flags, *map(str, cg.SOURCES)], cwd=out,
                               capture_output=True, text=True)
        assert built.returncode == 0, built.stderr[-2000:]
        asm = "".join(p.read_text() for p in out.glob("*.s"))
        assert f'"{isa.value}"' in asm  # the name the library reports (AB_ISA)
        assert "vpdpbusd" in asm and "vpmaddubsw" not in asm


def test_a_better_variant_that_does_not_build_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU with AVX-VNNI (no AVX-512) and a compiler without -mavxvnni keeps the AVX2 build, and the line doctor
    and the serve log print says why; on this CPU the line names it and its flags."""
    real_flags, real_load = cg.cpu_flags(), cg.load
    here = cg.describe()
    assert here.startswith(f"{cg.isa().value} ({cg.cpu_model()}; avx2 fma f16c")
    for isa, why in cg.passed_over():
        assert f"not {isa.value}: the CPU lacks" in here and why.startswith("the CPU lacks")
    failed = "building cpu_gemv.c (avx-vnni) failed: cc: error: unrecognized command-line option '-mavxvnni'"
    # this CPU's flags as an AVX2 + AVX-VNNI one's (an AVX-512 CPU would otherwise pick avx512-vnni)
    laptop = (real_flags - (cg.Isa.AVX512_VNNI.cpu_flags - cg.Isa.AVX2.cpu_flags)) | cg.Isa.AVX_VNNI.cpu_flags
    assert cg.pick_isa(laptop) is cg.Isa.AVX_VNNI
    monkeypatch.setattr(cg, "cpu_flags", lambda: laptop)
    monkeypatch.setattr(cg, "load", lambda isa: (None, failed) if isa is cg.Isa.AVX_VNNI else real_load(isa))
    cg._library.cache_clear()
    try:
        assert cg.available() and cg.isa() is cg.Isa.AVX2
        line = cg.describe()
        assert f"not avx-vnni: {failed} (a newer C compiler builds it)" in line
        assert "not avx512-vnni: the CPU lacks avx512_vnni avx512bw avx512f avx512vl" in line
        x = torch.randn(3, 320, generator=torch.Generator().manual_seed(6))
        for kind, mm in _gguf_types().items():  # the fallback computes
            assert torch.isfinite(mm(x)).all(), kind
    finally:
        cg._library.cache_clear()
