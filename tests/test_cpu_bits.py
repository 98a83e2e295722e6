"""The AVX2 k-bit kernels (kernels/cpu_bits.c) against their torch twins, and GGUF's Q5_0 / Q5_1 / Q8_0 /
Q5_K / Q6_K / Q2_K / Q3_K blocks through `bits_groups` and the CPU form: exact, and resident near the file's
bytes (Q2_K / Q3_K: at the kernel form's stated bits)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from agentbox.kernels import cpu_bits as cb
from agentbox.kernels import cpu_gemv as cg
from agentbox.layers.quant.gguf import GGUFBlocks, bits_groups

pytestmark = pytest.mark.skipif(not cg.available(), reason=f"CPU kernels unavailable: {cg.unavailable_reason()}")
FORMS = list(cb.ScaleForm)


def _scales(n: int, k: int, group: int, form: cb.ScaleForm, g: torch.Generator) -> torch.Tensor:
    """Scales exact in `form`: I8 as a record's fp16 super-scale times int8 multiples (as the K-quants), U4 times
    4-bit ones (as Q2_K), of one sign per record (negative in odd records: Q2_K's offsets are -dmin * m)."""
    if form in (cb.ScaleForm.I8, cb.ScaleForm.U4):  # per record of 8 blocks (and the row's shorter last one)
        parts = []
        for _, recs, p in cb._chunks(k):
            d = torch.rand(n, recs, 1, generator=g).half().float() / 64
            if form is cb.ScaleForm.U4:
                d = d * (1 - 2 * (torch.arange(recs) % 2)).view(1, recs, 1)
            lo, hi = (-128, 128) if form is cb.ScaleForm.I8 else (0, 16)
            parts.append((d * torch.randint(lo, hi, (n, recs, p * 32 // group), generator=g)).reshape(n, -1))
        return torch.cat(parts, dim=1)
    s = torch.randn(n, k // group, generator=g) / 8
    return s.half().float() if form is cb.ScaleForm.F16 else s


def _weight(n: int, k: int, bits: int, group: int, offset: bool, form: cb.ScaleForm, seed: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g)
    return codes, _scales(n, k, group, form, g), _scales(n, k, group, form, g) if offset else None


@pytest.mark.parametrize("form", FORMS, ids=[f.name for f in FORMS])
@pytest.mark.parametrize("offset", [False, True], ids=["symmetric", "offset"])
@pytest.mark.parametrize("group", [16, 32])
@pytest.mark.parametrize("bits", [5, 6, 8])
def test_matmul_and_dequant_equal_their_twins(bits: int, group: int, offset: bool, form: cb.ScaleForm) -> None:
    # odd N: rows past the 4-row tiles; K 576: two records of 8 blocks and one of 2, K 224: one of 7, K 480: one
    # of 8 and one of 7 (U4: an odd count of 4-bit scales in groups of 32)
    n, k = 13, {cb.ScaleForm.F32: 224, cb.ScaleForm.U4: 480}.get(form, 576)
    codes, scale, off = _weight(n, k, bits, group, offset, form, seed=bits * group + offset)
    w = cb.pack_bits_cpu(codes, bits, scale, off, form)
    assert w.form is form and cb.pack_bits_cpu(codes, bits, scale, off).form is form  # the smallest exact form
    back = cb.unpack_bits_cpu(w)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scale)
    assert (back[2] is None) if off is None else torch.equal(back[2], off)
    dense = cb.bits_dequant(w)
    assert torch.equal(dense, cb.bits_dequant_ref(w))  # the same roundings, bit for bit
    for m in (1, 3, 13):  # chunks of 2 + 1 and 8 + 4 + 1 activation rows
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        got = cb.bits_matmul(x, w)
        scale_of = cb.bits_matmul_ref(x, w).abs().max()
        torch.testing.assert_close(got, cb.bits_matmul_ref(x, w), atol=2e-6 * scale_of, rtol=1e-5)
        # The many-row path (dequantise once + one sgemm on the rounded activations) gives the same numbers.
        torch.testing.assert_close(got, F.linear(cg.round_activations(x), dense), atol=2e-6 * scale_of, rtol=1e-5)
        assert (got - x @ dense.t()).abs().max() < 0.02 * scale_of  # int8 activations: well under a percent


@pytest.mark.parametrize("isa", [None, cg.Isa.AVX2], ids=["best", "avx2"])
@pytest.mark.parametrize("offset", [False, True], ids=["symmetric", "offset"])
@pytest.mark.parametrize("bits", [2, 3])
def test_two_and_three_bit_codes_equal_their_twins(bits: int, offset: bool, isa: cg.Isa | None) -> None:
    # groups of 16 only (GGUF Q2_K / Q3_K); K 608: two records of 8 blocks and one of 3 (the 16-byte plane)
    n, k = 11, 608
    form = cb.ScaleForm.U4 if offset else cb.ScaleForm.I8  # Q2_K's 4-bit scales and mins, Q3_K's 6-bit scales
    codes, scale, off = _weight(n, k, bits, 16, offset, form, seed=bits + 2 * offset)
    w = cb.pack_bits_cpu(codes, bits, scale, off)
    assert w.form is form
    back = cb.unpack_bits_cpu(w)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scale)
    with cg.use_isa(isa) if isa else contextlib.nullcontext():
        dense = cb.bits_dequant(w)
        assert torch.equal(dense, cb.bits_dequant_ref(w))
        for m in (1, 5, 11):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            ref = cb.bits_matmul_ref(x, w)
            got = cb.bits_matmul(x, w)
            torch.testing.assert_close(got, ref, atol=2e-6 * ref.abs().max(), rtol=1e-5)
            torch.testing.assert_close(got, F.linear(cg.round_activations(x), dense), atol=2e-6 * ref.abs().max(),
                                       rtol=1e-5)
    with pytest.raises(ValueError, match="groups of 16"):
        cb.pack_bits_cpu(codes, bits, scale[:, ::2], None)


@pytest.mark.parametrize("bits", [2, 3, 5, 6, 8])
def test_every_short_last_record(bits: int) -> None:
    for blocks in range(9, 16):  # one record of 8, then 1..7 blocks (the specialised 2 / 4 / 6 and the others)
        form = cb.ScaleForm.I8 if bits <= 3 else cb.ScaleForm.F16
        codes, scale, off = _weight(5, 32 * blocks, bits, 16, blocks % 2 == 0, form, seed=blocks)
        w = cb.pack_bits_cpu(codes, bits, scale, off)
        assert torch.equal(cb.unpack_bits_cpu(w)[0], codes)
        assert torch.equal(cb.bits_dequant(w), cb.bits_dequant_ref(w))
        x = torch.randn(2, 32 * blocks)
        ref = cb.bits_matmul_ref(x, w)
        torch.testing.assert_close(cb.bits_matmul(x, w), ref, atol=2e-6 * ref.abs().max(), rtol=1e-5)


def test_two_threads_give_the_same_bits_and_rows_are_dequantised_alone() -> None:
    codes, scale, _ = _weight(131, 256, 6, 16, False, cb.ScaleForm.I8, seed=3)
    w = cb.pack_bits_cpu(codes, 6, scale, None)
    x = torch.randn(2, 256)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, dense_one = cb.bits_matmul(x, w), cb.bits_dequant(w)
        torch.set_num_threads(2)
        two, dense_two = cb.bits_matmul(x, w), cb.bits_dequant(w)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two) and torch.equal(dense_one, dense_two)  # rows split over threads, never a sum
    rows = torch.tensor([[130, 0], [7, 130]])
    assert torch.equal(cb.bits_rows(w, rows), dense_one[rows])
    assert cb.bits_matmul(torch.zeros(0, 256), w).shape == (0, 131)


def test_bad_input_is_named() -> None:
    codes, scale, _ = _weight(4, 64, 5, 32, False, cb.ScaleForm.F32, seed=0)
    with pytest.raises(ValueError, match="bits must be"):
        cb.pack_bits_cpu(codes, 4, scale, None)
    with pytest.raises(ValueError, match="exceed 2 bits"):
        cb.pack_bits_cpu(codes, 2, torch.cat([scale, scale], dim=1), None)
    with pytest.raises(ValueError, match="exceed 5 bits"):
        cb.pack_bits_cpu(codes | 32, 5, scale, None)
    with pytest.raises(ValueError, match="16 or 32 columns"):
        cb.pack_bits_cpu(codes, 5, scale[:, :1], None)
    with pytest.raises(ValueError, match="not exact in F16"):
        cb.pack_bits_cpu(codes, 5, scale + 1e-4, None, cb.ScaleForm.F16)
    with pytest.raises(ValueError, match="columns"):
        cb.bits_matmul(torch.zeros(1, 32), cb.pack_bits_cpu(codes, 5, scale, None))


# ---- GGUF blocks, through the production converter (layers/quant/gguf.py bits_groups) --------------------

BITS = {T.Q5_0: 5, T.Q5_1: 5, T.Q8_0: 8, T.Q5_K: 5, T.Q6_K: 6, T.Q2_K: 2, T.Q3_K: 3}
D_AT = {T.Q5_K: (slice(0, 2), slice(2, 4)), T.Q6_K: (slice(208, 210),),  # fp16 d (and dmin) bytes of a block
        T.Q2_K: (slice(80, 82), slice(82, 84)), T.Q3_K: (slice(108, 110),)}
# The CPU form's bits per weight for the 2- and 3-bit types (their files': 2.625, 3.4375): Q2_K's fp32 d and dmin
# per 256 where the file has fp16, Q3_K's 6-bit scales a byte each.
CPU_BITS = {T.Q2_K: 2.75, T.Q3_K: 3.625}


def _dequant(blocks: np.ndarray, t: T) -> np.ndarray:
    return gguf.quants.dequantize(blocks.reshape(-1, gguf.GGML_QUANT_SIZES[t][1]), t)


def _blocks(t: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[n, k / block * type bytes]: gguf's quantiser where it has one, else random blocks with sane fp16 d."""
    size, nbytes = gguf.GGML_QUANT_SIZES[t]
    if t in (T.Q5_0, T.Q5_1, T.Q8_0):
        return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), t).reshape(n, -1)
    raw = rng.integers(0, 256, (n * k // size, nbytes), dtype=np.uint8)
    for at in D_AT[t]:
        raw[:, at] = (rng.random((raw.shape[0], 1)) / 100).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def _cpu(blocks: np.ndarray, t: T, k: int) -> cb.BitsCPU:
    g = bits_groups(GGUFBlocks(t, (blocks.shape[0], k), blocks))
    assert g.bits == BITS[t]
    return cb.pack_bits_cpu(g.codes, g.bits, g.scale, g.offset)


@pytest.mark.parametrize("t", list(BITS), ids=[t.name for t in BITS])
def test_gguf_blocks_stay_quantised_and_exact(t: T) -> None:
    n, k = 9, 512 if t not in CPU_BITS else 768  # Q2_K / Q3_K: three super-blocks
    blocks = _blocks(t, n, k, np.random.default_rng(int(t)))
    w = _cpu(blocks, t, k)
    forms = {T.Q5_K: cb.ScaleForm.I8, T.Q6_K: cb.ScaleForm.I8, T.Q3_K: cb.ScaleForm.I8, T.Q2_K: cb.ScaleForm.U4}
    assert w.form is forms.get(t, cb.ScaleForm.F16)
    size, nbytes = gguf.GGML_QUANT_SIZES[t]
    expect = torch.from_numpy(_dequant(blocks, t))
    assert torch.equal(cb.bits_dequant(w), expect.reshape(n, k))
    if t in CPU_BITS:
        assert cb.resident_bytes(w) * 8 == CPU_BITS[t] * n * k
    else:
        assert cb.resident_bytes(w) / (n * k) <= 1.10 * nbytes / size  # within 10 % of the file's bytes
    x = torch.randn(2, k)
    torch.testing.assert_close(cb.bits_matmul(x, w), F.linear(cg.round_activations(x), expect.reshape(n, k)),
                               atol=1e-4, rtol=1e-5)


def test_smollm2_q8_0_embedding_rows(smollm2_path: Path) -> None:
    tensor = next(t for t in gguf.GGUFReader(smollm2_path).tensors if t.name == "token_embd.weight")
    assert tensor.tensor_type == T.Q8_0
    blocks = np.asarray(tensor.data[:64])  # [rows, K / 32 * 34] bytes: 64 real rows of the file
    w = _cpu(blocks, T.Q8_0, 576)
    assert w.form is cb.ScaleForm.F16 and cb.resident_bytes(w) == blocks.size  # Q8_0's own 8.5 bits
    assert torch.equal(cb.bits_dequant(w), torch.from_numpy(_dequant(blocks, T.Q8_0)).reshape(64, -1))


@pytest.mark.parametrize("bits,group", [(8, 32), (6, 16)])
def test_many_rows_run_in_slices_with_each_rows_own_numbers(bits: int, group: int) -> None:
    # ab_bits_matmul takes many rows in slices (K 2048: 32 rows; K 576: 112; AVX-512 VNNI's 8-bit kernel,
    # cpu_bits_q8z.c, 64 and 224), each a full pass over the tiles: 75 rows at K 2048 are slices of 32, 32 and 11
    # (64 and an odd 11), 120 at K 576 of 112 and 8 (one); every row's result is its result alone
    for k, m in ((2048, 75), (576, 120)):
        form = cb.ScaleForm.I8 if bits == 6 else cb.ScaleForm.F16
        codes, scale, _ = _weight(9, k, bits, group, False, form, seed=k + bits)
        w = cb.pack_bits_cpu(codes, bits, scale, None, form)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
        got = cb.bits_matmul(x, w)
        alone = torch.cat([cb.bits_matmul(x[i:i + 1], w) for i in range(m)])
        assert torch.equal(got, alone)
        ref = cb.bits_matmul_ref(x, w)
        torch.testing.assert_close(got, ref, atol=2e-6 * ref.abs().max(), rtol=1e-5)
