"""The expert-method interface and its registry, with what every expert format shares.

A FusedMoE layer (layers/experts/layer.py) owns no weight layout of its own: its `ExpertMethod` creates the
expert parameters, loads checkpoint tensors into them (this rank's TP shard of every expert), converts them
once after loading, and runs the routed experts. The checkpoint chooses the method: each format's file holds
one method, `layers/experts/__init__.py` registers them (`register_expert_method`), and the layer asks for
the one the current QuantConfig names (`expert_method`), as the linear layers do with layers/quant/.

Quantised layouts share one loader: every expert parameter records where the logical [out, in] dims sit in
its per-expert layout (`Sharding`), so `load_expert_shard` narrows every layout to this rank's shard.

Gated and un-gated experts are one layout: w13 holds the gate rows, then the up rows, of a gated activation and
only the up rows of an un-gated one (Nemotron-H's relu^2: `MoEActivation.gated`); every method sizes w13 by
`ExpertLayer.w13_rows` and the activation takes w13's output as it is, so each format runs both.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from enum import Enum
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from agentbox.layers.quant import base as quant_base
from agentbox.layers.quant.base import QuantConfig, Sharding
from agentbox.layers.quant.cpu_parts import CpuPart
from agentbox.layers.quant.formats import QuantMethod
from agentbox.layers.quant.lazy import materialize
from agentbox.layers.weight_loading import set_weight_loader


class ExpertShard(Enum):
    GATE = "gate"  # rows [0, I) of the fused gate_up weight
    UP = "up"  # rows [I, 2I)
    GATE_UP_INTERLEAVED = "gate_up_interleaved"  # gpt-oss: rows alternate gate, up, gate, up, ...
    GATE_UP = "gate_up"  # Gemma 4: one stacked tensor, gate rows first, then up
    DOWN = "down"  # down projection: the intermediate dimension is dim 1 (bias: replicated)


class MoEActivation(Enum):
    SILU = "silu"  # silu(gate) * up
    SWIGLU_OAI = "swiglu_oai"  # gpt-oss: clamped gate * sigmoid(alpha * gate) * (clamped up + 1)
    GELU_TANH = "gelu_tanh"  # Gemma 4: gelu(gate, tanh approximation) * up
    SILU_CLAMPED = "silu_clamped"  # DeepSeek-V4: silu(gate clamped above at the limit) * (up clamped to +-limit)
    RELU2 = "relu2"  # Nemotron-H: relu(up)^2, no gate projection

    @property
    def gated(self) -> bool:
        """Whether w13 holds a gate projection beside the up projection (its output is [N, 2I], else [N, I])."""
        return self is not MoEActivation.RELU2


def activate(gate_up: torch.Tensor, activation: MoEActivation, alpha: float, limit: float) -> torch.Tensor:
    """[N, 2I] (gate rows first, then up) -> [N, I]; un-gated: [N, I] -> [N, I]."""
    if activation is MoEActivation.RELU2:
        return torch.square(F.relu(gate_up))
    gate, up = gate_up.chunk(2, dim=-1)
    if activation is MoEActivation.SILU:
        return F.silu(gate) * up
    if activation is MoEActivation.GELU_TANH:
        return F.gelu(gate, approximate="tanh") * up
    if activation is MoEActivation.SILU_CLAMPED:
        return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
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


class ExpertLayer(nn.Module, ABC):
    """A MoE layer as its expert method sees it (layers/experts/layer.py FusedMoE is the one there is): the
    experts' sizes on this rank and their activation, and where the method registers what it stores. Declared
    here, apart from the layer, so the methods need not import it."""

    num_experts: int
    hidden_size: int
    intermediate_local: int  # this rank's share of each expert's intermediate size
    tp_rank: int
    tp_size: int
    activation: MoEActivation
    swiglu_alpha: float
    swiglu_limit: float
    prefix: str
    method: ExpertMethod
    w13_bias: nn.Parameter | None
    w2_bias: nn.Parameter | None

    @property
    def w13_rows(self) -> int:
        """Rows of each expert's w13 on this rank: gate and up of a gated activation, up alone of an un-gated one."""
        return (2 if self.activation.gated else 1) * self.intermediate_local

    @abstractmethod
    def add_expert_param(self, name: str, data: torch.Tensor) -> None:
        """Register `data` [E, ...] as the parameter `name`, loaded one expert's tensor at a time."""

    @abstractmethod
    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int, shard: ExpertShard) -> None:
        """The loader `add_expert_param` gives a parameter: this rank's slice of one expert's [out, in, ...] tensor
        (a method whose checkpoint differs only by a view hands it the viewed tensor)."""


