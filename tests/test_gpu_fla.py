"""flash-linear-attention as the gated delta rule's backend (layers/delta_rule_backends.py): on CUDA, where `fla`
imports, its chunked and fused-recurrent kernels against our torch reference at tiny shapes, each resumed from
a state the other left (the layouts are shared, so snapshots move between them). Skipped without CUDA or fla:
its autotuner needs a GPU even under TRITON_INTERPRET. On any machine: the CPU gets the C loop where the kernels
build (tests/test_cpu_delta_rule.py), else torch."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from agentbox.layers import delta_rule
from agentbox.layers.delta_rule_backends import DeltaRuleBackendName, FlaDeltaRule, delta_rule_for


def test_cpu_never_gets_fla() -> None:
    from agentbox.kernels import cpu_gemv

    expected = DeltaRuleBackendName.CPU if cpu_gemv.available() else DeltaRuleBackendName.TORCH
    assert delta_rule_for(torch.device("cpu")).name is expected


def _inputs(b: int, h: int, length: int, dk: int, dv: int, device: str) -> tuple[torch.Tensor, ...]:
    torch.manual_seed(0)
    q, k = delta_rule.prepare_qk(torch.randn(b, h, length, dk), torch.randn(b, h, length, dk))
    v = torch.randn(b, h, length, dv)
    g = -torch.rand(b, h, length) * 0.2  # decays of 0.82 to 1 a token
    beta = torch.rand(b, h, length)
    state = 0.1 * torch.randn(b, h, dk, dv)
    return tuple(x.to(device) for x in (q, k, v, g, beta, state))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="needs flash-linear-attention (agentbox[gpu])")
def test_fla_matches_the_torch_reference() -> None:
    assert delta_rule_for(torch.device("cuda")).name is DeltaRuleBackendName.FLA
    fla = FlaDeltaRule()
    q, k, v, g, beta, state = _inputs(3, 4, 100, 32, 32, "cuda")  # 100 tokens: a chunk and a partial one
    for i in range(3):  # prefill, one sequence at a time
        got, got_state = fla.chunked(q[i], k[i], v[i], g[i], beta[i], state[i])
        ref, ref_state = delta_rule.chunked(q[i], k[i], v[i], g[i], beta[i], state[i])
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(got_state, ref_state, atol=2e-3, rtol=2e-3)
    # decode: a batch, one token each, from the state the torch prefill left
    _, ref_state = delta_rule.recurrent(q[:, :, :90], k[:, :, :90], v[:, :, :90], g[:, :, :90], beta[:, :, :90], state)
    step = (q[:, :, 90:91], k[:, :, 90:91], v[:, :, 90:91], g[:, :, 90:91], beta[:, :, 90:91])
    got, got_state = fla.recurrent(*step, ref_state)
    ref, ref_next = delta_rule.recurrent(*step, ref_state)
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got_state, ref_next, atol=2e-3, rtol=2e-3)
