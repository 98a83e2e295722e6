"""NVFP4 experts on a CPU (experts in host RAM beside a GPU, `serve --cpu-moe`, or a CPU-only machine) through
kernels/cpu_nvfp4: each routed expert's projections multiplied at 4.5 bits as loaded, over the tokens routed to
it. Nothing is repacked (the kernel reads the checkpoint's codes, e4m3 scales and per-row globals), so this is a
choice per forward, not a load step: the reference (layers/experts/nvfp4.py) dequantised every routed expert
each step, and stays the path under --exact-cpu (int4.default_cpu_kernel not CPU_SIMD) and where the kernel
does not build.

Like the other CPU experts (layers/experts/cpu.py) a step with many tokens for one expert (prefill beyond the
kernel's row limit) dequantises that expert once and runs one sgemm on the same int8-rounded activations, the
same numbers; `_linear_ref` (that path for every call) is the twin the tests compare with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentbox.kernels import cpu_nvfp4
from agentbox.kernels.nvfp4_codes import dequantize_nvfp4
from agentbox.layers.experts.base import ExpertLayer
from agentbox.layers.experts.cpu import Linear, run_routed
from agentbox.layers.quant import int4


def runs(layer: ExpertLayer, x: torch.Tensor) -> bool:
    """Whether this forward takes the kernel: on a CPU where it builds, not under --exact-cpu, every
    projection's inputs (hidden, this rank's intermediate) in whole blocks of 32."""
    return (x.device.type == "cpu" and int4.default_cpu_kernel() is int4.Int4Kernel.CPU_SIMD
            and cpu_nvfp4.supports(layer.hidden_size) and cpu_nvfp4.supports(layer.intermediate_local)
            and cpu_nvfp4.available())


def _projection(layer: ExpertLayer, w: str, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes, scale, gs = layer.method.projection(layer, w)  # type: ignore[attr-defined]  # NvFp4Experts
    return codes[e], scale[e], gs[e]


def _linear(x: torch.Tensor, layer: ExpertLayer, w: str, e: int) -> torch.Tensor:
    if x.shape[0] <= int4.CPU_SIMD_MAX_ROWS:
        return cpu_nvfp4.nvfp4_matmul(x, *_projection(layer, w, e))
    return _linear_ref(x, layer, w, e)


def _linear_ref(x: torch.Tensor, layer: ExpertLayer, w: str, e: int) -> torch.Tensor:
    return F.linear(cpu_nvfp4.round_activations(x), dequantize_nvfp4(*_projection(layer, w, e)))


def apply(layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
          linear: Linear = _linear) -> torch.Tensor:
    """The routed experts' output (x's dtype); `linear=_linear_ref` is the twin."""
    return run_routed(layer, x, topk_weights, topk_ids, linear)
