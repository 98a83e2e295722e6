"""The host tier's page copies: whole pages, every layer, exact both ways."""

from __future__ import annotations

import pytest
import torch

from agentbox.engine.cache.host_tier import HostTier, copy_pages, host_pages_for
from agentbox.engine.cache.kv_pool import PagePool
from agentbox.layers.backends.base import KVCache


def _random_cache(num_pages: int, page_size: int, dtype: torch.dtype, device: str = "cpu") -> KVCache:
    kv = KVCache.uniform(3, num_pages, page_size, 2, 4, dtype, device)
    g = torch.Generator().manual_seed(0)
    for t in (*kv.k, *kv.v):
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    return kv


def _page(kv: KVCache, page: int) -> list[torch.Tensor]:
    ps = kv.page_size
    return [t[page * ps : (page + 1) * ps].cpu().clone() for t in (*kv.k, *kv.v)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])  # fp16: the default CPU pool
def test_round_trip_gpu_pool_host_gpu_pool_is_exact(dtype: torch.dtype) -> None:
    gpu = _random_cache(9, 4, dtype)
    host = HostTier.like(gpu, 6)
    assert host.kv.k[0].dtype == dtype and host.kv.k[0].shape[1:] == gpu.k[0].shape[1:]
    src = [7, 2, 5]
    originals = {p: _page(gpu, p) for p in src}
    untouched = _page(gpu, 1)
    hp = host.pool.alloc(3)
    copy_pages(gpu, src, host.kv, hp)
    for s, h in zip(src, hp, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(originals[s], _page(host.kv, h), strict=True))
    back = [3, 8, 6]  # different GPU pages than they came from
    for t in (*gpu.k, *gpu.v):
        t.zero_()
    copy_pages(host.kv, hp, gpu, back)
    for s, d in zip(src, back, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(originals[s], _page(gpu, d), strict=True))
    assert all(not t.any() for t in _page(gpu, 1)) and any(t.any() for t in untouched)


def test_copy_rejects_mismatched_shapes() -> None:
    a = _random_cache(4, 2, torch.float32)
    b = _random_cache(4, 4, torch.float32)
    with pytest.raises(ValueError):
        copy_pages(a, [1], a, [1, 2])
    with pytest.raises(ValueError):
        copy_pages(a, [1], b, [1])
    with pytest.raises(ValueError, match="dtype"):  # an fp32 page is not fp16 bytes (--exact-cpu's pool vs the default)
        copy_pages(a, [1], _random_cache(4, 2, torch.float16), [1])
    copy_pages(a, [], a, [])  # nothing to move is fine


def test_sized_from_host_cache_gb() -> None:
    gpu = _random_cache(4, 4, torch.float32)
    per_page = gpu.page_bytes
    assert per_page == 2 * 3 * 4 * 2 * 4 * 4
    tier = HostTier.sized(gpu, 10 * per_page / 1024**3)
    assert tier is not None and tier.pool.num_pages == 10 and tier.bytes_per_page == per_page
    assert HostTier.sized(gpu, 0.0) is None  # 0 disables the tier
    # Default: a share of available RAM behind a GPU pool; none behind a pool that is itself in host RAM
    # (copying pages within the same RAM frees nothing, and would take memory the plan did not count).
    assert host_pages_for(gpu, None) == 0


def test_pool_and_cache_must_agree() -> None:
    gpu = _random_cache(4, 4, torch.float32)
    with pytest.raises(ValueError):
        HostTier(PagePool(5, 4), gpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_round_trip_through_pinned_host_on_cuda() -> None:
    gpu = _random_cache(9, 16, torch.bfloat16, "cuda")
    host = HostTier.like(gpu, 5)
    assert host.kv.k[0].is_pinned()
    src = [8, 1, 4, 2]
    originals = {p: _page(gpu, p) for p in src}
    hp = host.pool.alloc(4)
    copy_pages(gpu, src, host.kv, hp)
    back = [3, 5, 6, 7]
    copy_pages(host.kv, hp, gpu, back)
    for s, d in zip(src, back, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(originals[s], _page(gpu, d), strict=True))
