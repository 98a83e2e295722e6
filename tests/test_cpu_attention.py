"""cpu_attention.c against its torch twin: decode and extends over shuffled pages, GQA, ragged batches, a
sequence split across threads, and the torch backend's CPU path through the kernel. cpu_attention_amx.c (AMX
tiles, split-bf16 products) against the same twin, and which calls take it."""

from __future__ import annotations

import pytest
import torch

from agentbox.kernels import cpu_attention
from agentbox.kernels.cpu_attention import paged_attention, paged_attention_ref

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no AVX2 build of cpu_attention.c")


def _case(seed: int, query_lens: list[int], kv_lens: list[int], hq: int, hkv: int, hd: int, page_size: int):
    gen = torch.Generator().manual_seed(seed)
    pages_each = [-(-kv // page_size) for kv in kv_lens]
    n_pages = sum(pages_each) + 3
    perm = torch.randperm(n_pages - 1, generator=gen) + 1  # page 0 is scratch; the rest in shuffled order
    table = torch.zeros(len(kv_lens), max(pages_each), dtype=torch.int32)
    at = 0
    for s, n in enumerate(pages_each):
        table[s, :n] = perm[at:at + n].to(torch.int32)
        at += n
    k = torch.randn(n_pages * page_size, hkv, hd, generator=gen)
    v = torch.randn(n_pages * page_size, hkv, hd, generator=gen)
    q = torch.randn(sum(query_lens), hq, hd, generator=gen) * 2
    return q, k, v, table


@pytest.mark.parametrize(
    ("query_lens", "kv_lens", "hq", "hkv", "hd", "page_size", "threads"),
    [
        ([1, 1, 1], [1, 37, 300], 4, 2, 16, 16, 1),  # decode, a one-token sequence, GQA
        ([25], [5000], 2, 1, 16, 16, 2),  # a warm turn: few queries over many keys, ranges merged
        ([7, 1, 100], [7, 2100, 3000], 9, 3, 64, 16, 2),  # ragged: fresh prompt, decode, an extend split by rows
        ([33], [1500], 6, 6, 24, 8, 3),  # MHA, head size 24, pages of 8, three threads
        ([3, 40], [900, 40], 4, 1, 8, 16, 1),  # head size 8: half an AVX-512 vector (masked loads)
    ],
)
@pytest.mark.parametrize("avx512", [False, pytest.param(True, marks=pytest.mark.skipif(
    "avx512f" not in cpu_attention.cpu_flags(), reason="no AVX-512F"))])
def test_kernel_matches_twin(query_lens, kv_lens, hq, hkv, hd, page_size, threads, avx512) -> None:
    q, k, v, table = _case(len(kv_lens) * 7 + hd, query_lens, kv_lens, hq, hkv, hd, page_size)
    scale = hd ** -0.5
    got = paged_attention(q, k, v, table, page_size, query_lens, kv_lens, scale, n_threads=threads, avx512=avx512,
                          amx=False)
    want = paged_attention_ref(q, k, v, table, page_size, query_lens, kv_lens, scale)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize(
    ("query_lens", "kv_lens", "hq", "hkv", "hd", "page_size", "threads"),
    [
        # 300 tokens from position 255: the block of tokens 0 and 1 straddles the span at 256 (token 0 sees none
        # of it), the diagonal runs through every span after, 555 keys end on a short tile; blocks of 6 rows are
        # 2 tokens of SmolLM2's group of 3
        ([300], [555], 9, 3, 64, 16, 1),
        ([300], [555], 9, 3, 64, 16, 2),  # the same split by rows across 2 threads (groups of 384, one short)
        # groups of 5 rows: every tail of a row block (35, 5, 25, 15 and 10 rows: tails of 5, 5, 1, 3, 4), ragged,
        # split by keys on 2 threads (1029 keys: 2 ranges)
        ([7, 1, 5, 3, 2], [300, 70, 1029, 5, 2], 5, 1, 16, 16, 2),
        ([50], [2100], 8, 2, 32, 8, 2),  # a group of 4: blocks of 6 rows end mid-token; 200 rows split by rows
        ([40, 3], [1100, 700], 4, 2, 80, 16, 1),  # head 80: one 64-dim pass and one vector (AVX-512)
        ([24], [600], 6, 3, 40, 16, 2),  # head 40: two vectors and a masked half (AVX-512), 48 rows by keys
        ([70], [390], 4, 1, 128, 16, 2),  # head 128: two 64-dim passes; 280 rows by rows on 2 threads
    ],
)
@pytest.mark.parametrize("avx512", [False, pytest.param(True, marks=pytest.mark.skipif(
    "avx512f" not in cpu_attention.cpu_flags(), reason="no AVX-512F"))])
def test_kernel_blocks_and_diagonals_match_twin(query_lens, kv_lens, hq, hkv, hd, page_size, threads, avx512) -> None:
    """The register-blocked kernel's edges: blocks of 6 rows over GQA groups of 3, 4 and 5 and their short tails,
    causal masking where a block's rows meet a span boundary or the diagonal, a last tile of fewer than 64 keys,
    head sizes that end on a partial pass, and both thread splits (rows into groups, keys into ranges)."""
    q, k, v, table = _case(sum(kv_lens) + hd, query_lens, kv_lens, hq, hkv, hd, page_size)
    q = q * 4  # scores of a few units: the running max moves and the rescales matter
    scale = hd ** -0.5
    got = paged_attention(q, k, v, table, page_size, query_lens, kv_lens, scale, n_threads=threads, avx512=avx512,
                          amx=False)
    want = paged_attention_ref(q, k, v, table, page_size, query_lens, kv_lens, scale)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_kernel_is_deterministic_across_thread_counts() -> None:
    """A sequence split by rows computes each row exactly as on one thread (no merge): bit for bit."""
    q, k, v, table = _case(3, [200], [1000], 9, 3, 64, 16)
    args = (q, k, v, table, 16, [200], [1000], 0.125)
    one = paged_attention(*args, n_threads=1, amx=False)
    assert torch.equal(one, paged_attention(*args, n_threads=2, amx=False))
    assert torch.equal(one, paged_attention(*args, n_threads=3, amx=False))


needs_amx = pytest.mark.skipif(not cpu_attention.amx_available(),
                               reason=f"no AMX attention here: {cpu_attention.amx_unavailable_reason()}")


@needs_amx
@pytest.mark.parametrize(
    ("query_lens", "kv_lens", "hq", "hkv", "hd", "page_size", "threads"),
    [
        ([100], [3000], 9, 3, 64, 16, 1),  # a chunk at an offset over cached keys, GQA 3:1, 300 rows
        ([70, 200, 33], [70, 1000, 533], 9, 3, 64, 16, 2),  # ragged: a fresh prompt, rows split in groups, keys
        # not a multiple of the 32-key tile or the 512-key span
        ([64], [300], 4, 2, 128, 8, 1),  # head size 128 (four 32-dim tiles), pages of 8
        ([1, 5], [40, 9], 6, 2, 32, 16, 1),  # a decode row and a short prompt forced through: padding rows
        # head sizes padded to 32 inside the kernel (zero dims in the splits and the value tiles)
        ([30], [5000], 2, 1, 16, 16, 1),  # the bench model's warm turn: 60 rows of head 16 over cached keys
        ([7, 1, 45], [7, 900, 1300], 2, 1, 16, 8, 2),  # ragged, pages of 8: 14, 2 and 90 rows
        ([200], [2000], 4, 2, 16, 16, 2),  # 400 rows a kv head: rows split in groups across threads
        ([50, 21], [50, 700], 9, 3, 48, 16, 2),  # head 48: a fresh prompt and 63 rows at an offset
        ([40], [1100], 4, 2, 80, 8, 1),  # head 80, pages of 8: 80 rows
        # few rows on two threads: the keys split into ranges of whole spans, merged by their maxima
        ([30, 2], [20000, 17000], 2, 1, 16, 8, 2),  # a warm turn and a decode row, pages of 8
        ([21], [40000], 9, 3, 64, 16, 2),  # SmolLM2's heads: 63 rows on each of 3 kv heads, 2 ranges each
    ],
)
def test_amx_kernel_matches_twin(query_lens, kv_lens, hq, hkv, hd, page_size, threads) -> None:
    """Split-bf16 products keep ~16 bits: measured ~1e-5 of the output's largest value off the fp64 twin (the
    fp32 kernel ~2e-6). The bound, 1e-4 of it, leaves 10x room and is 50x under what rounding q, k, v to
    plain bf16 gives on these cases (5e-3 to 7e-3): a kernel that dropped the lo parts fails it."""
    q, k, v, table = _case(len(kv_lens) * 5 + hd, query_lens, kv_lens, hq, hkv, hd, page_size)
    scale = hd ** -0.5
    got = paged_attention(q, k, v, table, page_size, query_lens, kv_lens, scale, n_threads=threads, amx=True)
    want = paged_attention_ref(q, k, v, table, page_size, query_lens, kv_lens, scale)
    torch.testing.assert_close(got, want, rtol=0.0, atol=1e-4 * want.abs().max().item())


@needs_amx
def test_amx_takes_only_sequences_of_many_rows() -> None:
    """By default a step's chunk (AMX_MIN_TOKENS tokens and AMX_MIN_ROWS rows a kv head or more) goes to the tiles
    and its decode rows stay on the fp32 kernel, bit for bit; amx=False keeps both there."""
    query_lens, kv_lens = [1, 40], [500, 800]  # 3 rows and 120 rows a kv head
    q, k, v, table = _case(5, query_lens, kv_lens, 9, 3, 64, 16)
    args = (q, k, v, table, 16, query_lens, kv_lens, 0.125)
    mixed, tiles, fp32 = (paged_attention(*args, amx=a) for a in (None, True, False))
    assert torch.equal(mixed[:1], fp32[:1]) and not torch.equal(mixed[:1], tiles[:1])
    assert torch.equal(mixed[1:], tiles[1:]) and not torch.equal(mixed[1:], fp32[1:])


@needs_amx
def test_amx_takes_a_warm_turn_but_not_a_verify() -> None:
    """The thresholds (rows a kv head: tokens x query heads a kv head; tokens), for heads padded inside the kernel
    too: the bench model's warm turn (head 16, 2 query heads a kv head, 20-34 tokens) takes the tiles, a verify of
    a 16-token draft (17 tokens) and a decode do not, and a call holding one of each side splits between the
    kernels, each part bit for bit its kernel's."""
    assert (cpu_attention.AMX_MIN_ROWS, cpu_attention.AMX_MIN_TOKENS) == (16, 18)
    assert cpu_attention._tiled([17, 18, 30, 1], 2, 16, None) == [False, True, True, False]
    assert cpu_attention._tiled([17, 18], 3, 48, None) == [False, True]  # head 48: 51 and 54 rows
    assert cpu_attention._tiled([30], 2, 24, None) == [False]  # a head the tiles do not take
    query_lens, kv_lens = [17, 18], [3000, 2500]
    q, k, v, table = _case(11, query_lens, kv_lens, 2, 1, 16, 16)
    args = (q, k, v, table, 16, query_lens, kv_lens, 0.25)
    mixed, tiles, fp32 = (paged_attention(*args, amx=a) for a in (None, True, False))
    assert torch.equal(mixed[:17], fp32[:17]) and not torch.equal(mixed[:17], tiles[:17])
    assert torch.equal(mixed[17:], tiles[17:]) and not torch.equal(mixed[17:], fp32[17:])


def test_without_amx_every_sequence_stays_on_the_fp32_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU without AMX (or an OS that refused the tiles), and head sizes the tiles do not take, run the fp32
    kernel bit for bit; forcing the tiles there is an error, not a silent fallback."""
    query_lens, kv_lens = [100], [400]
    for hd, amx_here in ((24, True), (64, False)):
        monkeypatch.setattr(cpu_attention, "amx_available", lambda amx_here=amx_here: amx_here)
        q, k, v, table = _case(9, query_lens, kv_lens, 6, 2, hd, 16)
        args = (q, k, v, table, 16, query_lens, kv_lens, hd ** -0.5)
        assert torch.equal(paged_attention(*args), paged_attention(*args, amx=False))
        with pytest.raises(RuntimeError, match="AMX attention kernel"):
            paged_attention(*args, amx=True)


def test_refuses_shapes_it_does_not_take() -> None:
    q, k, v, table = _case(0, [2], [20], 2, 1, 12, 16)
    assert not cpu_attention.supports(q, k)
    with pytest.raises(RuntimeError, match="head size a multiple of 8"):
        paged_attention(q, k, v, table, 16, [2], [20], 0.3)


def test_torch_backend_takes_the_kernel_and_plans_only_for_a_window() -> None:
    """A step's plain layers run the kernel with nothing of the gather layout built; a windowed layer of the
    same step plans it then. Both equal the gather path (the backend with views off)."""
    from agentbox.layers.backends.base import AttentionMetadata, KVCache
    from agentbox.layers.backends.torch_backend import TorchAttention

    query_lens, kv_lens, page_size = [1, 9, 4], [40, 9, 70], 4
    q, k_all, v_all, table = _case(1, query_lens, kv_lens, 6, 2, 16, page_size)
    pos = [torch.arange(kv - n, kv) for n, kv in zip(query_lens, kv_lens, strict=True)]
    slots = torch.cat([table[s].long()[p // page_size] * page_size + p % page_size for s, p in enumerate(pos)])
    meta = AttentionMetadata(query_lens=query_lens, kv_lens=kv_lens, page_table=table, slot_mapping=slots,
                             page_size=page_size)
    cache = KVCache.uniform(2, k_all.shape[0] // page_size, page_size, 2, 16, torch.float32, "cpu")
    for layer in range(2):
        cache.k[layer].copy_(k_all)
        cache.v[layer].copy_(v_all)
    k, v = k_all[slots] * 0.5, v_all[slots] * 0.5  # the new tokens' own keys, stored by the forward
    outs = []
    for use_views in (True, False):
        backend = TorchAttention(cache, 6, 2, 16, 0.25)
        backend.use_views = use_views
        backend.begin(meta)
        plain = backend.forward(0, q, k, v)
        assert backend.planned != use_views  # the kernel ran without the layout
        windowed = backend.forward(1, q, k, v, sliding_window=5)
        assert backend.planned
        outs.append((plain, windowed))
    for got, want in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_amx
def test_exact_cpu_keeps_prefill_chunks_off_the_tiles() -> None:
    """The backend's default sends a chunk to the AMX kernel; with exact_cpu (--exact-cpu) it runs the fp32 one."""
    from agentbox.layers.backends.base import AttentionMetadata, KVCache
    from agentbox.layers.backends.torch_backend import TorchAttention

    query_lens, kv_lens, page_size = [64], [200], 16
    q, k_all, v_all, table = _case(2, query_lens, kv_lens, 6, 2, 32, page_size)
    pos = torch.arange(kv_lens[0] - query_lens[0], kv_lens[0])
    slots = table[0].long()[pos // page_size] * page_size + pos % page_size
    meta = AttentionMetadata(query_lens=query_lens, kv_lens=kv_lens, page_table=table, slot_mapping=slots,
                             page_size=page_size)
    cache = KVCache.uniform(1, k_all.shape[0] // page_size, page_size, 2, 32, torch.float32, "cpu")
    cache.k[0].copy_(k_all)
    cache.v[0].copy_(v_all)
    args = (q, k_all, v_all, table, page_size, query_lens, kv_lens, 0.25)
    for exact, want in ((False, paged_attention(*args, amx=True)), (True, paged_attention(*args, amx=False))):
        backend = TorchAttention(cache, 6, 2, 32, 0.25)
        backend.exact_cpu = exact
        backend.begin(meta)
        assert torch.equal(backend.forward(0, q, k_all[slots], v_all[slots]), want)


SPREAD_PROBE = """
import os, torch
from agentbox.kernels.cpu_attention import paged_attention
q, k, v = torch.randn(30, 2, 16), torch.randn(4096, 1, 16), torch.randn(4096, 1, 16)
table = torch.arange(256, dtype=torch.int32)[None]
def cpu():
    with open("/proc/thread-self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[36])
def pinned():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            mask = next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list"))
        out[int(tid)] = mask
    return out
before = pinned()
at = cpu()
paged_attention(q, k, v, table, 16, [30], [4096], 0.25, n_threads=len(os.sched_getaffinity(0)), amx=False)
after, at_end = pinned(), cpu()
print(at if at == at_end else -1, before[os.getpid()], after[os.getpid()], sorted(m for t, m in after.items() if t not in before))
"""


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="one CPU: nothing to spread over")
def test_a_call_on_every_cpu_keeps_its_workers_off_the_callers_cpu() -> None:
    # omp_spread.h: each worker libgomp starts is pinned to one CPU, none the caller's, which stays unpinned.
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    r = subprocess.run([sys.executable, "-c", SPREAD_PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    at, main_before, main_after, new = r.stdout.split(maxsplit=3)
    workers = eval(new)  # noqa: S307 - the probe's own printed list
    assert main_after == main_before  # the caller is never pinned
    assert len(workers) == len(os.sched_getaffinity(0)) - 1, workers
    assert all("," not in w and "-" not in w for w in workers), workers  # each on one CPU
    assert len(set(workers)) == len(workers) and str(at) not in workers  # at -1: the caller moved meanwhile
