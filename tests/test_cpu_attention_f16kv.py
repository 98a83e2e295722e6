"""cpu_attention.c over an fp16 KV cache (the default CPU pool) against its torch twin over the same cache widened:
the kernel widens each tile's keys and values with F16C, so it must match the twin as tightly as over fp32, and
reading the fp16 bits as fp32 (or the fp32 pool as fp16) could not come near it. The AMX kernel (prefill chunks and
warm turns) widens them as it repacks them into its split-bf16 tiles."""

from __future__ import annotations

import pytest
import torch

from agentbox.kernels import cpu_attention
from agentbox.kernels.cpu_attention import paged_attention, paged_attention_ref
from tests.test_cpu_attention import _case

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no AVX2 build of cpu_attention.c")


@pytest.mark.parametrize(
    ("query_lens", "kv_lens", "hq", "hkv", "hd", "page_size", "threads"),
    [
        ([1, 1, 1], [1, 37, 300], 4, 2, 16, 16, 1),  # decode, GQA
        ([25], [3000], 2, 1, 16, 16, 2),  # a warm turn split into key ranges
        ([7, 1, 40], [7, 1100, 900], 9, 3, 64, 16, 2),  # SmolLM2's heads: fresh prompt, decode, an extend
        ([3, 20], [500, 20], 4, 1, 24, 8, 1),  # head size 24: a masked tail on AVX-512
        # the agent workload's later turn: 512 new tokens over 4,096 cached keys, rows split across 2 threads
        ([512], [4608], 9, 3, 64, 16, 2),
        ([130, 1, 77], [3130, 5000, 1077], 9, 3, 64, 16, 2),  # extends of two sessions and a decode in one step
    ],
)
@pytest.mark.parametrize("avx512", [False, pytest.param(True, marks=pytest.mark.skipif(
    "avx512f" not in cpu_attention.cpu_flags(), reason="no AVX-512F"))])
def test_fp16_cache_matches_twin(query_lens, kv_lens, hq, hkv, hd, page_size, threads, avx512) -> None:
    q, k, v, table = _case(len(kv_lens) * 5 + hd, query_lens, kv_lens, hq, hkv, hd, page_size)
    k16, v16 = k.half(), v.half()
    scale = hd ** -0.5
    got = paged_attention(q, k16, v16, table, page_size, query_lens, kv_lens, scale, n_threads=threads,
                          avx512=avx512)
    want = paged_attention_ref(q, k16.float(), v16.float(), table, page_size, query_lens, kv_lens, scale)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    # what the fp16 cache costs against the fp32 one it rounds: small, but visible
    exact = paged_attention_ref(q, k, v, table, page_size, query_lens, kv_lens, scale)
    assert 0 < (got - exact).abs().max() < 2e-2


def test_fp16_cache_is_supported_and_mixed_caches_are_refused() -> None:
    q, k, v, table = _case(3, [1], [40], 2, 1, 16, 16)
    assert cpu_attention.supports(q, k.half()) and cpu_attention.supports(q, k)
    assert not cpu_attention.supports(q, k.bfloat16())
    with pytest.raises(ValueError, match="fp32 or fp16"):
        paged_attention(q, k.half(), v, table, 16, [1], [40], 0.25)


needs_amx = pytest.mark.skipif(not cpu_attention.amx_available(),
                               reason=f"no AMX attention here: {cpu_attention.amx_unavailable_reason()}")


@needs_amx
@pytest.mark.parametrize(
    ("query_lens", "kv_lens", "hq", "hkv", "hd", "page_size", "threads"),
    [
        ([100], [3000], 9, 3, 64, 16, 1),  # a chunk over cached keys, GQA 3:1
        ([70, 200, 33], [70, 1000, 533], 9, 3, 64, 4, 2),  # ragged, 4-token pages, rows split in groups
        ([30], [5000], 2, 1, 16, 16, 1),  # a warm turn of head 16
        ([50, 21], [50, 700], 9, 3, 48, 16, 2),  # head 48: padded to 64 inside
        ([30, 2], [20000, 17000], 2, 1, 16, 8, 2),  # few rows: keys split into ranges and merged
    ],
)
def test_amx_kernel_over_fp16_cache_matches_twin(query_lens, kv_lens, hq, hkv, hd, page_size, threads) -> None:
    """The tiles over the fp16 pool against the fp64-summing twin over the same cache widened: the bound of
    test_cpu_attention's fp32 case (1e-4 of the output's largest value; measured ~1e-5). Reading the fp16 bits as
    fp32, or at the fp32 pool's strides, lands nowhere near it, and neither does dropping the keys' lo parts."""
    q, k, v, table = _case(len(kv_lens) * 5 + hd, query_lens, kv_lens, hq, hkv, hd, page_size)
    k16, v16 = k.half(), v.half()
    scale = hd ** -0.5
    got = paged_attention(q, k16, v16, table, page_size, query_lens, kv_lens, scale, n_threads=threads, amx=True)
    want = paged_attention_ref(q, k16.float(), v16.float(), table, page_size, query_lens, kv_lens, scale)
    torch.testing.assert_close(got, want, rtol=0.0, atol=1e-4 * want.abs().max().item())


@needs_amx
def test_fp16_cache_sends_a_chunk_to_the_tiles_and_keeps_decode_off_them() -> None:
    """With amx=None a prefill chunk over the fp16 pool takes the tiles (its result is the forced-AMX one, bit for
    bit) and a decode row in the same call stays on the widening kernel (bit for bit amx=False's)."""
    q, k, v, table = _case(4, [64, 1], [64, 900], 4, 1, 16, 16)
    args = (q, k.half(), v.half(), table, 16, [64, 1], [64, 900], 0.25)
    mixed, tiles, fp32 = (paged_attention(*args, amx=a) for a in (None, True, False))
    assert torch.equal(mixed[:64], tiles[:64]) and not torch.equal(mixed[:64], fp32[:64])
    assert torch.equal(mixed[64:], fp32[64:])
