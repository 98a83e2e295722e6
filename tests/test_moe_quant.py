"""Quantised expert methods (layers/moe_quant.py) against their definitions, at the layer level."""

from __future__ import annotations

import pytest
import torch

from agentbox.layers.moe import ExpertShard, FusedMoE, MoEActivation, moe_ref, select_experts
from agentbox.layers.moe_quant import Int4Experts


def _random_int4(out: int, k: int, group: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    q = torch.randint(0, 16, (out, k), generator=gen, dtype=torch.uint8)
    scale = 0.01 + 0.02 * torch.rand(out, k // group, generator=gen)
    offset = -8 * scale + 0.01 * torch.randn(out, k // group, generator=gen)
    w = q.float().reshape(out, k // group, group) * scale[..., None] + offset[..., None]
    return q, scale, offset, w.reshape(out, k)


def test_int4_canonical_experts_match_their_dequantised_twin() -> None:
    e, h, i, g = 4, 64, 32, 32
    gen = torch.Generator().manual_seed(0)
    layer = FusedMoE(e, 2, h, i, renormalize=True, method=Int4Experts(g))
    dense13, dense2 = torch.empty(e, 2 * i, h), torch.empty(e, h, i)
    for x in range(e):
        for shard, rows in ((ExpertShard.GATE, slice(0, i)), (ExpertShard.UP, slice(i, 2 * i))):
            q, s, o, w = _random_int4(i, h, g, gen)
            Int4Experts.load_canonical(layer, x, shard, q, s, o)
            dense13[x, rows] = w
        q, s, o, w = _random_int4(h, i, g, gen)
        Int4Experts.load_canonical(layer, x, ExpertShard.DOWN, q, s, o)
        dense2[x] = w
    layer.process_weights_after_loading()
    x = torch.randn(5, h, generator=gen)
    logits = torch.randn(5, e, generator=gen)
    tw, ti = select_experts(logits, 2, True)
    ref = moe_ref(x, tw, ti, lambda n: (dense13[n], dense2[n]), MoEActivation.SILU)
    torch.testing.assert_close(layer(x, logits), ref, atol=1e-5, rtol=1e-5)


def test_int4_experts_refuse_a_shard_off_a_group_boundary() -> None:
    with pytest.raises(ValueError, match="expert intermediate size per rank \\(48\\).*multiple of 32"):
        FusedMoE(2, 1, 64, 48, renormalize=True, method=Int4Experts(32))
