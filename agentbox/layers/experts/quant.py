"""Quantised experts for FusedMoE: the canonical int4 form (AWQ, GPTQ and GGUF 4-bit end in it) and FP8
block-128, each kept quantised in memory; the torch reference dequantises only the experts a forward routes
to, one at a time (moe_ref), so a 30B MoE stays at its file's size on CPU too.

Canonical int4 experts (HELPERS contract 1), per expert e, with K the projection's input and N its output:
- `w13_qweight` int32 [E, H/8, 2I]: codes of w13 transposed ([K, N], gate columns then up), eight K rows per
  word, row k at bits 4 * (k % 8) (`int4.pack_rows_int32`); `w13_scale`, `w13_offset` [E, H/g, 2I] in the
  compute dtype: w[n, k] = q[k, n] * scale[k // g, n] + offset[k // g, n];
- `w2_qweight` int32 [E, I/8, H], `w2_scale`, `w2_offset` [E, I/g, H]; `layer.int4_group` = g;
- GPTQ act-order only: `w13_perm` [E, H], `w2_perm` [E, I] int64: the stored K rows are sorted by group,
  stored row j is checkpoint row perm[j] (so groups are contiguous and the kernels' layout applies).
I is this rank's slice of the intermediate dimension; shards must fall on group (and 8-row) boundaries.

Every quantised expert parameter records where the logical [out, in] dims sit in its per-expert layout (`Sharding`), so
one loader narrows every layout to this rank's shard: gate/up rows, down input columns.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from agentbox.layers.experts.base import (
    ExpertMethod,
    ExpertShard,
    FusedMoE,
    UnquantizedExperts,
    activate,
    moe_ref,
)
from agentbox.layers.quant import base
from agentbox.layers.quant.base import QuantConfig, Sharding
from agentbox.layers.quant.formats import QuantMethod
from agentbox.layers.quant.fp8 import dequantize_block_fp8
from agentbox.layers.quant.lazy import materialize


# Byte-wise twins of int4.pack_rows_int32 / unpack_rows_int32 and of AWQ's unpack + repack (bit-identical, tested):
# on a Qwen3-30B expert layer (50M codes per projection) the word-shifting versions took 6-9 s each on
# this shared CPU, the byte-wise ones 0.7-1.2 s (two codes a byte, one transpose of a word's four bytes).
# (Words are little-endian, as on every CPU torch runs on.)
def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: nibble i of each word (bits 4i..4i+3)."""
    b = packed.contiguous().view(torch.uint8).reshape(*packed.shape, 4)
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(*packed.shape, 8)


