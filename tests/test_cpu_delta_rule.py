"""The gated delta rule's CPU backend (kernels/cpu_delta_rule.py, the C recurrent loop) against its torch twins:
the chunked form for a prefill chunk, the recurrent form for a batch; bit for bit across any split of a prompt and
any thread count, which is what lets a prompt prefilled here be decoded by the fused decode's own step."""

from __future__ import annotations

import pytest
import torch

from agentbox.kernels import cpu_delta_rule, cpu_gemv
from agentbox.layers import delta_rule
from agentbox.layers.delta_rule_backends import CpuDeltaRule

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="CPU kernels unavailable")


def _inputs(lead: tuple[int, ...], length: int, dk: int, dv: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k = delta_rule.prepare_qk(torch.randn(*lead, length, dk, generator=gen),
                                 torch.randn(*lead, length, dk, generator=gen))
    v = torch.randn(*lead, length, dv, generator=gen)
    g = -torch.rand(*lead, length, generator=gen) * 0.3
    beta = torch.rand(*lead, length, generator=gen)
    state = 0.1 * torch.randn(*lead, dk, dv, generator=gen)
    return q, k, v, g, beta, state


@pytest.mark.parametrize(("length", "dk", "dv"), [(100, 32, 48), (7, 64, 64), (130, 16, 128)])
def test_chunked_matches_the_torch_chunked_form(length: int, dk: int, dv: int) -> None:
    q, k, v, g, beta, state = _inputs((3,), length, dk, dv)
    before = state.clone()
    out, final = CpuDeltaRule().chunked(q, k, v, g, beta, state)
    ref, ref_final = delta_rule.chunked(q, k, v, g, beta, state)
    assert torch.equal(state, before)  # the caller's state is not written
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(final, ref_final, rtol=1e-4, atol=1e-5)


def test_recurrent_batch_matches_the_torch_recurrent_form() -> None:
    q, k, v, g, beta, state = _inputs((4, 2), 3, 32, 32, seed=1)  # [B, H, L, D]: a verify's few rows a sequence
    out, final = CpuDeltaRule().recurrent(q, k, v, g, beta, state)
    ref, ref_final = delta_rule.recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(final, ref_final, rtol=1e-5, atol=1e-6)


def test_any_split_and_thread_count_gives_the_same_bits() -> None:
    q, k, v, g, beta, state = _inputs((5,), 90, 32, 64, seed=2)
    whole, whole_final = cpu_delta_rule.delta_rule(q, k, v, g, beta, state)
    parts, s = [], state
    for lo, hi in ((0, 37), (37, 38), (38, 90)):  # a chunk, a decode's one token, the rest
        o, s = cpu_delta_rule.delta_rule(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], s)
        parts.append(o)
    assert torch.equal(torch.cat(parts, dim=1), whole) and torch.equal(s, whole_final)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, one_final = cpu_delta_rule.delta_rule(q, k, v, g, beta, state)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, whole) and torch.equal(one_final, whole_final)


def test_per_channel_decay_runs_the_torch_form() -> None:
    q, k, v, _, beta, state = _inputs((2,), 10, 16, 16, seed=3)
    g = -torch.rand(2, 10, 16) * 0.3  # KDA: a decay per key channel, which the C loop does not take
    assert not cpu_delta_rule.supported(q, g, v)
    out, final = CpuDeltaRule().recurrent(q[None], k[None], v[None], g[None], beta[None], state[None])
    ref, ref_final = delta_rule.recurrent(q[None], k[None], v[None], g[None], beta[None], state[None])
    assert torch.equal(out, ref) and torch.equal(final, ref_final)


def _mixer_reference(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_w: torch.Tensor,
                     conv_state: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, hk: int,
                     state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The torch layer's steps (layers/gated_deltanet.py): conv, heads, prepare_qk, beta / decay, chunked rule."""
    hv, dk, dv = state.shape
    x, conv_next = delta_rule.causal_conv(mixed.t(), conv_w, conv_state)
    q, k, v = x.t().split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k = (t.unflatten(-1, (hk, dk)).repeat_interleave(hv // hk, dim=-2) for t in (q, k))
    q, k = delta_rule.prepare_qk(q.transpose(0, 1), k.transpose(0, 1))
    g = -a_log.exp() * torch.nn.functional.softplus(a + dt_bias)
    out, final = delta_rule.chunked(q, k, v.unflatten(-1, (hv, dv)).transpose(0, 1), g.t(), b.sigmoid().t(), state)
    return out.transpose(0, 1), conv_next, final


@pytest.mark.parametrize(("length", "hk", "hv", "kernel"), [(70, 2, 4, 4), (2, 2, 2, 4), (5, 1, 3, 3)])
def test_mixer_chunk_matches_the_torch_layer_steps(length: int, hk: int, hv: int, kernel: int) -> None:
    gen = torch.Generator().manual_seed(length)
    dk, dv = 16, 32
    channels = 2 * hk * dk + hv * dv
    mixed = torch.randn(length, channels, generator=gen)
    b, a = torch.randn(length, hv, generator=gen), torch.randn(length, hv, generator=gen)
    conv_w = 0.5 * torch.randn(channels, kernel, generator=gen)
    conv_state = torch.randn(channels, kernel - 1, generator=gen)  # a sequence that continues (length 2 < K-1 too)
    a_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    state = 0.1 * torch.randn(hv, dk, dv, generator=gen)
    ref_out, ref_conv, ref_state = _mixer_reference(mixed, b, a, conv_w, conv_state, a_log, dt_bias, hk, state)
    chunk = cpu_delta_rule.MixerChunk(mixed, b, a, conv_w, conv_state.clone(), a_log, dt_bias, hk, state.clone(),
                                      torch.empty(length, hv, dv))
    assert cpu_delta_rule.mixer_supported(chunk)
    cpu_delta_rule.delta_net_chunk(chunk)
    torch.testing.assert_close(chunk.out, ref_out, rtol=1e-4, atol=1e-5)
    assert torch.equal(chunk.conv_state, ref_conv)  # the last K-1 inputs, copied
    torch.testing.assert_close(chunk.state, ref_state, rtol=1e-4, atol=1e-5)
