"""cpu_attention.c over an fp16 KV cache (the default CPU pool) against its torch twin over the same cache widened:
the kernel widens each tile's keys and values with F16C, so it must match the twin as tightly as over fp32, and
reading the fp16 bits as fp32 (or the fp32 pool as fp16) could not come near it. The AMX kernel reads fp32 only."""

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
    with pytest.raises(RuntimeError, match="fp32 cache only"):
        paged_attention(q, k.half(), v.half(), table, 16, [1], [40], 0.25, amx=True)


def test_fp16_cache_never_takes_the_amx_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk (many rows) over an fp16 cache stays on the widening kernel even where AMX runs."""
    seen: list[bool | None] = []
    real = cpu_attention._tiled

    def spy(query_lens: list[int], group: int, head_dim: int, amx: bool | None) -> list[bool]:
        seen.append(amx)
        return real(query_lens, group, head_dim, amx)

    monkeypatch.setattr(cpu_attention, "_tiled", spy)
    q, k, v, table = _case(4, [64], [64], 4, 1, 16, 16)
    paged_attention(q, k.half(), v.half(), table, 16, [64], [64], 0.25)
    assert seen == [False]