def pack_rows_bytes(q: torch.Tensor) -> torch.Tensor:
    """= int4.pack_rows_int32: [K, N] codes -> [K / 8, N] int32, row k at bits 4 * (k % 8)."""
    k, n = q.shape
    q = q.to(torch.uint8).reshape(k // 8, 4, 2, n)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).permute(0, 2, 1).contiguous().view(torch.int32).reshape(k // 8, n)


def unpack_rows_bytes(packed: torch.Tensor) -> torch.Tensor:
    """= int4.unpack_rows_int32: [K / 8, N] int32 -> [K, N] uint8."""
    return _nibbles(packed).permute(0, 2, 1).reshape(-1, packed.shape[1])


def add_sharded_param(layer: FusedMoE, name: str, data: torch.Tensor, sharding: Sharding) -> nn.Parameter:
    """An expert parameter [E, ...] whose per-expert layout keeps the logical out/in dims where `sharding`
    says; its weight_loader takes one expert's full checkpoint tensor and copies this rank's shard."""
    layer.add_expert_param(name, data)
    param: nn.Parameter = getattr(layer, name)
    param.sharding = sharding  # type: ignore[attr-defined]
    param.weight_loader = partial(load_expert_shard, layer, name)  # type: ignore[attr-defined]
    return param


def load_expert_shard(
    layer: FusedMoE, name: str, param: nn.Parameter, loaded: Any, expert_id: int, shard: ExpertShard
) -> None:
    """Gate/up: this rank's rows of the output dim, into the gate or up half of w13. Down: this rank's
    columns of the input dim. A parameter without an output axis (GPTQ g_idx of w13) is written whole by
    gate and by up, which must agree. A shard off a pack/group boundary is refused, naming the tensor."""
    if not 0 <= expert_id < layer.num_experts:
        raise ValueError(f"{name}: expert id {expert_id} out of range (the layer has {layer.num_experts})")
    sh: Sharding = param.sharding  # type: ignore[attr-defined]
    what = f"{layer.prefix or 'experts'}.{expert_id}.{shard.value} -> {name}"
    dst, src, i, r = param.data[expert_id], loaded, layer.intermediate_local, layer.tp_rank
    if shard is ExpertShard.DOWN:
        if sh.in_axis is not None:
            src = base.narrow_shard(src, sh.in_axis, r * i, i, sh.in_pack, what)
    elif shard in (ExpertShard.GATE, ExpertShard.UP):
        if sh.out_axis is not None:
            dst = base.narrow_shard(dst, sh.out_axis, 0 if shard is ExpertShard.GATE else i, i, sh.out_pack, what)
            src = base.narrow_shard(src, sh.out_axis, r * i, i, sh.out_pack, what)
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


def check_dims(layer: FusedMoE, unit: int, what: str) -> None:
    for dim, n in (("hidden size", layer.hidden_size), ("expert intermediate size per rank", layer.intermediate_local)):
        if n % unit:
            raise ValueError(
                f"{layer.prefix or 'FusedMoE'}: {what} experts need the {dim} ({n}) to be a multiple of {unit}"
                + (" (the tensor-parallel shard must fall on a group/block boundary)" if "rank" in dim else "")
            )


class Int4Experts(ExpertMethod):
    """Experts in the canonical int4 form. Loaders fill it with `load_canonical` (GGUF) or convert a
    checkpoint layout into it after loading (AWQ, GPTQ: layers/experts/awq_gptq.py)."""

    def __init__(self, group: int) -> None:
        self.group = group

    def create_weights(self, layer: FusedMoE) -> None:
        check_dims(layer, self.group, f"int4 (group {self.group})")
        check_dims(layer, 8, "int4 (8 rows per word)")
        self.create_canonical(layer)

    def create_canonical(self, layer: FusedMoE) -> None:
        e, h, i, g = layer.num_experts, layer.hidden_size, layer.intermediate_local, self.group
        dtype = torch.get_default_dtype()
        layer.int4_group = g
        # per expert [K/8, N] and [K/g, N]: out axis 1, in axis 0
        add_sharded_param(layer, "w13_qweight", torch.empty(e, h // 8, 2 * i, dtype=torch.int32), Sharding(1, 0, 1, 8))
        add_sharded_param(layer, "w13_scale", torch.empty(e, h // g, 2 * i, dtype=dtype), Sharding(1, 0, 1, g))
        add_sharded_param(layer, "w13_offset", torch.empty(e, h // g, 2 * i, dtype=dtype), Sharding(1, 0, 1, g))
        add_sharded_param(layer, "w2_qweight", torch.empty(e, i // 8, h, dtype=torch.int32), Sharding(1, 0, 1, 8))
        add_sharded_param(layer, "w2_scale", torch.empty(e, i // g, h, dtype=dtype), Sharding(1, 0, 1, g))
        add_sharded_param(layer, "w2_offset", torch.empty(e, i // g, h, dtype=dtype), Sharding(1, 0, 1, g))
        layer.w13_perm = layer.w2_perm = None

    @staticmethod
    def load_canonical(
        layer: FusedMoE, expert_id: int, shard: ExpertShard, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
    ) -> None:
        """Install one expert's full (unsharded) projection given as codes q [out, in] (0..15), scale and
        offset [out, in / g] (w = q * scale + offset); this rank keeps its shard. For GGUF's loader."""
        out, k = q.shape
        if scale.shape != (out, k // layer.int4_group) or offset.shape != scale.shape:
            raise ValueError(
                f"expert {expert_id} {shard.value}: scale {tuple(scale.shape)} / offset {tuple(offset.shape)} "
                f"do not match codes {tuple(q.shape)} in groups of {layer.int4_group}"
            )
        w = "w2" if shard is ExpertShard.DOWN else "w13"
        for suffix, t in (("qweight", pack_rows_bytes(q.t().contiguous())), ("scale", scale.t()), ("offset", offset.t())):
            param = getattr(layer, f"{w}_{suffix}")
            param.weight_loader(param, t, expert_id, shard)

    def dequantized_expert(self, layer: FusedMoE, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference: expert e's (w13 [2I, H], w2 [H, I]) in `dtype`."""
        return (
            _dequant(layer.w13_qweight[e], layer.w13_scale[e], layer.w13_offset[e], layer.w13_perm, e, dtype),
            _dequant(layer.w2_qweight[e], layer.w2_scale[e], layer.w2_offset[e], layer.w2_perm, e, dtype),
        )

    def fused(
        self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        kernel: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """The fused kernel's call (contract 1); act-order experts pass their per-expert row permutations."""
        b13, b2 = layer.w13_bias, layer.w2_bias if layer.tp_rank == 0 else None
        return kernel(
            x, layer.w13_qweight, layer.w13_scale, layer.w13_offset, layer.w2_qweight, layer.w2_scale,
            layer.w2_offset, layer.int4_group, topk_weights, topk_ids, _act(layer), b13, b2,
            w13_perm=layer.w13_perm, w2_perm=layer.w2_perm,
        )

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and (kernel := fused_kernel("fused_moe_int4")) is not None:
            return self.fused(layer, x, topk_weights, topk_ids, kernel)
        b13, b2 = layer.w13_bias, layer.w2_bias if layer.tp_rank == 0 else None
        return moe_ref(
            x, topk_weights, topk_ids, lambda e: self.dequantized_expert(layer, e, x.dtype), layer.activation,
            b13, b2, layer.swiglu_alpha, layer.swiglu_limit,
        )


def _dequant(
    qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, perm: torch.Tensor | None, e: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """[K/8, N] codes, [K/g, N] scale/offset -> [N, K]; act-order rows put back in checkpoint order."""
    q = unpack_rows_bytes(qweight)  # [K, N]
    g = q.shape[0] // scale.shape[0]
    w = q.to(dtype) * scale.repeat_interleave(g, 0).to(dtype) + offset.repeat_interleave(g, 0).to(dtype)
    if perm is not None:
        w = torch.empty_like(w).index_copy_(0, perm[e], w)
    return w.t()


def _act(layer: FusedMoE) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda gate_up: activate(gate_up, layer.activation, layer.swiglu_alpha, layer.swiglu_limit)


class Fp8BlockExperts(ExpertMethod):
    """FP8 block experts as Qwen3-*-FP8 stores them (HELPERS contract 2): per expert `weight` e4m3
    [out, in] and `weight_scale_inv` float32 [out / bo, in / bi]. Weight-only (w8a16): the fp8 bytes stay
    resident on every device, CPU included: a 30B MoE dequantised once at load would need 61 GB in bf16,
    while a token reads only its top-k experts, which the reference dequantises per call."""

    def __init__(self, config: QuantConfig) -> None:
        self.block = config.block_size

    def create_weights(self, layer: FusedMoE) -> None:
        bo, bi = self.block
        if bo != bi:
            raise ValueError(f"FP8 experts need square blocks (weight_block_size {list(self.block)})")
        check_dims(layer, bo, f"FP8 block-{bo}")
        e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_local
        f8 = torch.float8_e4m3fn
        add_sharded_param(layer, "w13_weight", torch.empty(e, 2 * i, h, dtype=f8), Sharding(0, 1))
        add_sharded_param(
            layer, "w13_weight_scale_inv", torch.empty(e, 2 * i // bo, h // bi), Sharding(0, 1, bo, bi)
        )
        add_sharded_param(layer, "w2_weight", torch.empty(e, h, i, dtype=f8), Sharding(0, 1))
        add_sharded_param(layer, "w2_weight_scale_inv", torch.empty(e, h // bo, i // bi), Sharding(0, 1, bo, bi))

    def fused(
        self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        kernel: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """The fused kernel's call (contract 2)."""
        b13, b2 = layer.w13_bias, layer.w2_bias if layer.tp_rank == 0 else None
        return kernel(
            x, layer.w13_weight, layer.w13_weight_scale_inv, layer.w2_weight, layer.w2_weight_scale_inv,
            self.block, topk_weights, topk_ids, _act(layer), b13, b2,
        )

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and (kernel := fused_kernel("fused_moe_fp8")) is not None:
            return self.fused(layer, x, topk_weights, topk_ids, kernel)
        b13, b2 = layer.w13_bias, layer.w2_bias if layer.tp_rank == 0 else None

        def expert(e: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (
                dequantize_block_fp8(layer.w13_weight[e], layer.w13_weight_scale_inv[e], self.block).to(x.dtype),
                dequantize_block_fp8(layer.w2_weight[e], layer.w2_weight_scale_inv[e], self.block).to(x.dtype),
            )

        return moe_ref(x, topk_weights, topk_ids, expert, layer.activation, b13, b2, layer.swiglu_alpha, layer.swiglu_limit)


# The expert method of each checkpoint format; other files register theirs (GGUF: ggufmoe's loader).
_EXPERT_METHODS: dict[QuantMethod, Callable[[QuantConfig], ExpertMethod]] = {
    QuantMethod.UNQUANTIZED: lambda config: UnquantizedExperts(),
    QuantMethod.FP8_BLOCK: Fp8BlockExperts,
}


def register_expert_method(kind: QuantMethod, factory: Callable[[QuantConfig], ExpertMethod]) -> None:
    _EXPERT_METHODS[kind] = factory


def registered_expert_methods() -> frozenset[QuantMethod]:
    _register_checkpoint_formats()
    return frozenset(_EXPERT_METHODS)


def _register_checkpoint_formats() -> None:
    # They build on this module and register themselves: AWQ, GPTQ; GGUF (its loader imports it too).
    from agentbox.layers.experts import awq_gptq, gguf  # noqa: F401


def expert_method(prefix: str = "") -> ExpertMethod:
    """The experts' method from the QuantConfig the linear methods use (skip_modules respected)."""
    _register_checkpoint_formats()
    config = base.current_config()
    if config.method is not QuantMethod.UNQUANTIZED and any(s and s in prefix for s in config.skip_modules):
        config = QuantConfig()
    factory = _EXPERT_METHODS.get(config.method)
    if factory is None:
        raise ValueError(f"MoE experts in {config.method.value} are not supported")
    return factory(config)
