"""Int4 experts in the canonical form (HELPERS contract 1) that AWQ, GPTQ and GGUF 4-bit experts end in, kept
quantised in memory; the torch reference dequantises only the experts a forward routes to, one at a time
(moe_ref), so a 30B MoE stays at its file's size on CPU too.

Per expert e, with K the projection's input and N its output:
- `w13_qweight` int32 [E, H/8, 2I]: codes of w13 transposed ([K, N], gate columns then up), eight K rows per
  word, row k at bits 4 * (k % 8) (`int4.pack_rows_int32`); `w13_scale`, `w13_offset` [E, H/g, 2I] in the
  compute dtype: w[n, k] = q[k, n] * scale[k // g, n] + offset[k // g, n];
- `w2_qweight` int32 [E, I/8, H], `w2_scale`, `w2_offset` [E, I/g, H]; `layer.int4_group` = g;
- GPTQ act-order only: `w13_perm` [E, H], `w2_perm` [E, I] int64: the stored K rows are sorted by group,
  stored row j is checkpoint row perm[j] (so groups are contiguous and the kernels' layout applies).
I is this rank's slice of the intermediate dimension; shards must fall on group (and 8-row) boundaries.

`Int4CheckpointExperts` is the base of the formats loaded in their checkpoint's own layout and converted into
this form once after loading (layers/experts/awq.py, gptq.py).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable

import torch
from torch import nn

from agentbox.layers.experts.base import (
    ExpertLayer,
    ExpertMethod,
    ExpertShard,
    add_sharded_param,
    check_dims,
    expert_activation,
    fused_kernel,
    load_expert_shard,
    moe_ref,
)
from agentbox.layers.quant.base import QuantConfig, Sharding


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


class Int4Experts(ExpertMethod):
    """Experts in the canonical int4 form. Loaders fill it with `load_canonical` (GGUF) or convert a
    checkpoint layout into it after loading (AWQ, GPTQ: layers/experts/awq_gptq.py)."""

    def __init__(self, group: int) -> None:
        self.group = group

    def create_weights(self, layer: ExpertLayer) -> None:
        check_dims(layer, self.group, f"int4 (group {self.group})")
        check_dims(layer, 8, "int4 (8 rows per word)")
        self.create_canonical(layer)

    def create_canonical(self, layer: ExpertLayer) -> None:
        e, h, i, g = layer.num_experts, layer.hidden_size, layer.intermediate_local, self.group
        dtype = torch.get_default_dtype()
        layer.int4_group = g
        # per expert [K/8, N] and [K/g, N]: out axis 1, in axis 0
        add_sharded_param(layer, "w13_qweight", torch.empty(e, h // 8, layer.w13_rows, dtype=torch.int32), Sharding(1, 0, 1, 8))
        add_sharded_param(layer, "w13_scale", torch.empty(e, h // g, layer.w13_rows, dtype=dtype), Sharding(1, 0, 1, g))
        add_sharded_param(layer, "w13_offset", torch.empty(e, h // g, layer.w13_rows, dtype=dtype), Sharding(1, 0, 1, g))
        add_sharded_param(layer, "w2_qweight", torch.empty(e, i // 8, h, dtype=torch.int32), Sharding(1, 0, 1, 8))
        add_sharded_param(layer, "w2_scale", torch.empty(e, i // g, h, dtype=dtype), Sharding(1, 0, 1, g))
        add_sharded_param(layer, "w2_offset", torch.empty(e, i // g, h, dtype=dtype), Sharding(1, 0, 1, g))
        layer.w13_perm = layer.w2_perm = None

    @staticmethod
    def load_canonical(
        layer: ExpertLayer, expert_id: int, shard: ExpertShard, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
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
            name = f"{w}_{suffix}"
            load_expert_shard(layer, name, getattr(layer, name), t, expert_id, shard)

    def dequantized_expert(self, layer: ExpertLayer, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference: expert e's (w13 [2I, H], w2 [H, I]) in `dtype`."""
        return (
            _dequant(layer.w13_qweight[e], layer.w13_scale[e], layer.w13_offset[e], layer.w13_perm, e, dtype),
            _dequant(layer.w2_qweight[e], layer.w2_scale[e], layer.w2_offset[e], layer.w2_perm, e, dtype),
        )

    def fused(
        self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
        kernel: Callable[..., torch.Tensor],
    ) -> torch.Tensor:
        """The fused kernel's call (contract 1); act-order experts pass their per-expert row permutations."""
        b13, b2 = layer.w13_bias, layer.w2_bias if layer.tp_rank == 0 else None
        return kernel(
            x, layer.w13_qweight, layer.w13_scale, layer.w13_offset, layer.w2_qweight, layer.w2_scale,
            layer.w2_offset, layer.int4_group, topk_weights, topk_ids, expert_activation(layer), b13, b2,
            w13_perm=layer.w13_perm, w2_perm=layer.w2_perm,
        )

    def apply(self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
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


class Int4CheckpointExperts(Int4Experts):
    """AWQ / GPTQ experts: loaded in the checkpoint's own per-expert layout (one stacked parameter per
    tensor name, sharded by the shared loader), converted into the canonical form once after loading."""

    RAW: tuple[str, ...] = ()

    def __init__(self, config: QuantConfig) -> None:
        if config.group_size <= 0:
            raise ValueError("quantization_config.group_size: MoE experts need a group size (per-channel -1 is not supported)")
        super().__init__(config.group_size)
        self.config = config

    def create_weights(self, layer: ExpertLayer) -> None:
        check_dims(layer, self.group, f"{self.config.method.value} (group {self.group})")
        check_dims(layer, 8, f"{self.config.method.value} (8 per int32 word)")
        self.dtype = torch.get_default_dtype()
        layer.int4_group = self.group
        layer.w13_perm = layer.w2_perm = None
        self.createraw_tensor(layer)

    @abstractmethod
    def createraw_tensor(self, layer: ExpertLayer) -> None:
        """Register the checkpoint layout's stacked parameters (RAW names) on `layer`."""

    @abstractmethod
    def to_canonical(
        self, layer: ExpertLayer, w: str
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Every expert's projection `w` (w13 / w2), on CPU, as (qweight [E, K/8, N], scale, offset
        [E, K/g, N] float32, perm [E, K] or None), all experts at once. A Qwen3-30B-shaped layer (128
        experts, 2048 x 768) converts in 3.9 s (AWQ) and 0.25 s (GPTQ) on this shared CPU, one thread;
        per expert with the word-shifting helpers AWQ took 6.4 s."""

    def process_weights_after_loading(self, layer: ExpertLayer) -> None:
        device = getattr(layer, f"w13_{self.RAW[0]}").device
        out: dict[str, torch.Tensor] = {}
        for w in ("w13", "w2"):
            out[f"{w}_qweight"], scale, offset, perm = self.to_canonical(layer, w)
            out[f"{w}_scale"], out[f"{w}_offset"] = scale.to(self.dtype), offset.to(self.dtype)
            if perm is not None:
                setattr(layer, f"{w}_perm", nn.Parameter(perm.to(device), requires_grad=False))
            for name in self.RAW:
                delattr(layer, f"{w}_{name}")
        for name, t in out.items():
            layer.add_expert_param(name, t.to(device))


def raw_tensor(layer: ExpertLayer, name: str) -> torch.Tensor:
    return getattr(layer, name).data.cpu()
