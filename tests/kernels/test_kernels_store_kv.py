"""store_kv against its torch twin: strided k/v views (as the qkv split hands them over), skipped slots."""

from __future__ import annotations

import pytest
import torch
from paged_case import DEVICE

from agentbox.kernels.store_kv import store_kv, store_kv_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_matches_reference(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    t, hkv, d, slots = 7, 3, 20, 40
    qkv = torch.randn(t, (4 + 2) * hkv * d, generator=gen).to(DEVICE)  # fp32 activations, cache in `dtype`
    k = qkv[:, 4 * hkv * d : 5 * hkv * d].view(t, hkv, d)
    v = qkv[:, 5 * hkv * d :].view(t, hkv, d)
    slot_mapping = torch.tensor([3, 17, -1, 0, 39, -1, 22], dtype=torch.int64, device=DEVICE)
    caches = [torch.randn(slots, hkv, d, generator=gen).to(DEVICE, dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    store_kv(k, v, caches[0], caches[1], slot_mapping)
    store_kv_ref(k, v, expected[0], expected[1], slot_mapping)
    torch.testing.assert_close(caches[0], expected[0], atol=0, rtol=0)
    torch.testing.assert_close(caches[1], expected[1], atol=0, rtol=0)
    assert not torch.equal(caches[0][3], torch.zeros_like(caches[0][3]))
