"""KV pages to bytes and back, for the disk tier: every layer's k and v of a page, page-major (so any page
of a chunk can be read alone), in the pool's own dtype (bit-exact: a page read back is the page written)."""

from __future__ import annotations

import torch

from agentbox.layers.backends.base import KVCache


def _slots(pages: list[int], page_size: int, device: torch.device) -> torch.Tensor:
    p = torch.tensor(pages, dtype=torch.int64)
    return (p[:, None] * page_size + torch.arange(page_size, dtype=torch.int64)[None, :]).reshape(-1).to(device)


def pages_to_bytes(kv: KVCache, pages: list[int]) -> bytes:
    """The bytes of `pages`; each page is every stored tensor's page_size slots in `kv.tensors()` order (layers
    may differ in shape; a tied layer's V is its K, stored once)."""
    idx = _slots(pages, kv.page_size, kv.k[0].device)
    n = len(pages)
    parts = [t.index_select(0, idx).reshape(n, -1) for t in kv.tensors()]  # [pages, one layer's page]
    staged = torch.cat(parts, dim=1).contiguous().cpu()  # page-major
    return staged.view(torch.uint8).numpy().tobytes()


def bytes_to_pages(kv: KVCache, pages: list[int], blobs: list[bytes]) -> None:
    """Write blobs (one per page, as pages_to_bytes made them) into `pages` of kv."""
    if pages:
        _scatter(kv, pages, torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).view(len(pages), -1))


def chunk_to_pages(kv: KVCache, pages: list[int], chunk: bytearray, places: list[int]) -> None:
    """Write the pages at `places` of a chunk (its bytes as pages_to_bytes made them, read as they are: no
    copy before the one into the pool) into `pages` of kv."""
    rows = torch.frombuffer(chunk, dtype=torch.uint8).view(-1, kv.page_bytes)
    if places != list(range(rows.shape[0])):
        rows = rows[torch.tensor(places, dtype=torch.int64)]
    _scatter(kv, pages, rows)


def _scatter(kv: KVCache, pages: list[int], rows: torch.Tensor) -> None:
    """rows: uint8 [len(pages), page bytes], page-major as pages_to_bytes made them."""
    tensors = kv.tensors()
    device = tensors[0].device
    staged = rows.view(kv.dtype).to(device)
    widths = [kv.page_size * t[0].numel() for t in tensors]
    idx = _slots(pages, kv.page_size, device)
    for t, part in zip(tensors, staged.split(widths, dim=1), strict=True):
        t.index_copy_(0, idx, part.reshape(len(pages) * kv.page_size, *t.shape[1:]))
