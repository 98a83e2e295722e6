"""GGUF experts (qwen3moe `ffn_{gate,up,down}_exps`): the file's blocks until the layer has every expert, then
the form this layer runs, decided per layer from its tensor types:

- Q4_0 / Q4_1 / Q4_K experts map exactly onto 4-bit codes with a scale and an offset per 32 input columns
  (`int4_groups`), so they end in the canonical int4 expert form (`Int4Experts`: w13/w2 `_qweight`,
  `_scale`, `_offset`, group 32) and stay 4-bit in memory;
- any other type (Q5_0, Q5_1, Q8_0, Q5_K, Q6_K, F16, F32, BF16) is dequantised by `gguf`'s reference and
  held in the compute dtype (`UnquantizedExperts`). A layer whose three projections do not all map (Q4_K_M
  puts about half the layers' ffn_down_exps in Q6_K) is dense as a whole: the int4 expert kernels take
  w13 and w2 in one form, and no expert kernel reads Q5/Q6/Q8 blocks yet. So is a layer whose per-rank
  intermediate size is not a multiple of 32 (a group would straddle two ranks).

Tensor parallel splits every expert's intermediate dimension: gate/up keep this rank's rows (row views of
the file, nothing else is read), down this rank's columns. A column shard may cut a block (Q4_K's 256
columns at I / tp = 384): the covering blocks are read and cut at 32-column groups in the int4 form, or
after dequantisation in the dense one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from agentbox.layers.moe import ExpertMethod, ExpertShard, FusedMoE, UnquantizedExperts
from agentbox.layers.moe_quant import Int4Experts, register_expert_method
from agentbox.layers.quant.formats import QuantMethod
from agentbox.layers.quant.gguf import INT4_TYPES, GGUFBlocks, int4_groups

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

    def create_weights(self, layer: FusedMoE) -> None:
        # Placeholders named as the loader's expert mapping targets; replaced at post-processing.
        self.dtype = torch.get_default_dtype()
        self.parts: dict[tuple[ExpertShard, int], _Part] = {}
        for name in ("w13_weight", "w2_weight"):
            layer.add_expert_param(name, torch.empty(0))
            getattr(layer, name).weight_loader = self._loader(layer)  # type: ignore[attr-defined]

    def _loader(self, layer: FusedMoE) -> Any:
        def load(param: nn.Parameter, loaded: GGUFBlocks | torch.Tensor, expert_id: int, shard: ExpertShard) -> None:
            if not 0 <= expert_id < layer.num_experts:
                raise ValueError(f"expert id {expert_id} out of range (the layer has {layer.num_experts})")
            if shard not in (ExpertShard.GATE, ExpertShard.UP, ExpertShard.DOWN):
                raise ValueError(f"GGUF experts: unexpected expert shard {shard!r}")
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

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        stacks = [self._stack(layer, s) for s in (ExpertShard.GATE, ExpertShard.UP, ExpertShard.DOWN)]
        device = layer.w13_weight.device
        del layer.w13_weight, layer.w2_weight
        if layer.intermediate_local % GROUP == 0 and all(
            isinstance(p[0].data, GGUFBlocks) and p[0].data.qtype in INT4_TYPES for p in stacks
        ):
            (q1, s1, o1), (q3, s3, o3), (q2, s2, o2) = (_int4(p, layer.num_experts) for p in stacks)
            method = Int4Experts(GROUP)
            with _building(device, self.dtype):  # post-processing runs outside the loader's device/dtype
                method.create_canonical(layer)
            w13 = (torch.cat(t, dim=1) for t in ((q1, q3), (s1, s3), (o1, o3)))  # gate rows first, then up
            _fill_int4(layer, "w13", *w13)
            _fill_int4(layer, "w2", q2, s2, o2)
            layer.method = method
        else:
            gate, up, down = (_dense(p, layer.num_experts, self.dtype) for p in stacks)
            layer.add_expert_param("w13_weight", torch.cat([gate, up], dim=1).to(device))
            layer.add_expert_param("w2_weight", down.to(device))
            layer.method = UnquantizedExperts()
        self.parts = {}

    def _stack(self, layer: FusedMoE, shard: ExpertShard) -> list[_Part]:
        missing = [e for e in range(layer.num_experts) if (shard, e) not in self.parts]
        if missing:
            raise ValueError(f"GGUF experts: no {shard.value} weight for experts {missing[:8]}")
        return [self.parts[(shard, e)] for e in range(layer.num_experts)]

    def apply(self, layer: FusedMoE, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("GGUF experts run only after process_weights_after_loading (the loader calls it)")


@contextlib.contextmanager
def _building(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)


def _fill_int4(layer: FusedMoE, prefix: str, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
    """q [E, N, K] codes, scale/offset [E, N, K/g] -> the contract's [E, K/8, N] int32 and [E, K/g, N]."""
    getattr(layer, f"{prefix}_qweight").data.copy_(pack_k(q))
    getattr(layer, f"{prefix}_scale").data.copy_(scale.transpose(1, 2))
    getattr(layer, f"{prefix}_offset").data.copy_(offset.transpose(1, 2))


def pack_k(q: torch.Tensor) -> torch.Tensor:
    """[E, N, K] codes -> [E, K/8, N] int32, K row k at bits 4 * (k % 8): `int4.pack_rows_int32` of each
    expert's [K, N] transpose, bit for bit. Done in bytes (two codes a byte, four bytes a little-endian
    word) and one transpose of the words: on a Qwen3-30B layer (128 x 1536 x 2048) the per-row shift loop
    over int32 copies of the codes took 2 s and 1.6 GB per projection."""
    if q.shape[-1] % 8:
        raise ValueError(f"int4 experts need the input dim ({q.shape[-1]}) to be a multiple of 8")
    pairs = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()
    return pairs.view(torch.int32).transpose(1, 2).contiguous()


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


def _dense(parts: list[_Part], experts: int, dtype: torch.dtype) -> torch.Tensor:
    """[E, N, cols] in `dtype`: gguf's reference dequantisation of this rank's part of every expert."""
    if isinstance(parts[0].data, torch.Tensor):
        return torch.stack([p.data for p in parts]).to(dtype)  # type: ignore[misc]
    w = _blocks(parts).dequantize().narrow(1, parts[0].trim, parts[0].cols)
    return w.reshape(experts, -1, parts[0].cols).to(dtype)


register_expert_method(QuantMethod.GGUF, lambda config: GGUFExperts())
