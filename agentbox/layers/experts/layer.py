"""Mixture of experts: top-k routing over E experts, each a gated MLP, sharded over TP ranks like the dense MLP.

Every rank holds every expert, but only its slice of each expert's intermediate dimension: gate/up rows
[rank*I/tp, (rank+1)*I/tp) and the matching down columns. Each rank computes a partial sum of every token's
output and one all-reduce adds them, exactly as MergedColumnParallelLinear + RowParallelLinear do for a dense
MLP. On one or two PCIe GPUs that beats expert parallelism (no all-to-all, balanced by construction).

The weights' storage is a method (`ExpertMethod`, layers/experts/base.py: one file per format, chosen from the
checkpoint's QuantConfig); the layer only routes. Weights load per expert: `weight_loader(param, tensor,
expert_id, shard)` with `tensor` one expert's full (unsharded) checkpoint tensor (here in [out, in] order;
bias: [out]). Repacking the experts for the CPU kernels is a step of the model loader (layers/experts/cpu.py).

The experts may live in host RAM while the rest of the model runs on a GPU (layers/experts/placement.py: the
loader's placement decides per layer): then `forward_routed` takes the hidden state to the host, runs the
experts there and brings their output back before the all-reduce.
"""

from __future__ import annotations

import torch
from torch import nn

from agentbox.layers.experts.base import ExpertLayer, ExpertMethod, ExpertShard, MoEActivation, expert_method
from agentbox.layers.experts.placement import ExpertClock, ExpertHome, building_on, current_placement, timed
from agentbox.layers.experts.routing import select_experts
from agentbox.layers.experts.unquantized import UnquantizedExperts
from agentbox.layers.weight_loading import ConvertsAfterLoading, set_weight_loader
from agentbox.parallel.state import all_reduce, tp_rank, tp_size


class FusedMoE(ExpertLayer, ConvertsAfterLoading):
    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        renormalize: bool,
        activation: MoEActivation = MoEActivation.SILU,
        bias: bool = False,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        method: ExpertMethod | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank(), tp_size()
        if intermediate_size % self.tp_size:
            raise ValueError(
                f"expert intermediate size ({intermediate_size}) is not divisible by the tensor-parallel size ({self.tp_size})"
            )
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size = hidden_size
        self.intermediate_local = intermediate_size // self.tp_size
        self.renormalize = renormalize
        self.activation = activation
        self.swiglu_alpha, self.swiglu_limit = swiglu_alpha, swiglu_limit
        if method is None:  # the checkpoint's format, from the same QuantConfig the linear layers read
            method = expert_method(prefix)
        self.prefix = prefix
        self.method = method
        placement = current_placement()
        self.home = placement.take() if placement is not None else ExpertHome.DEVICE
        self.clock: ExpertClock | None = placement.clock if placement is not None else None
        # Quantised experts in host RAM keep float32 scales (the CPU kernels'); unquantised ones the model's dtype.
        self.host_dtype = torch.get_default_dtype() if isinstance(method, UnquantizedExperts) else torch.float32
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        with building_on(self.home, self.host_dtype):
            self.method.create_weights(self)
            if bias:
                self.add_expert_param("w13_bias", torch.empty(num_experts, self.w13_rows))
                self.add_expert_param("w2_bias", torch.empty(num_experts, hidden_size))

    def add_expert_param(self, name: str, data: torch.Tensor) -> None:
        param = nn.Parameter(data, requires_grad=False)
        set_weight_loader(param, self.weight_loader)
        setattr(self, name, param)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard: ExpertShard) -> None:
        """Copy this rank's slice of one expert's tensor. Gate/up split their rows (dim 0), down its dim 1;
        a 1-D down bias is replicated. Works for any storage whose dims follow [out, in, ...] (MXFP4 blocks).
        Un-gated experts (relu^2) have only up, which fills w13."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} out of range (the layer has {self.num_experts})")
        dst = param.data[expert_id]
        r = self.tp_rank
        if shard is ExpertShard.DOWN:
            if loaded.dim() == 1:
                return _copy(dst, loaded, "down bias")
            size = dst.size(1)
            return _copy(dst, loaded.narrow(1, r * size, size), "down")
        if not self.activation.gated:
            if shard is not ExpertShard.UP:
                raise ValueError(f"FusedMoE: {self.activation.value} experts have no gate projection ({shard.value})")
            return _copy(dst, loaded.narrow(0, r * dst.size(0), dst.size(0)), shard.value)
        half = dst.size(0) // 2
        if shard is ExpertShard.GATE_UP_INTERLEAVED:
            parts = [(dst[:half], loaded[0::2]), (dst[half:], loaded[1::2])]
        elif shard is ExpertShard.GATE_UP:
            whole = loaded.size(0) // 2
            parts = [(dst[:half], loaded[:whole]), (dst[half:], loaded[whole:])]
        elif shard is ExpertShard.GATE:
            parts = [(dst[:half], loaded)]
        elif shard is ExpertShard.UP:
            parts = [(dst[half:], loaded)]
        else:
            raise ValueError(f"unknown expert shard {shard!r}")
        for d, src in parts:
            _copy(d, src.narrow(0, r * half, half), shard.value)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; router_logits: [T, E] (replicated on every rank). Returns [T, H], all-reduced."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.forward_routed(x, topk_weights, topk_ids)

    def forward_routed(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H] with the routing already chosen by the model's own router (GLM's grouped top-k, Gemma 4's
        per-expert scales): topk_weights [T, k] float32, topk_ids [T, k] int64. Returns [T, H], all-reduced."""
        if self.home is ExpertHome.HOST:
            return all_reduce(self._on_host(x, topk_weights, topk_ids))
        return all_reduce(self.method.apply(self, x, topk_weights, topk_ids))

    def _on_host(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The experts in host RAM: the hidden state crosses once each way (a no-op on a CPU-only machine); the
        clock counts the host's compute alone (the copy in waits for the device to produce x)."""
        xh = x.to("cpu", self.host_dtype)
        wh, ih = topk_weights.to("cpu"), topk_ids.to("cpu")
        assert self.clock is not None  # a host layer was built under a placement
        with timed(self.clock):
            out = self.method.apply(self, xh, wh, ih)
        return out.to(x.device, x.dtype)


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"FusedMoE: {what} shard shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(src)
