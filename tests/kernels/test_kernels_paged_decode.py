"""paged_decode (split-KV, GQA-grouped) against its torch twin: page sizes 1 and 16, GQA ratios 1/3/4/8,
ragged lengths, sinks, sliding windows, fp16, and a padded row (kv_len 0) that must come out zeros."""

from __future__ import annotations

import pytest
import torch
from paged_case import DEVICE, paged_case, tolerance

from agentbox.kernels.paged_decode import paged_decode, paged_decode_ref

KV_LENS = [1, 37, 70]


@pytest.mark.parametrize(
    ("page_size", "num_heads", "num_kv_heads", "num_splits"),
    [(1, 2, 2, 1), (16, 8, 2, 4), (16, 8, 1, 3), (1, 4, 1, 2), (16, 6, 2, 2)],
)
@pytest.mark.parametrize("variant", ["plain", "sinks", "window"])
def test_paged_decode_matches_reference(
    page_size: int, num_heads: int, num_kv_heads: int, num_splits: int, variant: str
) -> None:
    case = paged_case([1] * len(KV_LENS), KV_LENS, page_size=page_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    extra: dict = {}
    if variant == "sinks":
        extra["sinks"] = torch.linspace(-1.0, 2.0, num_heads, device=DEVICE)
    if variant == "window":
        extra["sliding_window"] = 20
    args = (case.q, case.k_cache, case.v_cache, case.page_table, case.kv_lens)
    got = paged_decode(*args, page_size=page_size, scale=case.scale, num_splits=num_splits, block_n=16, **extra)
    expected = paged_decode_ref(*args, page_size=page_size, scale=case.scale, **extra)
    torch.testing.assert_close(got, expected, **tolerance(torch.float32))


def test_paged_decode_fp16_and_padded_row() -> None:
    kv_lens = [45, 0, 16]
    case = paged_case([1, 1, 1], kv_lens, page_size=16, num_heads=4, num_kv_heads=1, dtype=torch.float16, seed=3)
    args = (case.q, case.k_cache, case.v_cache, case.page_table, case.kv_lens)
    sinks = torch.tensor([0.5, -0.5, 1.0, 0.0], device=DEVICE)
    got = paged_decode(*args, page_size=16, scale=case.scale, sinks=sinks, num_splits=2, block_n=16)
    expected = paged_decode_ref(*args, page_size=16, scale=case.scale, sinks=sinks)
    torch.testing.assert_close(got, expected, **tolerance(torch.float16))
    assert torch.count_nonzero(got[1]) == 0
