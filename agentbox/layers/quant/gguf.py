"""GGUF weights kept as the file's blocks until the layer knows its whole shard, then turned into what this
device runs: Q4_0 / Q4_1 / Q4_K map exactly onto 4-bit codes with a scale and an offset per 32 columns
(`int4.py`), Q5_0 / Q5_1 / Q8_0 / Q5_K / Q6_K onto 5/6/8-bit codes with a scale (and an offset) per 32 or 16
(`bits.py`), and on CPU Q2_K / Q3_K onto 2/3-bit codes with a scale (and an offset) per 16 (the CPU kernel's
alone); other types (IQ*, and Q2_K / Q3_K on a GPU) are dequantised by `gguf`'s own kernels, which are the
reference for all. A merged layer (qkv, gate_up) may hold shards of different types (Q4_K_M files put some attn_v in
Q6_K beside Q4_K q/k): each run of rows of one form keeps it, and the layer concatenates their outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from agentbox.layers.quant import bits, int4
from agentbox.layers.quant.base import LinearMethod, QuantLayer, Sharding, quant_param, register
from agentbox.layers.quant.formats import QuantMethod
from agentbox.layers.quant.lazy import materialize

Q = GGMLQuantizationType
PackedRowsT = TypeVar("PackedRowsT", bound=torch.nn.Module)
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


def q4k_scales(b: GGUFBlocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K tensor in its own terms: (codes [N, K] uint8, 6-bit scales and mins [N, K/32] uint8, d and dmin
    [N, K/256, 2] fp16), what int4.install_k keeps (w = q * d * sc - dmin * mn; int4_groups multiplies them)."""
    n, k = b.shape
    bs, ts = b.block
    raw = np.ascontiguousarray(b.data).reshape(n, k // bs, ts)
    sc, mn = gguf.quants.Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12))
    qs = raw[..., 16:].reshape(n, k // bs, 4, 32)  # as int4_groups reads them
    q = np.stack([qs & 0x0F, qs >> 4], axis=3)
    dd = raw[..., 0:4].copy().view(np.float16).reshape(n, k // bs, 2)
    return (
        torch.from_numpy(np.ascontiguousarray(q).reshape(n, k).astype(np.uint8)),
        torch.from_numpy(np.ascontiguousarray(sc, dtype=np.uint8).reshape(n, k // 32)),
        torch.from_numpy(np.ascontiguousarray(mn, dtype=np.uint8).reshape(n, k // 32)),
        torch.from_numpy(np.ascontiguousarray(dd)),
    )


BITS_OF = {Q.Q5_0: 5, Q.Q5_1: 5, Q.Q8_0: 8, Q.Q5_K: 5, Q.Q6_K: 6}  # the k-bit form's width of each type
BITS_TYPES = frozenset(BITS_OF)
# Q2_K / Q3_K map onto the k-bit form too (bits 2 / 3, groups of 16), but only the CPU kernel (kernels/cpu_bits.c)
# runs them: on a GPU they are dequantised, as before.
CPU_BITS_OF = {Q.Q2_K: 2, Q.Q3_K: 3}
CPU_BITS_TYPES = frozenset(CPU_BITS_OF)


@dataclass(frozen=True)
class BitsGroups:
    """A GGUF tensor as k-bit codes (kernels/dequant.py's k-bit form, before packing): `codes` [N, K] uint8
    below 2^bits, `scale` [N, K/g] fp32, and `offset` [N, K/g] fp32 (w = q * scale + offset) or None for the
    symmetric types (w = (q - 2^(bits-1)) * scale). Both are fp32 products in the order gguf computes them, so
    the weights are exactly gguf's."""

    codes: torch.Tensor
    bits: int
    scale: torch.Tensor
    offset: torch.Tensor | None

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        q = self.codes.reshape(n, k // self.group, self.group).float()
        if self.offset is None:
            return ((q - (1 << (self.bits - 1))) * self.scale.unsqueeze(-1)).reshape(n, k)
        return (q * self.scale.unsqueeze(-1) + self.offset.unsqueeze(-1)).reshape(n, k)


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.copy().view(np.float16).astype(np.float32)[..., 0]


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """[..., 4] bytes of a little-endian uint32 -> [..., count] of its low bits, bit j for element j."""
    words = qh.copy().view(np.uint32)  # [..., 1]
    return ((words >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def _two_bit_rows(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K's [..., 64] bytes of 2-bit fields -> [..., 256]: halves of 128 elements, byte l of a half's 32
    holding elements l, l + 32, l + 64, l + 96 at shifts 0, 2, 4, 6."""
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
    return ((qs.reshape(*qs.shape[:-1], 2, 1, 32) >> shifts) & 3).reshape(*qs.shape[:-1], 256)


def bits_groups(b: GGUFBlocks) -> BitsGroups:
    """Q5_0 / Q5_1 / Q8_0 (groups of 32), Q5_K (8 groups of 32 per 256), Q6_K, Q2_K, Q3_K (16 groups of 16)."""
    n, k = b.shape
    bs, ts = b.block
    raw = np.ascontiguousarray(b.data).reshape(n, k // bs, ts)
    offset: np.ndarray | None = None
    if b.qtype in (Q.Q5_0, Q.Q5_1):
        d = _f16(raw[..., 0:2])
        start = 2 if b.qtype is Q.Q5_0 else 4
        if b.qtype is Q.Q5_1:
            offset = _f16(raw[..., 2:4])
        q = _nibbles(raw[..., start + 4 :]) | (_high_bits(raw[..., start : start + 4], 32) << 4)
        bits, scale = 5, d
    elif b.qtype is Q.Q8_0:
        d = _f16(raw[..., 0:2])
        q = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bits, scale = 8, d
    elif b.qtype is Q.Q5_K:
        d = raw[..., 0:2].copy().view(np.float16).astype(np.float32)
        dmin = raw[..., 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = gguf.quants.Q4_K.get_scale_min(raw[..., 4:16].reshape(-1, 12))
        scale = d * sc.reshape(n, k // bs, 8).astype(np.float32)
        offset = -(dmin * mn.reshape(n, k // bs, 8).astype(np.float32))
        qh = raw[..., 16:48]  # bit j of byte l: element l of sub-block j
        qs = raw[..., 48:].reshape(n, k // bs, 4, 1, 32)  # chunks of 32 bytes: sub-blocks 2j (low), 2j+1 (high)
        low = ((qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F).reshape(n, k // bs, 8, 32)
        high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1
        bits, q = 5, low | (high << 4)
    elif b.qtype is Q.Q2_K:
        # scales[16] (4-bit scale | 4-bit min << 4 per 16), qs[64], fp16 d, dmin: w = d sc q - dmin m
        sc = raw[..., :16]
        d, dmin = (raw[..., at : at + 2].copy().view(np.float16).astype(np.float32) for at in (80, 82))
        scale, offset = d * (sc & 0x0F).astype(np.float32), -(dmin * (sc >> 4).astype(np.float32))
        bits, q = 2, _two_bit_rows(raw[..., 16:80])
    elif b.qtype is Q.Q3_K:
        # hmask[32], qs[64], 12 bytes of 6-bit scales, fp16 d: w = d (sc - 32) (q - 4), q = low 2 bits | the
        # hmask bit << 2 (gguf subtracts 4 where the bit is clear: the same integer)
        d = raw[..., 108:110].copy().view(np.float16).astype(np.float32)
        low, high = raw[..., 96:104], raw[..., 104:108]  # scale j: low nibble of byte j % 8 (j >= 8: >> 4), 2 bits
        lsc = (low[..., None, :] >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)).reshape(n, k // bs, 16) & 0x0F
        hsc = (high[..., None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)).reshape(n, k // bs, 16) & 3
        scale = d * ((lsc | hsc << 4).astype(np.float32) - 32)
        hm = (raw[..., None, :32] >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1  # bit i: rows of 32 i
        bits, q = 3, _two_bit_rows(raw[..., 32:96]) | (hm.reshape(n, k // bs, 256) << 2)
    elif b.qtype is Q.Q6_K:
        ql, qh = raw[..., :128], raw[..., 128:192]
        sc = raw[..., 192:208].copy().view(np.int8).astype(np.float32)
        scale = raw[..., 208:210].copy().view(np.float16).astype(np.float32) * sc  # [n, blocks, 16]
        # Halves of 128 elements: ql's 64 bytes give rows 0-31 / 32-63 (low nibbles) and 64-95 / 96-127 (high),
        # qh's 32 bytes give the 2 high bits of the four rows of 32 at shifts 0, 2, 4, 6.
        low = (ql.reshape(n, k // bs, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F
        high = (qh.reshape(n, k // bs, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 0x03
        bits, q = 6, low.reshape(n, k // bs, 8, 32) | (high.reshape(n, k // bs, 8, 32) << 4)
    else:
        raise ValueError(f"GGUF {b.qtype.name} does not map onto k-bit groups")
    groups = scale.size // n
    return BitsGroups(
        torch.from_numpy(np.ascontiguousarray(q, dtype=np.uint8).reshape(n, k)),
        bits,
        torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32).reshape(n, groups)),
        None if offset is None else torch.from_numpy(np.ascontiguousarray(offset, dtype=np.float32).reshape(n, groups)),
    )


@register
class GGUFLinearMethod(LinearMethod):
    kind = QuantMethod.GGUF

    def create_weights(self, layer: QuantLayer, input_size: int, output_size: int, dtype: torch.dtype) -> None:
        # The type of each shard is known only when it arrives: the parameter is a placeholder until
        # post-processing, and the shards wait here (as file views, or dense tensors for F32/F16 ones).
        layer.weight = quant_param(torch.empty(0, dtype=dtype), Sharding(0, 1))
        self.dtype = dtype
        self.shards: dict[int, GGUFBlocks | torch.Tensor] = {}
        self.kernel: int4.Int4Kernel | bits.BitsKernel | None = None  # None: runs of several forms (segments)

    def load(self, layer: QuantLayer, param: Any, loaded: Any, shard_id: str | int | None, name: str) -> None:
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

    def dequantized_weight(self, layer: QuantLayer) -> torch.Tensor:
        return torch.cat([p.dequantize() if isinstance(p, GGUFBlocks) else p.float() for p in self._parts()])

    def _parts(self) -> list[GGUFBlocks | torch.Tensor]:
        return [self.shards[k] for k in sorted(self.shards)]

    def process_weights_after_loading(self, layer: QuantLayer) -> None:
        parts = self._parts()
        rows = sum(p.shape[0] for p in parts)
        if rows != layer.output_size or any(p.shape[1] != layer.input_size for p in parts):
            raise ValueError(f"GGUF: shards cover {rows} of {layer.output_size} rows of a linear layer")
        device = layer.weight.device
        int4_kernel = self.config.kernel or int4.default_kernel(device)
        bits_kernel = bits.BitsKernel.DENSE if int4_kernel is int4.Int4Kernel.DENSE else bits.default_kernel(device)
        runs: list[tuple[_Form, list[GGUFBlocks | torch.Tensor]]] = []
        for p in parts:
            form = _form(p, int4_kernel, bits_kernel)
            if runs and runs[-1][0] == form:
                runs[-1][1].append(p)
            else:
                runs.append((form, [p]))
        if len(runs) == 1:
            self.kernel = _install(layer, *runs[0], int4_kernel, bits_kernel, self.dtype, device)
        else:
            # Shards of different forms (Q4_K_M's qkv: q/k Q4_K, v Q6_K): each run of rows keeps its own form
            # and kernel, and the outputs are concatenated. Promoting the whole layer to the widest bits and
            # smallest group instead would hold Q4_K's rows at 6 bits + scale and offset per 16 (1.0 byte a
            # weight against the file's 0.5625), and re-round symmetric parts through an offset.
            layer.segments = torch.nn.ModuleList()
            for form, run in runs:
                segment = torch.nn.Module()
                _install(segment, form, run, int4_kernel, bits_kernel, self.dtype, device)
                layer.segments.append(segment)
            self.kernel = None
        self.shards = {}

    def row_runs(self, layer: QuantLayer) -> list[torch.nn.Module]:
        return list(layer.segments) if self.kernel is None else [layer]

    def apply(self, layer: QuantLayer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is None:
            out = torch.cat([apply_form(segment, x, None) for segment in layer.segments], dim=-1)
            return out + bias if bias is not None else out
        return apply_form(layer, x, bias)


class _Form(Enum):
    """What a run of a layer's rows is held as."""

    INT4 = "int4"  # Q4_0 / Q4_1 / Q4_K: int4.py's form
    DENSE = "dense"  # dequantised (float shards, other types, or a dense kernel)
    BITS_2 = 2  # bits.py's form (2 and 3: its CPU kernel only); one per width, so runs of different widths stay apart
    BITS_3 = 3
    BITS_5 = 5
    BITS_6 = 6
    BITS_8 = 8


def _form(p: GGUFBlocks | torch.Tensor, int4_kernel: int4.Int4Kernel, bits_kernel: bits.BitsKernel) -> _Form:
    if isinstance(p, GGUFBlocks) and p.qtype in INT4_TYPES and int4_kernel is not int4.Int4Kernel.DENSE:
        return _Form.INT4
    if isinstance(p, GGUFBlocks) and p.qtype in BITS_TYPES and bits_kernel is not bits.BitsKernel.DENSE:
        return _Form(BITS_OF[p.qtype])
    if isinstance(p, GGUFBlocks) and p.qtype in CPU_BITS_TYPES and bits_kernel is bits.BitsKernel.CPU_SIMD:
        return _Form(CPU_BITS_OF[p.qtype])
    return _Form.DENSE


def _install(
    module: torch.nn.Module,
    form: _Form,
    parts: list[GGUFBlocks | torch.Tensor],
    int4_kernel: int4.Int4Kernel,
    bits_kernel: bits.BitsKernel,
    dtype: torch.dtype,
    device: torch.device,
) -> int4.Int4Kernel | bits.BitsKernel:
    """Hold `parts` (stacked rows) on `module` in `form`; returns the kernel that runs them."""
    if form is _Form.INT4 and int4_kernel is int4.Int4Kernel.TRITON and all(
        p.qtype is Q.Q4_K for p in parts  # type: ignore[union-attr]
    ):  # Q4_K at its file's bytes: its own scales, not a bf16 scale and offset per 32 (11 % more)
        q, sc, mn, dd = (torch.cat(t) for t in zip(*(q4k_scales(p) for p in parts), strict=True))  # type: ignore[arg-type]
        int4.install_k(module, q, sc, mn, dd, device)
        return module.int4_kernel
    if form is _Form.INT4:
        groups = [int4_groups(p) for p in parts]  # type: ignore[arg-type]
        q, scale, offset = (torch.cat([g[i] for g in groups]) for i in range(3))
        int4.install(module, q, scale, offset, int4_kernel, dtype, device)
        return module.int4_kernel
    if form is _Form.DENSE:
        dense = [p.dequantize() if isinstance(p, GGUFBlocks) else p.float() for p in parts]
        module.weight = quant_param(torch.cat(dense).to(device=device, dtype=dtype), Sharding(0, 1))
        module.int4_kernel = int4.Int4Kernel.DENSE
        return module.int4_kernel
    groups = [bits_groups(p) for p in parts]  # type: ignore[arg-type]
    if len({(g.group, g.offset is None) for g in groups}) > 1:  # Q5_0 beside Q5_1 / Q5_K: give all an offset
        groups = [_with_offset(g, min(h.group for h in groups)) for g in groups]
    offsets = [g.offset for g in groups]
    offset = None if offsets[0] is None else torch.cat(offsets)  # type: ignore[arg-type]
    q, scale = torch.cat([g.codes for g in groups]), torch.cat([g.scale for g in groups])
    bits.install(module, q, form.value, scale, offset, bits_kernel, dtype, device)
    return bits_kernel


def _with_offset(g: BitsGroups, group: int) -> BitsGroups:
    """The same weights at a (smaller) group with an explicit offset: a symmetric part's is -2^(bits-1) scale,
    exact in fp32 (a power of two), though q * scale + offset rounds twice where (q - 2^(bits-1)) scale once."""
    rep = g.group // group
    scale = g.scale.repeat_interleave(rep, 1)
    offset = -(1 << (g.bits - 1)) * scale if g.offset is None else g.offset.repeat_interleave(rep, 1)
    return BitsGroups(g.codes, g.bits, scale, offset)


def install_rows(
    module: PackedRowsT, table: GGUFBlocks, padded: int, dtype: torch.dtype, device: torch.device
) -> PackedRowsT | None:
    """A vocabulary table's rows in its type's Triton form on `module`, zero rows padding it to `padded`
    (they dequantise to 0 with a zero scale); None for a type that has none (it is dequantised)."""
    if table.qtype in INT4_TYPES:
        q, scale, offset = int4_groups(table)
        kernel: int4.Int4Kernel | bits.BitsKernel = int4.Int4Kernel.TRITON
    elif table.qtype in BITS_TYPES and (kernel := bits.default_kernel(device)) is bits.BitsKernel.TRITON:
        g = bits_groups(table)
        q, scale, offset = g.codes, g.scale, g.offset
    else:
        return None
    pad = padded - q.shape[0]
    q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
    scale, offset = (None if t is None else torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (scale, offset))
    if isinstance(kernel, int4.Int4Kernel):
        int4.install(module, q, scale, offset, kernel, dtype, device)  # type: ignore[arg-type]
    else:
        bits.install(module, q, BITS_OF[table.qtype], scale, offset, kernel, dtype, device)  # type: ignore[arg-type]
    return module


def apply_form(module: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x through the form `_install` / `install_rows` put on `module`."""
    if hasattr(module, "bits_kernel"):
        return bits.apply(module, x, bias)
    return int4.apply(module, x, bias)
