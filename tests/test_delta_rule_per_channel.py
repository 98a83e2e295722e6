"""The gated delta rule with a decay per key channel (KDA, layers/delta_rule.py): the chunked form equals the
token-by-token recurrence, from any state and split anywhere, and with the same decay on every channel it is the
scalar-decay rule Gated DeltaNet runs."""

from __future__ import annotations

import torch

from agentbox.layers import delta_rule


def _inputs(h: int = 3, length: int = 150, dk: int = 8, dv: int = 5) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q, k = delta_rule.prepare_qk(torch.randn(h, length, dk, generator=g), torch.randn(h, length, dk, generator=g))
    v = torch.randn(h, length, dv, generator=g)
    decay = -5 * torch.rand(h, length, dk, generator=g)  # KDA's safe gate: (-5, 0)
    return q, k, v, decay, torch.rand(h, length, generator=g), torch.randn(h, dk, dv, generator=g)


def test_chunked_equals_the_recurrence_split_anywhere() -> None:
    q, k, v, g, beta, state = _inputs()
    want, want_state = delta_rule.recurrent(q[None], k[None], v[None], g[None], beta[None], state[None])
    out, final = delta_rule.chunked_per_channel(q, k, v, g, beta, state)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_state[0], atol=1e-5, rtol=1e-5)
    a, mid = delta_rule.chunked_per_channel(q[:, :37], k[:, :37], v[:, :37], g[:, :37], beta[:, :37], state)
    b, end = delta_rule.chunked_per_channel(q[:, 37:], k[:, 37:], v[:, 37:], g[:, 37:], beta[:, 37:], mid)
    torch.testing.assert_close(torch.cat([a, b], dim=1), want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(end, want_state[0], atol=1e-5, rtol=1e-5)


def test_one_decay_for_every_channel_is_gated_deltanet() -> None:
    q, k, v, g, beta, state = _inputs()
    scalar = g[..., 0]
    out, final = delta_rule.chunked_per_channel(q, k, v, scalar[..., None].expand_as(g), beta, state)
    want, want_state = delta_rule.chunked(q, k, v, scalar, beta, state)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, want_state, atol=1e-5, rtol=1e-5)
    # and the decay per channel matters: other channels' decays give other outputs
    other, _ = delta_rule.chunked_per_channel(q, k, v, g, beta, state)
    assert (other - want).abs().max() > 1e-2
