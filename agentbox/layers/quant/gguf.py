"""GGUF weights kept as the file's blocks until the layer knows its whole shard, then turned into what this
device runs: Q4_0 / Q4_1 / Q4_K map exactly onto 4-bit codes with a scale and an offset per 32 columns
(`int4.py`); every type (Q5_0, Q5_1, Q8_0, Q5_K, Q6_K, and those) can be dequantised by `gguf`'s own
kernels, which are the reference. A merged layer (qkv, gate_up) may hold shards of different types
(Q4_K_M files mix Q4_K and Q6_K); it uses the int4 form only when every shard maps onto it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from agentbox.layers.quant import int4
from agentbox.layers.quant.base import LinearMethod, Sharding, ShardRanges, quant_param, register
from agentbox.layers.quant.formats import QuantMethod
from agentbox.layers.quant.lazy import materialize

if TYPE_CHECKING:
    from agentbox.layers.linear import LinearBase

Q = GGMLQuantizationType
INT4_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
FLOAT_TYPES = frozenset({Q.F32, Q.F16, Q.BF16})


@dataclass(frozen=True)
class GGUFBlocks:
    """A quantised GGUF tensor as stored: `data` [rows, bytes per row] uint8, usually a read-only view of
    the memory-mapped file (only the rows and blocks a rank narrows to are ever read)."""

    qtype: GGMLQuantizationType
    shape: tuple[int, int]  # [out, in] in elements
    data: np.ndarray

    @property
    def block(self) -> tuple[int, int]:
        return GGML_QUANT_SIZES[self.qtype]

    def narrow(self, rows: tuple[int, int], cols: tuple[int, int] | None) -> GGUFBlocks:
        bs, ts = self.block
        data = self.data[rows[0] : rows[0] + rows[1]]
        in_features = self.shape[1]
        if cols is not None:
            if cols[0] % bs or cols[1] % bs:
                raise ValueError(f"GGUF {self.qtype.name}: input shard {cols} is not on a {bs}-column block boundary")
            data = data[:, cols[0] // bs * ts : (cols[0] + cols[1]) // bs * ts]
            in_features = cols[1]
        return GGUFBlocks(self.qtype, (rows[1], in_features), data)

    def dequantize(self) -> torch.Tensor:
        """fp32 [out, in] by `gguf`'s reference kernels."""
        w = gguf.quants.dequantize(np.ascontiguousarray(self.data), self.qtype).reshape(self.shape)
        return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32))


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] packed bytes -> [..., 32] codes: low nibbles are elements 0..15, high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def int4_groups(b: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes [N, K] uint8, scale [N, K/32], offset [N, K/32]) with w = q * scale + offset, exactly."""
    n, k = b.shape
    bs, ts = b.block
    raw = np.ascontiguousarray(b.data).reshape(n, k // bs, ts)
    if b.qtype in (Q.Q4_0, Q.Q4_1):
        d = raw[..., 0:2].copy().view(np.float16).astype(np.float32)[..., 0]
        if b.qtype is Q.Q4_0:
            q, offset = _nibbles(raw[..., 2:]), -8 * d
        else:
            m = raw[..., 2:4].copy().view(np.float16).astype(np.float32)[..., 0]
            q, offset = _nibbles(raw[..., 4:]), m
        scale = d
    elif b.qtype is Q.Q4_K:
        d = raw[..., 0:2].copy().view(np.float16).astype(np.float32)
        dmin = raw[..., 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = gguf.quants.Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12))
        sc = sc.reshape(n, k // bs, 8).astype(np.float32)
        mn = mn.reshape(n, k // bs, 8).astype(np.float32)
        scale, offset = d * sc, -(dmin * mn)  # [n, blocks, 8 sub-blocks]
        qs = raw[..., 16:].reshape(n, k // bs, 4, 32)  # 4 chunks of 32 bytes: sub-blocks 2j (low), 2j+1 (high)
        q = np.stack([qs & 0x0F, qs >> 4], axis=3)  # [n, blocks, 4, 2, 32]
    else:
        raise ValueError(f"GGUF {b.qtype.name} does not map onto 4-bit groups")
    return (
        torch.from_numpy(np.ascontiguousarray(q).reshape(n, k).astype(np.uint8)),
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(n, k // 32)),
        torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32).reshape(n, k // 32)),
    )


@register
class GGUFLinearMethod(LinearMethod):
    kind = QuantMethod.GGUF

    def create_weights(self, layer: LinearBase, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        # The type of each shard is known only when it arrives: the parameter is a placeholder until
        # post-processing, and the shards wait here (as file views, or dense tensors for F32/F16 ones).
        layer.weight = quant_param(torch.empty(0, dtype=dtype), Sharding(0, 1))
        self.dtype = dtype
        self.shards: dict[int, GGUFBlocks | torch.Tensor] = {}
        self.kernel: int4.Int4Kernel | None = None

    def load(self, layer: ShardRanges, param: Any, loaded: Any, shard_id: str | int | None, name: str) -> None:
        if param is not getattr(layer, "weight", None):
            return super().load(layer, param, loaded, shard_id, name)  # bias: plain tensor
        dst_off, src_off, size = layer.out_range(shard_id)
        cols = layer.in_range()
        if isinstance(loaded, GGUFBlocks):
            bs = loaded.block[0]
            if cols is not None and (cols[0] % bs or cols[1] % bs):
                # A row-parallel shard inside a block (heads of 64 columns, Q4_K blocks of 256): this rank's
                # rows are dequantised and cut densely, as the loader did before blocks were kept.
                dense = loaded.narrow((src_off, size), None).dequantize()
                self.shards[dst_off] = dense.narrow(1, cols[0], cols[1]).contiguous()
            else:
                self.shards[dst_off] = loaded.narrow((src_off, size), cols)
        else:
            t = loaded.narrow(0, src_off, size)
            self.shards[dst_off] = materialize(t.narrow(1, cols[0], cols[1]) if cols is not None else t)

    def dequantized_weight(self, layer: LinearBase) -> torch.Tensor:
        return torch.cat([p.dequantize() if isinstance(p, GGUFBlocks) else p.float() for p in self._parts()])

    def _parts(self) -> list[GGUFBlocks | torch.Tensor]:
        return [self.shards[k] for k in sorted(self.shards)]

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        parts = self._parts()
        rows = sum(p.shape[0] for p in parts)
        if rows != layer.output_size or any(p.shape[1] != layer.input_size for p in parts):
            raise ValueError(f"GGUF: shards cover {rows} of {layer.output_size} rows of a linear layer")
        device = layer.weight.device
        kernel = self.config.kernel or int4.default_kernel(device)
        if kernel is not int4.Int4Kernel.DENSE and all(
            isinstance(p, GGUFBlocks) and p.qtype in INT4_TYPES for p in parts
        ):
            groups = [int4_groups(p) for p in parts]  # type: ignore[arg-type]
            q, scale, offset = (torch.cat([g[i] for g in groups]) for i in range(3))
            int4.install(layer, q, scale, offset, kernel, self.dtype, device)
        else:
            dense = [p.dequantize() if isinstance(p, GGUFBlocks) else p.float() for p in parts]
            layer.weight = quant_param(torch.cat(dense).to(device=device, dtype=self.dtype), Sharding(0, 1))
            layer.int4_kernel = int4.Int4Kernel.DENSE
        self.kernel = layer.int4_kernel
        self.shards = {}

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return int4.apply(layer, x, bias)