class ExpertMethod(ABC):
    """How a FusedMoE layer stores its experts' weights and runs them (one per weight format)."""

    @abstractmethod
    def create_weights(self, layer: ExpertLayer) -> None:
        """Register the layer's expert parameters (sharded shapes); each gets `weight_loader`."""

    def process_weights_after_loading(self, layer: ExpertLayer) -> None:  # noqa: B027 - optional hook
        """Once after every weight is loaded (repacking for a kernel)."""

    @abstractmethod
    def apply(self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial output [T, H] (bias of the down projection included on rank 0 only)."""

    def cpu_parts(self, layer: ExpertLayer) -> tuple[CpuPart, CpuPart] | None:
        """Every expert's (w13, w2) as the CPU SIMD kernels hold them, stacked [E, ...] (a fused decode runs them
        from C: engine/exec/cpu_decode.py), or None where this format is not held so."""
        return None


def add_sharded_param(layer: ExpertLayer, name: str, data: torch.Tensor, sharding: Sharding) -> nn.Parameter:
    """An expert parameter [E, ...] whose per-expert layout keeps the logical out/in dims where `sharding`
    says; its weight_loader takes one expert's full checkpoint tensor and copies this rank's shard."""
    layer.add_expert_param(name, data)
    param: nn.Parameter = getattr(layer, name)
    param.sharding = sharding  # type: ignore[attr-defined]
    set_weight_loader(param, partial(load_expert_shard, layer, name))
    return param


def load_expert_shard(
    layer: ExpertLayer, name: str, param: nn.Parameter, loaded: Any, expert_id: int, shard: ExpertShard
) -> None:
    """Gate/up: this rank's rows of the output dim, into the gate or up half of w13 (un-gated: up is all of
    w13). Down: this rank's
    columns of the input dim. A parameter without an output axis (GPTQ g_idx of w13) is written whole by
    gate and by up, which must agree. A shard off a pack/group boundary is refused, naming the tensor."""
    if not 0 <= expert_id < layer.num_experts:
        raise ValueError(f"{name}: expert id {expert_id} out of range (the layer has {layer.num_experts})")
    sh: Sharding = param.sharding  # type: ignore[attr-defined]
    what = f"{layer.prefix or 'experts'}.{expert_id}.{shard.value} -> {name}"
    dst, src, i, r = param.data[expert_id], loaded, layer.intermediate_local, layer.tp_rank
    if shard is ExpertShard.DOWN:
        if sh.in_axis is not None:
            src = quant_base.narrow_shard(src, sh.in_axis, r * i, i, sh.in_pack, what)
    elif shard is ExpertShard.GATE and not layer.activation.gated:
        raise ValueError(f"{what}: the layer's {layer.activation.value} experts have no gate projection")
    elif shard in (ExpertShard.GATE, ExpertShard.UP):
        if sh.out_axis is not None:
            start = i if shard is ExpertShard.UP and layer.activation.gated else 0
            dst = quant_base.narrow_shard(dst, sh.out_axis, start, i, sh.out_pack, what)
            src = quant_base.narrow_shard(src, sh.out_axis, r * i, i, sh.out_pack, what)
        else:  # one tensor for gate and up (they read one input): whichever comes second must agree
            written: set[int] = param.__dict__.setdefault("written_experts", set())
            src = materialize(src)
            if expert_id in written and dst.shape == src.shape and not torch.equal(dst, src.to(dst.dtype)):
                raise ValueError(f"{what}: differs from the other of gate/up (they share one input)")
            written.add(expert_id)
    else:
        raise ValueError(f"{what}: {shard.value} experts are not supported in a quantised layout")
    if dst.shape != src.shape:
        raise ValueError(f"{what}: shard shape {tuple(src.shape)} != {tuple(dst.shape)}")
    dst.copy_(materialize(src))


def fused_kernel(name: str) -> Callable[..., torch.Tensor] | None:
    """A fused-MoE Triton kernel over quantised experts (kernels/fused_moe_quant.py: `fused_moe_int4`,
    `fused_moe_fp8`), None where Triton or that file is absent: then the torch reference runs."""
    from agentbox.kernels.fused_moe import triton_available

    if not triton_available():
        return None
    try:
        module = importlib.import_module("agentbox.kernels.fused_moe_quant")
    except ImportError:  # another engineer's file, merged by the lead
        return None
    return getattr(module, name, None)


def check_dims(layer: ExpertLayer, unit: int, what: str) -> None:
    for dim, n in (("hidden size", layer.hidden_size), ("expert intermediate size per rank", layer.intermediate_local)):
        if n % unit:
            raise ValueError(
                f"{layer.prefix or 'FusedMoE'}: {what} experts need the {dim} ({n}) to be a multiple of {unit}"
                + (" (the tensor-parallel shard must fall on a group/block boundary)" if "rank" in dim else "")
            )


def expert_activation(layer: ExpertLayer) -> Callable[[torch.Tensor], torch.Tensor]:
    """The layer's activation as the fused kernels take it: [N, 2I] (un-gated: [N, I]) -> [N, I]."""
    return lambda gate_up: activate(gate_up, layer.activation, layer.swiglu_alpha, layer.swiglu_limit)


# The expert method of each checkpoint format, filled by layers/experts/__init__.py.
_EXPERT_METHODS: dict[QuantMethod, Callable[[QuantConfig], ExpertMethod]] = {}


def register_expert_method(kind: QuantMethod, factory: Callable[[QuantConfig], ExpertMethod]) -> None:
    _EXPERT_METHODS[kind] = factory


def registered_expert_methods() -> frozenset[QuantMethod]:
    return frozenset(_EXPERT_METHODS)


def expert_method(prefix: str = "") -> ExpertMethod:
    """The experts' method from the QuantConfig the linear methods use (skip_modules respected)."""
    config = quant_base.current_config()
    if config.method is not QuantMethod.UNQUANTIZED and quant_base.module_skipped(prefix, config.skip_modules):
        quant_base.log.info("%s: experts left unquantised by the %s checkpoint", prefix, config.method.value)
        config = QuantConfig()
    kind = config.experts or config.method  # DeepSeek-V4's release: FP8 linears, MXFP4 experts
    factory = _EXPERT_METHODS.get(kind)
    if factory is None:
        raise ValueError(f"MoE experts in {kind.value} are not supported")
    return factory(config)
