"""The gated delta rule on the CPU: kernels/cpu_hybrid.c's `ab_delta_rule` runs layers/delta_rule.py's recurrent
form token by token for every (sequence, head) pair, the way the fused decode does, so a prompt prefilled here and
then decoded gives the state a token-by-token decode would. `delta_rule.recurrent` and `delta_rule.chunked` are its
twins (fp32 both; they differ from it in the order of sums). `ab_delta_net_chunk` takes a Gated DeltaNet layer's
prefill chunk further, from its in-projections (the conv, the norms, beta and the decay) to its gated norm's input,
in one call (layers/gated_deltanet.py uses it where the CPU backend runs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentbox.kernels import cpu_gemv


def supported(q: torch.Tensor, g: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these: CPU tensors, one decay per head and token (not KDA's per channel), Dv <= 512."""
    return q.device.type == "cpu" and g.dim() == q.dim() - 1 and v.shape[-1] <= 512 and cpu_gemv.available()


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., L, Dk] (prepared), v [..., L, Dv], g, beta [..., L], state [..., Dk, Dv] (any leading shape, the
    same for all) -> (out [..., L, Dv] fp32, final state fp32); `state` is not modified."""
    *lead, length, dk = k.shape
    dv = v.shape[-1]
    q, k, v, g, beta = (x.float().contiguous() for x in (q, k, v, g, beta))
    final = state.float().clone(memory_format=torch.contiguous_format)
    out = torch.empty(*lead, length, dv, dtype=torch.float32)
    pairs = final.numel() // (dk * dv)
    rc = cpu_gemv._lib().ab_delta_rule(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(),
                                       final.data_ptr(), out.data_ptr(), pairs, length, dk, dv, cpu_gemv.threads())
    if rc != 0:
        raise RuntimeError(f"ab_delta_rule failed (code {rc})")
    return out, final


@dataclass(frozen=True)
class MixerChunk:
    """One sequence's prefill chunk of a delta-net layer, from its in-projections to its gated norm's input:
    mixed [L, C] (q | k | v of every head), b, a [L, Hv]; conv_w [C, K]; conv_state [C, K-1] and state [Hv, Dk, Dv],
    the sequence's slots (updated in place); out [L, Hv, Dv] (written)."""

    mixed: torch.Tensor
    b: torch.Tensor
    a: torch.Tensor
    conv_w: torch.Tensor
    conv_state: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    key_heads: int
    state: torch.Tensor
    out: torch.Tensor


def mixer_supported(c: MixerChunk) -> bool:
    """fp32 CPU tensors, the slots and the output contiguous (written in place), a conv of 2-8 taps over a multiple
    of 8 channels, Dv <= 512."""
    tensors = (c.mixed, c.b, c.a, c.conv_w, c.conv_state, c.a_log, c.dt_bias, c.state, c.out)
    return (all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
            and c.conv_state.is_contiguous() and c.state.is_contiguous() and c.out.is_contiguous()
            and 2 <= c.conv_w.shape[1] <= 8 and c.conv_w.shape[0] % 8 == 0 and c.state.shape[-1] <= 512
            and cpu_gemv.available())


def delta_net_chunk(c: MixerChunk) -> None:
    """kernels/cpu_hybrid.c's `ab_delta_net_chunk` (`mixer_supported` holds): the conv and its SiLU, the l2 norms,
    beta and the decay, and the delta rule, as the torch layer computes them (its twin, to the order of sums)."""
    length, channels = c.mixed.shape
    hv, dk, dv = c.state.shape
    mixed, b, a, conv_w, a_log, dt_bias = (t.contiguous() for t in (c.mixed, c.b, c.a, c.conv_w, c.a_log, c.dt_bias))
    rc = cpu_gemv._lib().ab_delta_net_chunk(
        mixed.data_ptr(), b.data_ptr(), a.data_ptr(), length, channels, conv_w.data_ptr(), conv_w.shape[1],
        c.conv_state.data_ptr(), a_log.data_ptr(), dt_bias.data_ptr(), c.key_heads, hv, dk, dv, c.state.data_ptr(),
        c.out.data_ptr(), cpu_gemv.threads())
    if rc != 0:
        raise RuntimeError(f"ab_delta_net_chunk failed (code {rc})")
