"""The gated delta rule on the CPU: kernels/cpu_hybrid.c's `ab_delta_rule` runs layers/delta_rule.py's recurrent
form token by token for every (sequence, head) pair, the way the fused decode does, so a prompt prefilled here and
then decoded gives the state a token-by-token decode would. `delta_rule.recurrent` and `delta_rule.chunked` are its
twins (fp32 both; they differ from it in the order of sums)."""

from __future__ import annotations

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
