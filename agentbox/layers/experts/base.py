"""Mixture of experts: top-k routing over E experts, each a gated MLP, sharded over TP ranks like the dense MLP.

Every rank holds every expert, but only its slice of each expert's intermediate dimension: gate/up rows
[rank*I/tp, (rank+1)*I/tp) and the matching down columns. Each rank computes a partial sum of every token's
output and one all-reduce adds them, exactly as MergedColumnParallelLinear + RowParallelLinear do for a dense
MLP. On one or two PCIe GPUs that beats expert parallelism (no all-to-all, balanced by construction).

The weights' storage is a method (`ExpertMethod`: unquantised here, MXFP4 in layers/experts/mxfp4.py, int4 and FP8
in layers/experts/quant.py, AWQ / GPTQ in layers/experts/awq_gptq.py, chosen from the checkpoint's QuantConfig);
the layer only routes. Weights load per expert: `weight_loader(param, tensor, expert_id, shard)` with
`tensor` one expert's full (unsharded) checkpoint tensor (here in [out, in] order; bias: [out]).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.parallel.state import all_reduce, tp_rank, tp_size


class ExpertShard(Enum):
    GATE = "gate"  # rows [0, I) of the fused gate_up weight
    UP = "up"  # rows [I, 2I)
    GATE_UP_INTERLEAVED = "gate_up_interleaved"  # gpt-oss: rows alternate gate, up, gate, up, ...
    DOWN = "down"  # down projection: the intermediate dimension is dim 1 (bias: replicated)


class MoEActivation(Enum):
    SILU = "silu"  # silu(gate) * up
    SWIGLU_OAI = "swiglu_oai"  # gpt-oss: clamped gate * sigmoid(alpha * gate) * (clamped up + 1)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing: (weights [T, k] float32, expert ids [T, k] int64).

    With renormalize the k weights sum to one, which is also gpt-oss's top-k-then-softmax (the same
    numbers: softmax over the top logits = the top softmax probabilities renormalised)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def activate(gate_up: torch.Tensor, activation: MoEActivation, alpha: float, limit: float) -> torch.Tensor:
    """[N, 2I] (gate rows first, then up) -> [N, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation is MoEActivation.SILU:
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def moe_ref(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    activation: MoEActivation,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    alpha: float = 1.702,
    limit: float = 7.0,
) -> torch.Tensor:
    """The reference: for each expert hit, its routed tokens through gate_up, act, down, weighted, summed.

    `expert(e)` returns (w13 [2I, H], w2 [H, I]) in x's dtype; a quantised method dequantises there."""
    out = torch.zeros_like(x)
    for e in torch.unique(topk_ids).tolist():
        token, slot = torch.where(topk_ids == e)
        w13, w2 = expert(e)
        h = F.linear(x[token], w13, None if w13_bias is None else w13_bias[e])
        y = F.linear(activate(h, activation, alpha, limit), w2, None if w2_bias is None else w2_bias[e])
        out.index_add_(0, token, y * topk_weights[token, slot, None].to(x.dtype))
    return out


class ExpertMethod(ABC):
    """How a FusedMoE layer stores its experts' weights and runs them (one per weight format)."""

    @abstractmethod
    def create_weights(self, layer: FusedMoE) -> None:
        """Register the layer's expert parameters (sharded shapes); each gets `weight_loader`."""

    def process_weights_after_loading(self, layer: FusedMoE) -> None:  # noqa: B027 - optional hook
        """Once after every weight is loaded (repacking for a kernel)."""

    @abstractmethod
    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial output [T, H] (bias of the down projection included on rank 0 only)."""


class UnquantizedExperts(ExpertMethod):
    """Experts in the model dtype: w13 [E, 2I/tp, H], w2 [E, H, I/tp]."""

    def create_weights(self, layer: FusedMoE) -> None:
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_local
        layer.add_expert_param("w13_weight", torch.empty(e, 2 * i, h))
        layer.add_expert_param("w2_weight", torch.empty(e, h, i))

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = layer.w13_weight, layer.w2_weight
        b13, b2 = layer.w13_bias, layer.w2_bias if layer.tp_rank == 0 else None

        def act(gate_up: torch.Tensor) -> torch.Tensor:
            return activate(gate_up, layer.activation, layer.swiglu_alpha, layer.swiglu_limit)

        if x.is_cuda:  # the Triton grouped GEMM (kernels/fused_moe.py); its twin is the loop below
            from agentbox.kernels.fused_moe import fused_moe, triton_available

            if triton_available():
                return fused_moe(x, w13, w2, topk_weights, topk_ids, act, b13, b2)
        return moe_ref(
            x, topk_weights, topk_ids, lambda e: (w13[e], w2[e]), layer.activation, b13, b2,
            layer.swiglu_alpha, layer.swiglu_limit,
        )


class FusedMoE(nn.Module):
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
            from agentbox.layers.experts.quant import expert_method  # it builds on this module

            method = expert_method(prefix)
        self.prefix = prefix
        self.method = method
        self.method.create_weights(self)
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if bias:
            self.add_expert_param("w13_bias", torch.empty(num_experts, 2 * self.intermediate_local))
            self.add_expert_param("w2_bias", torch.empty(num_experts, hidden_size))

    def add_expert_param(self, name: str, data: torch.Tensor) -> None:
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        setattr(self, name, param)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard: ExpertShard) -> None:
        """Copy this rank's slice of one expert's tensor. Gate/up split their rows (dim 0), down its dim 1;
        a 1-D down bias is replicated. Works for any storage whose dims follow [out, in, ...] (MXFP4 blocks)."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} out of range (the layer has {self.num_experts})")
        dst = param.data[expert_id]
        r = self.tp_rank
        if shard is ExpertShard.DOWN:
            if loaded.dim() == 1:
                return _copy(dst, loaded, "down bias")
            size = dst.size(1)
            return _copy(dst, loaded.narrow(1, r * size, size), "down")
        half = dst.size(0) // 2
        if shard is ExpertShard.GATE_UP_INTERLEAVED:
            parts = [(dst[:half], loaded[0::2]), (dst[half:], loaded[1::2])]
        elif shard is ExpertShard.GATE:
            parts = [(dst[:half], loaded)]
        elif shard is ExpertShard.UP:
            parts = [(dst[half:], loaded)]
        else:
            raise ValueError(f"unknown expert shard {shard!r}")
        for d, src in parts:
            _copy(d, src.narrow(0, r * half, half), shard.value)

    def process_weights_after_loading(self) -> None:
        from agentbox.layers.experts import cpu as moe_cpu

        self.method.process_weights_after_loading(self)
        moe_cpu.install(self)  # int4 experts on a CPU: repacked for its 4-bit kernel

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; router_logits: [T, E] (replicated on every rank). Returns [T, H], all-reduced."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        return all_reduce(self.method.apply(self, x, topk_weights, topk_ids))


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"FusedMoE: {what} shard shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(src)
