"""cpu_decode.c's paged attention (the fused decode's and the hybrid's gated layers'), through `ab_attend`: against the
fp64 twin over keys that cross its 256-key spans, the same bits at any thread count, and a verify's rows bit for bit
one-row calls at their positions."""

from __future__ import annotations

import pytest
import torch

from agentbox.kernels import cpu_gemv
from agentbox.kernels.cpu_attention import paged_attention_ref

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason=cpu_gemv.unavailable_reason() or "no kernels")
PAGE = 16


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, kv_lens: list[int],
            threads: int) -> torch.Tensor:
    """q [m, hq, hd] over caches [slots, hkv, hd]; table [m, pages] (a verify's rows repeat their sequence's row)."""
    m, hq, hd = q.shape
    hkv = k.shape[1]
    qkv = torch.cat([q.reshape(m, -1), torch.zeros(m, 2 * hkv * hd)], dim=1).contiguous()
    lens = torch.tensor(kv_lens, dtype=torch.int64)
    out = torch.full((m, hq * hd), float("nan"))
    table = table.to(torch.int32).contiguous()
    lib = cpu_gemv._lib()
    rc = lib.ab_attend(k.data_ptr(), v.data_ptr(), int(k.dtype == torch.float16), hq, hkv, hd, hd ** -0.5,
                       qkv.data_ptr(), m, table.data_ptr(), table.shape[1], PAGE, lens.data_ptr(), out.data_ptr(),
                       threads)
    assert rc == 0
    return out.view(m, hq, hd)


def _case(hq: int, hkv: int, hd: int, dtype: torch.dtype, seqs: list[list[int]], seed: int = 0):
    """Sequences given by their rows' kv lengths (one row: a decode; several: a verify's), pages shuffled in the pool."""
    g = torch.Generator().manual_seed(seed)
    per = [(max(rows) + PAGE - 1) // PAGE for rows in seqs]
    pages = torch.randperm(sum(per) + 3, generator=g)
    k = torch.randn(len(pages) * PAGE, hkv, hd, generator=g).to(dtype)
    v = torch.randn(len(pages) * PAGE, hkv, hd, generator=g).to(dtype)
    width, at, table, lens = max(per), 0, [], []
    for rows, n in zip(seqs, per, strict=True):
        row = torch.zeros(width, dtype=torch.int64)
        row[:n] = pages[at:at + n]
        at += n
        table += [row] * len(rows)
        lens += rows
    q = torch.randn(len(lens), hq, hd, generator=g) * 2
    return q, k, v, torch.stack(table), lens


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("hq", "hkv", "hd"), [(9, 3, 64), (8, 1, 128), (4, 2, 96), (5, 5, 40)])
def test_matches_the_twin_across_spans(hq: int, hkv: int, hd: int, dtype: torch.dtype) -> None:
    seqs = [[1], [255], [256], [257], [700], [510, 511, 512, 513, 514]]
    q, k, v, table, lens = _case(hq, hkv, hd, dtype, seqs)
    got = _attend(q, k, v, table, lens, threads=2)
    for t, n in enumerate(lens):
        want = paged_attention_ref(q[t:t + 1], k.float(), v.float(), table[t:t + 1], PAGE, [1], [n], hd ** -0.5)
        torch.testing.assert_close(got[t], want.view(hq, hd), atol=2e-5, rtol=1e-4)


def test_bits_do_not_depend_on_threads_or_the_rows_beside() -> None:
    seqs = [[1300], [40], [600, 601, 602, 603], [257]]
    q, k, v, table, lens = _case(9, 3, 64, torch.float16, seqs, seed=1)
    one = _attend(q, k, v, table, lens, threads=1)
    assert torch.equal(one, _attend(q, k, v, table, lens, threads=2))
    assert torch.equal(one, _attend(q, k, v, table, lens, threads=3))
    for t in range(len(lens)):  # each row alone: a one-row decode at its position
        assert torch.equal(one[t], _attend(q[t:t + 1], k, v, table[t:t + 1], [lens[t]], threads=2)[0])


def test_a_batch_past_the_partials_bound_runs_in_parts_with_the_same_bits() -> None:
    """Sequences whose span partials exceed the kernel's bound (PARTIALS, 4M floats: 258 rows x spans at 64 heads of
    256) are attended in batches of sequences; each row is still bit for bit its one-row call."""
    seqs = [[22000], [21950], [22010]]
    q, k, v, table, lens = _case(64, 1, 256, torch.float16, seqs, seed=2)
    got = _attend(q, k, v, table, lens, threads=2)
    for t in range(len(lens)):
        assert torch.equal(got[t], _attend(q[t:t + 1], k, v, table[t:t + 1], [lens[t]], threads=2)[0])
    want = paged_attention_ref(q[:1], k.float(), v.float(), table[:1], PAGE, [1], [lens[0]], 256 ** -0.5)
    torch.testing.assert_close(got[0], want.view(64, 256), atol=2e-5, rtol=1e-4)
