"""GGUF experts (qwen3moe `ffn_{gate,up,down}_exps`; un-gated ones, Nemotron-H's, without gate): the file's blocks until the layer has every expert, then
the form this layer runs, decided per layer from its tensor types, each kept quantised:

- Q4_0 / Q4_1 / Q4_K experts map exactly onto 4-bit codes with a scale and an offset per 32 input columns
  (`int4_groups`), so a layer of only those ends in the canonical int4 expert form (`Int4Experts`: w13/w2
  `_qweight`, `_scale`, `_offset`, group 32);
- a layer with any Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K projection ends in the k-bit form (`BitsExperts`,
  layers/experts/bits.py; `bits_groups`), w13 and w2 each in their own bits / group / offset: Q4_K_M's layers
  with a Q6_K ffn_down_exps keep Q4_K gate/up at 4 bits and the down at 6. A w13 whose gate and up differ
  in type is promoted exactly to the wider form (widest bits, smallest group, an offset if either has one),
  as merged dense layers are;
- Q2_K / Q3_K experts on a CPU device (host experts, `--cpu-moe`, or a CPU-only machine) take the k-bit form at
  bits 2 / 3 with an offset per 16 (Q3_K's is -4 scale, exact: (q - 4) s needs 20 bits), which the CPU kernel
  runs (layers/experts/cpu.py repacks them); on a GPU no kernel runs them yet, so they are dequantised there;
- F16 / F32 / BF16 experts and types with no such map are held dequantised (`UnquantizedExperts`), and so
  is an all-4-bit layer whose per-rank intermediate size is not a multiple of 32; a k-bit layer whose
  down shard does not fall on its groups is refused, naming the tensor.

Tensor parallel splits every expert's intermediate dimension: gate/up keep this rank's rows (row views of
the file, nothing else is read), down this rank's columns. A column shard may cut a block (Q4_K's 256
columns at I / tp = 384): the covering blocks are read and cut at their 16- or 32-column groups, or after
dequantisation in the dense form.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from agentbox.layers.experts.base import ExpertLayer, ExpertMethod, ExpertShard
from agentbox.layers.experts.bits import BitsCodes, BitsExperts, BitsForm, pack_k
from agentbox.layers.experts.int4 import Int4Experts
from agentbox.layers.experts.unquantized import UnquantizedExperts
from agentbox.layers.quant.gguf import (
    BITS_TYPES,
    CPU_BITS_TYPES,
    INT4_TYPES,
    GGUFBlocks,
    bits_groups,
    int4_groups,
)
from agentbox.layers.weight_loading import set_weight_loader

GROUP = 32  # input columns per scale of every int4-mapped GGUF type (Q4_K: its 8 sub-blocks of a 256 block)


class _Part:
    """One expert's projection as this rank reads it: blocks (rows already narrowed) whose columns
    [trim, trim + cols) are this rank's, or a dense tensor already cut."""

    def __init__(self, data: GGUFBlocks | torch.Tensor, trim: int, cols: int) -> None:
        self.data, self.trim, self.cols = data, trim, cols


