"""NVFP4 experts (ModelOpt and compressed-tensors `nvfp4-pack-quantized` MoE releases), kept at 4.5 bits in
memory on every device: per expert and projection the codes (uint8 [out, in / 2]), the e4m3 scales
(uint8-sized [out, in / 16]) and the global scale, kept per output row as the dense layers keep it
(layers/quant/nvfp4.py: gate and up have a global scale each). The torch reference dequantises only the experts
a forward routes to; on CUDA with Triton the grouped fused-MoE kernel decodes the codes and scales tile by tile
(kernels/fused_moe_quant.py fused_moe_nvfp4, weight-only: activations stay 16-bit); on a CPU (experts in host
RAM, or a CPU-only machine) the CPU kernel multiplies them as loaded (layers/experts/nvfp4_cpu.py,
kernels/cpu_nvfp4.c), the reference staying the --exact-cpu path."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from agentbox.kernels.nvfp4_codes import GROUP, dequantize_nvfp4
from agentbox.layers.experts import nvfp4_cpu
from agentbox.layers.experts.base import (
    ExpertLayer,
    ExpertMethod,
    ExpertShard,
    add_sharded_param,
    check_dims,
    expert_activation,
    moe_ref,
)
from agentbox.layers.quant.base import QuantConfig, Sharding
from agentbox.layers.quant.nvfp4 import NAMES, global_multiplier
from agentbox.layers.weight_loading import set_weight_loader


def kernel_runs(x: torch.Tensor) -> bool:
    """Whether the fused NVFP4 kernel takes this forward (CUDA and Triton; a test forces it on CPU)."""
    if not x.is_cuda:
        return False
    from agentbox.kernels.fused_moe import triton_available

    return triton_available()


class NvFp4Experts(ExpertMethod):
    def __init__(self, config: QuantConfig) -> None:
        self.layout = config.nvfp4_layout
        self.input_scales = config.input_scales
        self.names = NAMES[self.layout]

    def create_weights(self, layer: ExpertLayer) -> None:
        check_dims(layer, GROUP, "NVFP4")
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_local
        n, u8, f8 = self.names, torch.uint8, torch.float8_e4m3fn
        for w, rows, cols in (("w13", layer.w13_rows, h), ("w2", h, i)):
            add_sharded_param(layer, f"{w}_{n['codes']}", torch.empty(e, rows, cols // 2, dtype=u8), Sharding(0, 1, 1, 2))
            add_sharded_param(layer, f"{w}_{n['scale']}", torch.empty(e, rows, cols // GROUP, dtype=f8), Sharding(0, 1, 1, GROUP))
            layer.add_expert_param(f"{w}_{n['global']}", torch.zeros(e, rows))
            set_weight_loader(getattr(layer, f"{w}_{n['global']}"), partial(self.load_global, layer))
            if self.input_scales:  # read (the checkpoint has them), not used: the experts run weight-only
                layer.add_expert_param(f"{w}_{n['input']}", torch.zeros(e))
                set_weight_loader(getattr(layer, f"{w}_{n['input']}"), partial(self.load_input, layer))

    def load_global(self, layer: ExpertLayer, param: nn.Parameter, loaded: Any, expert_id: int, shard: ExpertShard) -> None:
        what = f"{layer.prefix or 'experts'}.{expert_id}.{shard.value} global scale"
        i = layer.intermediate_local
        up = i if layer.activation.gated else 0  # un-gated: w13 is the up rows alone
        rows = {ExpertShard.GATE: (0, i), ExpertShard.UP: (up, i), ExpertShard.DOWN: (0, param.shape[1])}.get(shard)
        if rows is None:
            raise ValueError(f"{what}: {shard.value} experts are not supported in NVFP4")
        param.data[expert_id].narrow(0, *rows).fill_(global_multiplier(loaded, self.layout, what))

    def load_input(self, layer: ExpertLayer, param: nn.Parameter, loaded: Any, expert_id: int, shard: ExpertShard) -> None:
        v = global_multiplier(loaded, self.layout, f"{layer.prefix or 'experts'}.{expert_id}.{shard.value} input scale")
        param.data[expert_id] = max(float(param.data[expert_id]), v)

    def weights(self, layer: ExpertLayer, w: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        n = self.names
        codes, scale, gs = (getattr(layer, f"{w}_{n[r]}")[e] for r in ("codes", "scale", "global"))
        return dequantize_nvfp4(codes, scale, gs).to(dtype)

    def projection(self, layer: ExpertLayer, w: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(getattr(layer, f"{w}_{self.names[r]}") for r in ("codes", "scale", "global"))  # type: ignore[return-value]

    def apply(self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        b13, b2 = layer.w13_bias, layer.w2_bias if layer.tp_rank == 0 else None
        if kernel_runs(x):
            from agentbox.kernels.fused_moe_quant import fused_moe_nvfp4

            return fused_moe_nvfp4(x, self.projection(layer, "w13"), self.projection(layer, "w2"), topk_weights,
                                   topk_ids, expert_activation(layer), b13, b2)
        if nvfp4_cpu.runs(layer, x):
            return nvfp4_cpu.apply(layer, x, topk_weights, topk_ids)

        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            return self.weights(layer, "w13", e, x.dtype), self.weights(layer, "w2", e, x.dtype)

        return moe_ref(x, topk_weights, topk_ids, expert, layer.activation, b13, b2, layer.swiglu_alpha, layer.swiglu_limit)
