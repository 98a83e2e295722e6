"""The CPU extend attention (layers/backends/prefix_attention.py): prefix without a mask + the new tokens
causally, merged by log-sum-exp, equals causal attention computed the long way, with GQA, in fp32 and bf16,
with and without a cached prefix."""

from __future__ import annotations

import pytest
import torch

from agentbox.layers.backends.prefix_attention import extend_attention, split_available


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize(("n_q", "k_len"), [(1, 1), (5, 5), (7, 300), (64, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_attention_is_causal_attention(heads: int, kv_heads: int, n_q: int, k_len: int,
                                              dtype: torch.dtype) -> None:
    torch.manual_seed(n_q + k_len)
    d = 16
    q = torch.randn(n_q, heads, d, dtype=dtype)
    cache_k, cache_v = torch.randn(k_len + 9, kv_heads, d, dtype=dtype), torch.randn(k_len + 9, kv_heads, d, dtype=dtype)
    keys, values = cache_k.narrow(0, 4, k_len).transpose(0, 1), cache_v.narrow(0, 4, k_len).transpose(0, 1)  # views
    assert split_available(q)
    out = extend_attention(q, keys, values, d**-0.5)
    g = heads // kv_heads
    ks = keys.double().repeat_interleave(g, 0)  # [H, K, D]
    vs = values.double().repeat_interleave(g, 0)
    scores = torch.einsum("qhd,hkd->hqk", q.double(), ks) * d**-0.5
    qpos = torch.arange(k_len - n_q, k_len)[:, None]
    scores = scores.masked_fill(torch.arange(k_len)[None, :] > qpos, float("-inf"))
    expected = torch.einsum("hqk,hkd->qhd", scores.softmax(-1), vs)
    assert out.shape == (n_q, heads, d) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pages_out_of_order_attend_run_by_run(heads: int, kv_heads: int, dtype: torch.dtype, seed: int) -> None:
    """Pages in random order (a session whose turns each took pages from wherever the pool had them): the
    torch backend attends run by run over views of the cache and matches attention done the long way, for
    decodes, a fresh prefill and chunks after cached prefixes in one batch."""
    from agentbox.layers.backends.base import KVCache
    from agentbox.layers.backends.torch_backend import TorchAttention
    from tests.test_layers import make_step, naive_attention

    query_lens, kv_lens = [1, 6, 1, 3, 12, 5], [33, 6, 2, 11, 12, 40]
    page_size, num_pages, d = 4, 40, 16
    meta, slots = make_step(query_lens, kv_lens, page_size, num_pages, seed=seed)
    cache = KVCache.uniform(1, num_pages, page_size, kv_heads, d, dtype, "cpu")
    torch.manual_seed(seed)
    cache.k[0].normal_()
    cache.v[0].normal_()
    t = sum(query_lens)
    q = torch.randn(t, heads, d, dtype=dtype)
    k, v = torch.randn(t, kv_heads, d, dtype=dtype), torch.randn(t, kv_heads, d, dtype=dtype)
    backend = TorchAttention(cache, heads, kv_heads, d, d**-0.5)
    backend.view_min_mean_kv, backend.use_cpu_kernel = 0, False
    backend.begin(meta)
    assert backend.bases is None and backend.runs is not None and max(len(r) for r in backend.runs) > 1
    out = backend.forward(0, q, k, v)
    expected = naive_attention(q, cache.k[0], cache.v[0], meta, slots, d**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
