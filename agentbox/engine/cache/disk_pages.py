"""KV pages to bytes and back, for the disk tier: every layer's k and v of a page, page-major (so any page
of a chunk can be read alone), in the pool's own dtype (bit-exact: a page read back is the page written)."""

from __future__ import annotations

import torch

from agentbox.layers.backends.base import KVCache


def pages_to_bytes(kv: KVCache, pages: list[int]) -> bytes:
    """The bytes of `pages`; each page is every stored tensor's slots of that page in `kv.tensors()` order (layers
    may differ in shape and entry size; a tied layer's V is its K, stored once)."""
    device = kv.k[0].device
    per_page = kv.tensor_slots_per_page()
    idx = {m: kv.page_slots(pages, m, device) for m in set(per_page)}
    n = len(pages)
    parts = [t.index_select(0, idx[m]).reshape(n, -1) for t, m in zip(kv.tensors(), per_page, strict=True)]
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
    per_page = kv.tensor_slots_per_page()
    staged = rows.view(kv.dtype).to(device)
    widths = [m * t[0].numel() for t, m in zip(tensors, per_page, strict=True)]
    idx = {m: kv.page_slots(pages, m, device) for m in set(per_page)}
    for t, m, part in zip(tensors, per_page, staged.split(widths, dim=1), strict=True):
        t.index_copy_(0, idx[m], part.reshape(len(pages) * m, *t.shape[1:]))
