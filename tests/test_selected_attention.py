"""layers/selected_attention: the gathered form (a query's selected keys only, in chunks of queries) against SDPA
over every key with the selection as its mask, and the dense fallback where the selection is not sparse."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agentbox.layers import selected_attention as sa


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("keep", [0.02, 0.6])  # sparse: gathered; dense: SDPA kept
def test_selected_attention_equals_masked_sdpa(keep: float, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    b, n_q, n, h, d, dv = 2, 37, 300, 3, 16, 8
    q, k, v = (torch.randn(b, n_q, h, d, generator=g), torch.randn(b, n, h, d, generator=g),
               torch.randn(b, n, h, dv, generator=g))
    mask = torch.rand(b, n_q, n, generator=g) < keep
    mask[..., 5] = True  # every row non-empty; rows of different widths
    monkeypatch.setattr(sa, "GATHER_BYTES", 4096)  # several chunks of queries
    out = sa.selected_attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, dense(q, k, v, mask, 0.25), atol=1e-5, rtol=1e-5)