def _cover(blocks: GGUFBlocks, rows: tuple[int, int], cols: tuple[int, int] | None) -> _Part:
    """Rows `rows`, and the whole blocks covering columns `cols` (start, size): views, nothing read."""
    if cols is None:
        return _Part(blocks.narrow(rows, None), 0, blocks.shape[1])
    bs = blocks.block[0]
    start = cols[0] // bs * bs
    end = -(-(cols[0] + cols[1]) // bs) * bs
    return _Part(blocks.narrow(rows, (start, end - start)), cols[0] - start, cols[1])


class GGUFExperts(ExpertMethod):
    """Loads GGUF experts; after loading the layer runs as `Int4Experts` or `UnquantizedExperts`."""

    def create_weights(self, layer: ExpertLayer) -> None:
        # Placeholders named as the loader's expert mapping targets; replaced at post-processing.
        self.dtype = torch.get_default_dtype()
        self.parts: dict[tuple[ExpertShard, int], _Part] = {}
        for name in ("w13_weight", "w2_weight"):
            layer.add_expert_param(name, torch.empty(0))
            set_weight_loader(getattr(layer, name), self._loader(layer))

    def _loader(self, layer: ExpertLayer) -> Any:
        def load(param: nn.Parameter, loaded: GGUFBlocks | torch.Tensor, expert_id: int, shard: ExpertShard) -> None:
            if not 0 <= expert_id < layer.num_experts:
                raise ValueError(f"expert id {expert_id} out of range (the layer has {layer.num_experts})")
            if shard not in (ExpertShard.GATE, ExpertShard.UP, ExpertShard.DOWN):
                raise ValueError(f"GGUF experts: unexpected expert shard {shard!r}")
            if shard is ExpertShard.GATE and not layer.activation.gated:
                raise ValueError(f"GGUF experts: the layer's {layer.activation.value} experts have no gate projection")
            i, h, r = layer.intermediate_local, layer.hidden_size, layer.tp_rank
            want = (h, i * layer.tp_size) if shard is ExpertShard.DOWN else (i * layer.tp_size, h)
            if tuple(loaded.shape) != want:
                raise ValueError(f"GGUF experts: {shard.value} of expert {expert_id} is {tuple(loaded.shape)}, expected {want}")
            if isinstance(loaded, GGUFBlocks):
                if shard is ExpertShard.DOWN:
                    part = _cover(loaded, (0, h), (r * i, i))
                else:
                    part = _cover(loaded, (r * i, i), None)
            elif shard is ExpertShard.DOWN:
                part = _Part(loaded.narrow(1, r * i, i).contiguous(), 0, i)
            else:
                part = _Part(loaded.narrow(0, r * i, i).contiguous(), 0, h)
            self.parts[(shard, expert_id)] = part

        return load

    def process_weights_after_loading(self, layer: ExpertLayer) -> None:
        # w13's projections: gate then up, or up alone for un-gated experts (ffn_up_exps without ffn_gate_exps)
        w13_shards = (ExpertShard.GATE, ExpertShard.UP) if layer.activation.gated else (ExpertShard.UP,)
        shards = (*w13_shards, ExpertShard.DOWN)
        stacks = [self._stack(layer, s) for s in shards]
        device = layer.w13_weight.device
        del layer.w13_weight, layer.w2_weight
        types = [p[0].data.qtype if isinstance(p[0].data, GGUFBlocks) else None for p in stacks]
        kbit = _bits_types(device)
        if layer.intermediate_local % GROUP == 0 and all(t in INT4_TYPES for t in types):
            *w13_parts, w2 = (_int4(p, layer.num_experts) for p in stacks)
            method = Int4Experts(GROUP)
            with _building(device, self.dtype):  # post-processing runs outside the loader's device/dtype
                method.create_canonical(layer)
            _fill_int4(layer, "w13", *(torch.cat(t, dim=1) for t in zip(*w13_parts, strict=True)))  # gate, then up
            _fill_int4(layer, "w2", *w2)
            layer.method = method
        elif all(t in INT4_TYPES | kbit for t in types) and any(t in kbit for t in types):
            *w13_codes, down = (_codes(layer, p, s) for p, s in zip(stacks, shards, strict=True))
            w13 = _merge(*w13_codes) if len(w13_codes) == 2 else w13_codes[0]
            method = BitsExperts(w13.form, down.form)
            with _building(device, self.dtype):
                method.create_weights(layer)
            method.install(layer, "w13", w13)
            method.install(layer, "w2", down)
            layer.method = method
        else:
            *w13_dense, down = (_dense(p, layer.num_experts, self.dtype) for p in stacks)
            layer.add_expert_param("w13_weight", torch.cat(w13_dense, dim=1).to(device))
            layer.add_expert_param("w2_weight", down.to(device))
            layer.method = UnquantizedExperts()
        self.parts = {}

    def _stack(self, layer: ExpertLayer, shard: ExpertShard) -> list[_Part]:
        missing = [e for e in range(layer.num_experts) if (shard, e) not in self.parts]
        if missing:
            raise ValueError(f"GGUF experts: no {shard.value} weight for experts {missing[:8]}")
        return [self.parts[(shard, e)] for e in range(layer.num_experts)]

    def apply(self, layer: ExpertLayer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("GGUF experts run only after process_weights_after_loading (the loader calls it)")


def _bits_types(device: torch.device) -> frozenset[GGMLQuantizationType]:
    """The types that take the k-bit expert form on `device`: Q2_K / Q3_K only where the CPU kernel runs them."""
    return BITS_TYPES | CPU_BITS_TYPES if device.type == "cpu" else BITS_TYPES


@contextlib.contextmanager
def _building(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def _fill_int4(layer: ExpertLayer, prefix: str, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
    """q [E, N, K] codes, scale/offset [E, N, K/g] -> the contract's [E, K/8, N] int32 and [E, K/g, N]."""
    getattr(layer, f"{prefix}_qweight").data.copy_(pack_k(q))
    getattr(layer, f"{prefix}_scale").data.copy_(scale.transpose(1, 2))
    getattr(layer, f"{prefix}_offset").data.copy_(offset.transpose(1, 2))


def _blocks(parts: list[_Part]) -> GGUFBlocks:
    """Every expert's blocks as one [E * rows, covering cols] tensor (reads exactly those bytes)."""
    blocks = [p.data for p in parts if isinstance(p.data, GGUFBlocks)]
    if len(blocks) != len(parts):
        raise TypeError("GGUF experts: a projection mixes file blocks and dense tensors")
    first = blocks[0]
    data = np.concatenate([b.data for b in blocks])
    return GGUFBlocks(first.qtype, (len(parts) * first.shape[0], first.shape[1]), data)


def _int4(parts: list[_Part], experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [E, N, cols] uint8, scale, offset [E, N, cols / 32]) of this rank's columns, exactly."""
    q, scale, offset = int4_groups(_blocks(parts))
    trim, cols = parts[0].trim, parts[0].cols
    q = q.narrow(1, trim, cols)
    scale, offset = (t.narrow(1, trim // GROUP, cols // GROUP) for t in (scale, offset))
    return tuple(t.reshape(experts, -1, t.shape[1]).contiguous() for t in (q, scale, offset))  # type: ignore[return-value]


def _codes(layer: ExpertLayer, parts: list[_Part], shard: ExpertShard) -> BitsCodes:
    """This rank's columns of every expert as k-bit (or 4-bit) codes, exactly; a shard off a group is refused."""
    blocks = _blocks(parts)
    if blocks.qtype in INT4_TYPES:
        q, scale, offset = int4_groups(blocks)
        bits = 4
    else:
        g = bits_groups(blocks)
        q, scale, offset, bits = g.codes, g.scale, g.offset, g.bits
        if bits < 4 and offset is None:  # Q3_K: the nibble layout below 4 bits always has an offset (BitsForm)
            offset = scale * -float(1 << (bits - 1))
    group = q.shape[1] // scale.shape[1]
    trim, cols = parts[0].trim, parts[0].cols
    if trim % group or cols % group:
        raise ValueError(
            f"{layer.prefix or 'FusedMoE'}: GGUF {blocks.qtype.name} experts ({shard.value}, ffn_{shard.value}_exps) "
            f"split over {layer.tp_size} ranks: rank {layer.tp_rank}'s {cols} input columns from column "
            f"{layer.tp_rank * cols} do not fall on its {group}-column groups"
        )
    q = q.narrow(1, trim, cols)
    scale, offset = (None if t is None else t.narrow(1, trim // group, cols // group) for t in (scale, offset))
    e = layer.num_experts
    return BitsCodes(
        q.reshape(e, -1, cols).contiguous(), BitsForm(bits, group, offset is not None),
        scale.reshape(e, -1, cols // group).contiguous(),  # type: ignore[union-attr]
        None if offset is None else offset.reshape(e, -1, cols // group).contiguous(),
    )


def _merge(gate: BitsCodes, up: BitsCodes) -> BitsCodes:
    """w13: gate rows, then up rows, in one form. Different forms are promoted without changing a weight:
    the widest bits, the smallest group, an offset if either has one (a symmetric part's is -2^(bits-1)
    scale); two symmetric parts of different widths move the narrower's codes to the wider's centre."""
    a, b = gate.form, up.form
    form = BitsForm(max(a.bits, b.bits), min(a.group, b.group), a.has_offset or b.has_offset)
    parts = [_promote(c, form) for c in (gate, up)]
    offset = None if parts[0].offset is None else torch.cat([p.offset for p in parts], dim=1)  # type: ignore[misc]
    return BitsCodes(
        torch.cat([p.codes for p in parts], dim=1), form, torch.cat([p.scale for p in parts], dim=1), offset
    )


def _promote(c: BitsCodes, form: BitsForm) -> BitsCodes:
    q, scale, offset = c.codes, c.scale, c.offset
    if form.has_offset and offset is None:
        offset = scale * -float(1 << (c.form.bits - 1))
    elif not form.has_offset and form.bits != c.form.bits:
        q = q + ((1 << (form.bits - 1)) - (1 << (c.form.bits - 1)))
    r = c.form.group // form.group
    scale, offset = (None if t is None else t.repeat_interleave(r, dim=-1) for t in (scale, offset))
    return BitsCodes(q, form, scale, offset)  # type: ignore[arg-type]


def _dense(parts: list[_Part], experts: int, dtype: torch.dtype) -> torch.Tensor:
    """[E, N, cols] in `dtype`: gguf's reference dequantisation of this rank's part of every expert."""
    if isinstance(parts[0].data, torch.Tensor):
        return torch.stack([p.data for p in parts]).to(dtype)  # type: ignore[misc]
    w = _blocks(parts).dequantize().narrow(1, parts[0].trim, parts[0].cols)
    return w.reshape(experts, -1, parts[0].cols).to(dtype)

