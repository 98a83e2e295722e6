"""Random paged-attention cases for the kernel tests: a KV cache full of random values (so a wrong slot is
visible), each sequence's pages drawn shuffled from the pool, ragged query and kv lengths."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Token ids for the tiny models (vocab 256).
PROMPT = [5, 17, 200, 3, 99, 42, 7, 128, 64, 1, 250, 33, 8, 111, 30, 77, 19, 2, 50, 61, 14, 9]


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_slots, Hkv, D]
    v_cache: torch.Tensor
    page_table: torch.Tensor  # [B, max_pages] int32
    query_start: torch.Tensor  # [B + 1] int32
    kv_lens: torch.Tensor  # [B] int32
    page_size: int
    scale: float
    max_query_len: int


def paged_case(
    q_lens: list[int],
    kv_lens: list[int],
    *,
    page_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 32,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedCase:
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-kv // page_size) for kv in kv_lens]
    num_pages = sum(pages_per_seq) + 2
    order = torch.randperm(num_pages, generator=gen).tolist()
    max_pages = max(max(pages_per_seq), 1)
    table = torch.zeros(len(kv_lens), max_pages, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(pages_per_seq):
        table[i, :n] = torch.tensor(order[taken : taken + n], dtype=torch.int32)
        taken += n
    shape = (num_pages * page_size, num_kv_heads, head_dim)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return PagedCase(
        q=torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(DEVICE, dtype),
        k_cache=torch.randn(shape, generator=gen).to(DEVICE, dtype),
        v_cache=torch.randn(shape, generator=gen).to(DEVICE, dtype),
        page_table=table.to(DEVICE),
        query_start=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE),
        page_size=page_size,
        scale=head_dim**-0.5,
        max_query_len=max(q_lens),
    )


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 2e-5, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-3, "rtol": 3e-3}
