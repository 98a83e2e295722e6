"""prefix_extend against its torch twin: a fresh prompt, a chunk over a cached prefix and a decode in one
ragged batch (chunked prefill), page sizes 1 and 16, GQA ratios 1/3/4/8, sinks, sliding windows, fp16; and a
prompt run in chunks gives what it gives in one piece."""

from __future__ import annotations

import pytest
import torch
from paged_case import DEVICE, paged_case, tolerance

from agentbox.kernels.prefix_extend import prefix_extend, prefix_extend_ref

Q_LENS = [19, 5, 1]
KV_LENS = [19, 40, 33]  # a whole prompt, a chunk after 35 cached tokens, a decode at position 32


@pytest.mark.parametrize(("page_size", "num_heads", "num_kv_heads"), [(1, 2, 2), (16, 8, 2), (16, 8, 1), (1, 4, 1), (16, 6, 2)])
@pytest.mark.parametrize("variant", ["plain", "sinks", "window"])
def test_prefix_extend_matches_reference(page_size: int, num_heads: int, num_kv_heads: int, variant: str) -> None:
    case = paged_case(Q_LENS, KV_LENS, page_size=page_size, num_heads=num_heads, num_kv_heads=num_kv_heads)
    extra: dict = {}
    if variant == "sinks":
        extra["sinks"] = torch.linspace(-1.0, 2.0, num_heads, device=DEVICE)
    if variant == "window":
        extra["sliding_window"] = 7
    args = (case.q, case.k_cache, case.v_cache, case.page_table, case.query_start, case.kv_lens)
    kw = dict(max_query_len=case.max_query_len, page_size=page_size, scale=case.scale, **extra)
    got = prefix_extend(*args, block_m=16, block_n=16, **kw)
    torch.testing.assert_close(got, prefix_extend_ref(*args, **kw), **tolerance(torch.float32))


def test_prefix_extend_fp16_window_and_sinks() -> None:
    case = paged_case([3, 17], [10, 17], page_size=16, num_heads=4, num_kv_heads=1, dtype=torch.float16, seed=5)
    args = (case.q, case.k_cache, case.v_cache, case.page_table, case.query_start, case.kv_lens)
    kw = dict(
        max_query_len=17, page_size=16, scale=case.scale, sliding_window=5,
        sinks=torch.tensor([0.3, -1.0, 2.0, 0.0], device=DEVICE),
    )
    torch.testing.assert_close(prefix_extend(*args, **kw), prefix_extend_ref(*args, **kw), **tolerance(torch.float16))


def test_chunked_prompt_equals_whole_prompt() -> None:
    # The same 30-token prompt: one step of 30, or chunks of 12, 12 and 6 over the growing cached prefix.
    case = paged_case([30], [30], page_size=16, num_heads=4, num_kv_heads=2, seed=7)
    common = dict(page_size=16, scale=case.scale)
    whole = prefix_extend(
        case.q, case.k_cache, case.v_cache, case.page_table, case.query_start, case.kv_lens, max_query_len=30, **common
    )
    parts = []
    for lo, hi in [(0, 12), (12, 24), (24, 30)]:
        qs = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE)
        kv = torch.tensor([hi], dtype=torch.int32, device=DEVICE)
        parts.append(
            prefix_extend(
                case.q[lo:hi], case.k_cache, case.v_cache, case.page_table, qs, kv, max_query_len=hi - lo, **common
            )
        )
    torch.testing.assert_close(torch.cat(parts), whole, **tolerance(torch.float32))
