"""KV pages to bytes and back, for the disk tier: every layer's k and v of a page, page-major (so any page
of a chunk can be read alone), in the pool's own dtype (bit-exact: a page read back is the page written)."""

from __future__ import annotations

import numpy as np
import torch

from agentbox.layers.backends.base import KVCache


def _slots(pages: list[int], page_size: int, device: torch.device) -> torch.Tensor:
    p = torch.tensor(pages, dtype=torch.int64)
    return (p[:, None] * page_size + torch.arange(page_size, dtype=torch.int64)[None, :]).reshape(-1).to(device)


def pages_to_bytes(kv: KVCache, pages: list[int]) -> bytes:
    """The bytes of `pages` (each page: [2 * layers, page_size, heads, head_dim], k layers then v)."""
    idx = _slots(pages, kv.page_size, kv.k[0].device)
    staged = torch.stack([t.index_select(0, idx) for t in (*kv.k, *kv.v)])  # [2L, n * ps, H, D]
    two_l, _, h, d = staged.shape
    staged = staged.view(two_l, len(pages), kv.page_size, h, d).transpose(0, 1).contiguous().cpu()
    return staged.view(torch.uint8).numpy().tobytes()


def bytes_to_pages(kv: KVCache, pages: list[int], blobs: list[bytes]) -> None:
    """Write blobs (one per page, as pages_to_bytes made them) into `pages` of kv."""
    if not pages:
        return
    t0 = kv.k[0]
    _, h, d = t0.shape
    raw = torch.from_numpy(np.frombuffer(b"".join(blobs), dtype=np.uint8).copy())
    staged = raw.view(t0.dtype).view(len(pages), 2 * len(kv.k), kv.page_size, h, d).transpose(0, 1)
    staged = staged.reshape(2 * len(kv.k), len(pages) * kv.page_size, h, d).to(t0.device)
    idx = _slots(pages, kv.page_size, t0.device)
    for i, t in enumerate((*kv.k, *kv.v)):
        t.index_copy_(0, idx, staged[i])
