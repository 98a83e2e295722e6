"""Who computes the gated delta rule (layers/delta_rule.py has the maths and the torch reference): a small
registry, chosen per device the first time a Gated DeltaNet layer runs there.

- `torch`: delta_rule.chunked / delta_rule.recurrent. Everywhere; the reference the others are compared with.
- `cpu`: kernels/cpu_delta_rule.py, the recurrent form in C for prefill chunks and decode alike (the fused decode's
  own step). Chosen on the CPU where the C kernels build: there torch's chunked form spends its time on small
  matmuls and large temporaries (a 2,048-token prompt of 8 heads of 64 x 64: ~90 ms a layer), the C loop a few.
- `fla`: flash-linear-attention's Triton kernels (PyPI `fla-core`, the library vLLM and SGLang build on for
  these layers): `chunk_gated_delta_rule` for prefill chunks, `fused_recurrent_gated_delta_rule` for decode.
  Chosen on CUDA where `fla` imports; never on CPU (its kernels are Triton's, and its autotuner needs a GPU
  even under TRITON_INTERPRET). Its state layout is ours ([H, Dk, Dv] per sequence, fp32), so a state saved by
  one backend resumes under the other. Install: `pip install 'agentbox[gpu]'` (scripts/gpu_check.sh unpacks the
  wheel kept in scripts/wheels on a machine without network).

Both take what delta_rule's functions take (q and k already l2-normalised and scaled, so fla runs with scale 1
and without its own normalisation) and return (out, final state) in our layout.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from enum import Enum
from typing import Protocol

import torch

from agentbox.layers import delta_rule

log = logging.getLogger(__name__)


class DeltaRuleBackendName(Enum):
    TORCH = "torch"
    CPU = "cpu"
    FLA = "fla"


class DeltaRuleBackend(Protocol):
    name: DeltaRuleBackendName

    def chunked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def recurrent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class TorchDeltaRule:
    name = DeltaRuleBackendName.TORCH

    def chunked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return delta_rule.chunked(q, k, v, g, beta, state)

    def recurrent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return delta_rule.recurrent(q, k, v, g, beta, state)


class CpuDeltaRule:
    """The C recurrent loop for both (tokens in order inside each sequence and head: what decode does)."""

    name = DeltaRuleBackendName.CPU

    def chunked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from agentbox.kernels import cpu_delta_rule

        if not cpu_delta_rule.supported(q, g, v):
            return delta_rule.chunked(q, k, v, g, beta, state)
        return cpu_delta_rule.delta_rule(q, k, v, g, beta, state)

    def recurrent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from agentbox.kernels import cpu_delta_rule

        if not cpu_delta_rule.supported(q, g, v):
            return delta_rule.recurrent(q, k, v, g, beta, state)
        return cpu_delta_rule.delta_rule(q, k, v, g, beta, state)


class FlaDeltaRule:
    """flash-linear-attention's kernels over our layouts (tokens-then-heads is theirs, heads-first ours)."""

    name = DeltaRuleBackendName.FLA

    def __init__(self) -> None:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

        self._chunk = chunk_gated_delta_rule
        self._recurrent = fused_recurrent_gated_delta_rule

    def chunked(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence: q, k [H, L, Dk]; v [H, L, Dv]; g, beta [H, L]; state [H, Dk, Dv]."""
        seq = [x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v, g, beta)]  # [1, L, H, ...]
        out, final = self._chunk(*seq, scale=1.0, initial_state=state.float().unsqueeze(0).contiguous(),
                                 output_final_state=True)
        return out[0].transpose(0, 1), final[0]

    def recurrent(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch: q, k [B, H, L, Dk]; v [B, H, L, Dv]; g, beta [B, H, L]; state [B, H, Dk, Dv]."""
        seq = [x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta)]  # [B, L, H, ...]
        out, final = self._recurrent(*seq, scale=1.0, initial_state=state.float().contiguous(),
                                     output_final_state=True)
        return out.transpose(1, 2), final


def fla_unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"its kernels need CUDA (device {device.type})"
    if importlib.util.find_spec("fla") is None:
        return "not installed (pip install 'agentbox[gpu]')"
    return None


@functools.cache
def delta_rule_for(device: torch.device) -> DeltaRuleBackend:
    """The backend Gated DeltaNet layers on `device` use: fla where it can run, the C loop on the CPU, else torch
    (logged once)."""
    if device.type == "cpu":
        from agentbox.kernels import cpu_gemv

        if cpu_gemv.available():
            log.info("gated delta rule on cpu: the C recurrent loop (kernels/cpu_delta_rule.py)")
            return CpuDeltaRule()
    reason = fla_unavailable_reason(device)
    if reason is None:
        try:
            backend: DeltaRuleBackend = FlaDeltaRule()
        except Exception as e:  # an fla that imports badly (its Triton too old): the torch path still serves
            reason = f"import failed: {e}"
        else:
            log.info("gated delta rule on %s: flash-linear-attention", device)
            return backend
    log.info("gated delta rule on %s: torch (fla: %s)", device, reason)
    return TorchDeltaRule()
