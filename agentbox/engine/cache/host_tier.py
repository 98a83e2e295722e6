"""The host-memory tier: a second paged KV pool in CPU RAM that the radix cache demotes GPU pages into
instead of dropping them, and promotes them back from instead of recomputing.

`HostTier` is a `PagePool` (the same bookkeeping as the GPU pool: page ids, refcounts, page 0 scratch) plus a
`KVCache` on the CPU with the GPU cache's layer shapes, dtype and page size. On a CUDA
machine its tensors are pinned, so copies to and from the GPU run at full PCIe speed. On CPU the tier is
just a second CPU pool, which keeps the whole demote/promote path testable without a GPU.

`copy_pages` moves whole pages across all layers with one gather per layer on the source side, one
transfer for all layers, and one `index_copy_` per layer on the destination: batched, never per token.
"""

from __future__ import annotations

import torch

from agentbox.engine.cache.kv_pool import PagePool
from agentbox.layers.backends.base import KVCache

# With no --host-cache-gb, the tier takes this share of the RAM that is available at start.
DEFAULT_HOST_POOL_MULTIPLE = 4
DEFAULT_HOST_SHARE = 0.25


def copy_pages(src: KVCache, src_pages: list[int], dst: KVCache, dst_pages: list[int]) -> None:
    """Copy the entries of `src_pages` in `src` into `dst_pages` of `dst`, every layer. Pages pair up in order."""
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"copy of {len(src_pages)} pages into {len(dst_pages)}")
    if not src.same_layout(dst):
        raise ValueError("the two caches differ in page size, layer shapes, entry sizes or dtype")
    if not src_pages:
        return
    src_dev, dst_dev = src.k[0].device, dst.k[0].device
    per_page = src.tensor_slots_per_page()
    src_idx = {n: src.page_slots(src_pages, n, src_dev) for n in set(per_page)}
    dst_idx = {n: dst.page_slots(dst_pages, n, dst_dev) for n in set(per_page)}
    # One staging tensor for all layers (k and v, flattened: layers may differ in shape): a single transfer
    # between devices. Blocking on purpose: a non-blocking device-to-host copy would be read by index_copy_
    # before it lands.
    parts = [t.index_select(0, src_idx[n]) for t, n in zip(src.tensors(), per_page, strict=True)]
    staged = torch.cat([p.reshape(-1) for p in parts])
    if staged.device != dst_dev:
        staged = staged.to(dst_dev)
    for t, n, chunk in zip(dst.tensors(), per_page, staged.split([p.numel() for p in parts]), strict=True):
        t.index_copy_(0, dst_idx[n], chunk.view(len(dst_idx[n]), *t.shape[1:]))


class HostTier:
    def __init__(self, pool: PagePool, kv: KVCache) -> None:
        if pool.num_pages != kv.num_pages or pool.page_size != kv.page_size:
            raise ValueError("the host pool and its KV cache disagree on pages or page size")
        self.pool = pool
        self.kv = kv

    @classmethod
    def like(cls, gpu_kv: KVCache, num_pages: int) -> HostTier:
        """A host tier of num_pages pages shaped like gpu_kv (pinned when CUDA is present)."""
        # empty, not zeros: a page is always written before it is read, and untouched memory stays uncommitted.
        kv = gpu_kv.like(num_pages, "cpu", zeroed=False, pin_memory=torch.cuda.is_available())
        return cls(PagePool(num_pages, gpu_kv.page_size), kv)

    @classmethod
    def sized(cls, gpu_kv: KVCache, host_cache_gb: float | None) -> HostTier | None:
        """The tier for --host-cache-gb (None: a share of available RAM). None when it would be under
        two pages (0 disables the tier)."""
        num_pages = host_pages_for(gpu_kv, host_cache_gb)
        return cls.like(gpu_kv, num_pages) if num_pages >= 2 else None

    @property
    def bytes_per_page(self) -> int:
        return self.kv.page_bytes


def host_pages_for(gpu_kv: KVCache, host_cache_gb: float | None) -> int:
    if host_cache_gb is None:
        if gpu_kv.k[0].device.type == "cpu":
            return 0  # the pool already lives in host RAM: a copy in the same RAM would free nothing
        import psutil

        # A share of free RAM, but no more than a few times the GPU pool: beyond that the tier only costs
        # memory (pinned memory on GPU machines is not swappable) without holding more sessions in practice.
        budget = min(psutil.virtual_memory().available * DEFAULT_HOST_SHARE,
                     DEFAULT_HOST_POOL_MULTIPLE * gpu_kv.page_bytes * gpu_kv.num_pages)
    else:
        budget = host_cache_gb * 1024**3
    return int(budget // gpu_kv.page_bytes)
