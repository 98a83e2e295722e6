"""k-bit (5, 6, 8) weights on AVX2 CPUs (cpu_bits.c, built into cpu_gemv's library), and their torch twins.

The form is the shared k-bit contract (layers/quant/gguf.py `bits_groups`): codes q in [0, 2^bits) per
element, per (row, group of 16 or 32 columns) a scale and optionally an offset; w = q * scale + offset, or
w = (q - 2^(bits-1)) * scale without offsets. `pack_bits_cpu` lays a weight out as one byte stream per row
(see the C file): records of P blocks of 32 columns, each a header of the record's scales then its blocks
(low nibbles + high bits, or int8 codes). Scales are kept in the smallest form that holds them exactly:

- I8: one fp32 per record and int8 multiples of it (the K-quants: Q5_K's d * sc and dmin * m, Q6_K's
  d * sc, over GGUF's 256-column super-blocks): Q5_K 5.75 bits per weight (its file: 5.5), Q6_K 6.625 (6.5625);
- F16: fp16 per group (Q5_0 5.5, Q5_1 6.0, Q8_0 8.5 bits, exactly the file's);
- F32: anything else (a weight quantised here rather than read from a GGUF file).

`bits_matmul` rounds activations to int8 per 32 as cpu_gemv does; many-row callers use
`F.linear(round_activations(x), bits_dequant(w))`, the same numbers. The twins (`*_ref`) define both.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from agentbox.kernels import cpu_gemv
from agentbox.kernels.cpu_gemv import BLOCK, quantize_activations_ref, round_activations

__all__ = ["BitsCPU", "ScaleForm", "bits_dequant", "bits_dequant_ref", "bits_matmul", "bits_matmul_ref",
           "bits_rows", "pack_bits_cpu", "resident_bytes", "round_activations", "unpack_bits_cpu"]

MAX_BLOCKS = 8  # 32-column blocks per record: 256 columns, a GGUF K-quant super-block
_BLOCK_BYTES = {5: 20, 6: 24, 8: 32}


class ScaleForm(enum.IntEnum):  # values are cpu_bits.c's
    F32 = 0
    F16 = 1
    I8 = 2


@dataclass(frozen=True)
class BitsCPU:
    data: torch.Tensor  # [N, row_bytes] uint8: the rows' streams
    bits: int
    group: int  # 16 or 32 columns per scale
    k: int
    form: ScaleForm
    has_offset: bool
    blocks: int  # P: 32-column blocks per record

    @property
    def n(self) -> int:
        return self.data.shape[0]

    @property
    def groups(self) -> int:  # scale groups per record
        return self.blocks * BLOCK // self.group

    @property
    def header_bytes(self) -> int:
        parts = 1 + self.has_offset
        each = {ScaleForm.F32: 4 * self.groups, ScaleForm.F16: 2 * self.groups, ScaleForm.I8: 4 + self.groups}
        return each[self.form] * parts

    @property
    def record_bytes(self) -> int:
        return self.header_bytes + self.blocks * _BLOCK_BYTES[self.bits]


def resident_bytes(w: BitsCPU) -> int:
    return w.data.numel() * w.data.element_size()


def _blocks_per_record(k: int) -> int:
    nb = k // BLOCK
    return max(p for p in range(1, MAX_BLOCKS + 1) if nb % p == 0)


def _factor(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """v [..., G] fp32 as d [...] fp32 times c [..., G] int8, exactly, or None. The largest |v| is t * d for
    some t <= 128; trying t from 128 down finds GGUF's own split (or d / 2 with even c) within a few tries."""
    amax = v.abs().amax(-1)
    d = torch.zeros_like(amax)
    c = torch.zeros(v.shape, dtype=torch.int8)
    todo = amax > 0
    for t in range(128, 0, -1):
        if not bool(todo.any()):
            return d, c
        idx = todo.nonzero(as_tuple=True)
        dt = amax[idx] / t
        ct = torch.round(v[idx] / dt.unsqueeze(-1))
        ok = ((ct >= -128) & (ct <= 127)).all(-1) & (ct * dt.unsqueeze(-1) == v[idx]).all(-1)
        hit = tuple(i[ok] for i in idx)
        d[hit], c[hit] = dt[ok], ct[ok].to(torch.int8)
        todo[hit] = False
    return (d, c) if not bool(todo.any()) else None


def _header(scale: torch.Tensor, offset: torch.Tensor | None, form: ScaleForm | None, g: int
            ) -> tuple[ScaleForm, torch.Tensor] | None:
    """[N, R, header bytes] uint8 in `form` (None: the smallest exact one), or None where `form` is not exact."""
    n, groups = scale.shape
    parts = [scale.float().reshape(n, groups // g, g)]
    if offset is not None:
        parts.append(offset.float().reshape(n, groups // g, g))
    if form in (None, ScaleForm.I8):
        factored = [_factor(p) for p in parts]
        if all(f is not None for f in factored):
            ds = [f[0].unsqueeze(-1).contiguous().view(torch.uint8) for f in factored]
            cs = [f[1].view(torch.uint8) for f in factored]
            return ScaleForm.I8, torch.cat([*ds, *cs], dim=-1)
        if form is ScaleForm.I8:
            return None
    if form in (None, ScaleForm.F16):
        halves = [p.half() for p in parts]
        if all(torch.equal(h.float(), p) for h, p in zip(halves, parts, strict=True)):
            return ScaleForm.F16, torch.cat([h.contiguous().view(torch.uint8) for h in halves], dim=-1)
        if form is ScaleForm.F16:
            return None
    return ScaleForm.F32, torch.cat([p.contiguous().view(torch.uint8) for p in parts], dim=-1)


def _pack_blocks(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [N, K] -> [N, K/32, block bytes] uint8 (the C file's block layouts)."""
    n, k = q.shape
    b = q.to(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    if bits == 8:
        return (b.to(torch.int16) - 128).to(torch.int8).view(torch.uint8)
    low = b[..., :16] & 15 | (b[..., 16:] & 15) << 4
    high = (b >> 4).reshape(n, k // BLOCK, 4, 8)  # [.., e // 8, e % 8]
    if bits == 5:  # element e at bit e: byte e // 8, bit e % 8
        shifts = torch.arange(8, dtype=torch.uint8)
        hb = (high << shifts).sum(-1, dtype=torch.uint8)
    else:  # element e in byte e % 8 at bit 2 (e // 8)
        shifts = (2 * torch.arange(4, dtype=torch.uint8)).unsqueeze(-1)
        hb = (high << shifts).sum(-2, dtype=torch.uint8)
    return torch.cat([low, hb], dim=-1)


def pack_bits_cpu(codes: torch.Tensor, bits: int, scale: torch.Tensor, offset: torch.Tensor | None,
                  form: ScaleForm | None = None) -> BitsCPU:
    """Codes [N, K] uint8 in [0, 2^bits), scale (and offset) [N, K / group] -> the CPU form. `form` None picks
    the smallest exact scale form; a named form that is not exact raises ValueError."""
    n, k = codes.shape
    if bits not in _BLOCK_BYTES:
        raise ValueError(f"bits must be 5, 6 or 8, got {bits}")
    group = k // scale.shape[1] if scale.shape[1] else 0
    if group not in (16, 32) or k % BLOCK or group * scale.shape[1] != k:
        raise ValueError(f"scale groups must be 16 or 32 columns of K (a multiple of 32): K {k}, {scale.shape[1]} groups")
    if offset is not None and offset.shape != scale.shape:
        raise ValueError(f"offset shape {tuple(offset.shape)} differs from scale's {tuple(scale.shape)}")
    if int(codes.max()) >= 1 << bits:
        raise ValueError(f"codes exceed {bits} bits")
    p = _blocks_per_record(k)
    made = _header(scale, offset, form, p * BLOCK // group)
    if made is None:
        raise ValueError(f"the scales (or offsets) are not exact in {form.name}")
    form, head = made
    blocks = _pack_blocks(codes, bits).reshape(n, k // (BLOCK * p), -1)
    data = torch.cat([head, blocks], dim=-1).reshape(n, -1).contiguous()
    return BitsCPU(data, bits, group, k, form, offset is not None, p)


def unpack_bits_cpu(w: BitsCPU) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The twin of pack_bits_cpu: (codes [N, K] uint8, scale [N, K/g] fp32, offset [N, K/g] fp32 | None)."""
    n, g, parts = w.n, w.groups, 1 + w.has_offset
    rec = w.data.reshape(n, -1, w.record_bytes)
    head, body = rec[..., :w.header_bytes], rec[..., w.header_bytes:].reshape(n, -1, _BLOCK_BYTES[w.bits])
    if w.form is ScaleForm.I8:
        d = head[..., :4 * parts].contiguous().view(torch.float32)  # [N, R, parts]
        c = head[..., 4 * parts:].contiguous().view(torch.int8).reshape(n, -1, parts, g).float()
        vals = d.unsqueeze(-1) * c
    else:
        dtype = torch.float32 if w.form is ScaleForm.F32 else torch.float16
        vals = head.contiguous().view(dtype).reshape(n, -1, parts, g).float()
    scale = vals[..., 0, :].reshape(n, -1)
    offset = vals[..., 1, :].reshape(n, -1) if w.has_offset else None
    if w.bits == 8:
        q = (body.view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    else:
        low = torch.cat([body[..., :16] & 15, body[..., :16] >> 4], dim=-1)
        hb = body[..., 16:]
        if w.bits == 5:
            bit = torch.arange(32)
            high = (hb[..., bit // 8] >> (bit % 8).to(torch.uint8)) & 1
        else:
            e = torch.arange(32)
            high = (hb[..., e % 8] >> (2 * (e // 8)).to(torch.uint8)) & 3
        q = low | high << 4
    return q.reshape(n, w.k), scale, offset


# ---- kernels -------------------------------------------------------------------------------------------


def _args(w: BitsCPU) -> tuple[int, ...]:
    return w.bits, w.group, int(w.form), int(w.has_offset), w.blocks, w.k, w.n


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed (code {rc}: bits 5 / 6 / 8, groups of 16 / 32, K a multiple of 32)")


def bits_matmul(x: torch.Tensor, w: BitsCPU) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32 (x rounded to int8 per 32 columns, as round_activations)."""
    x = x.contiguous().float()
    if x.shape[-1] != w.k:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {w.k}")
    out = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    rc = cpu_gemv._lib().ab_bits_matmul(x.data_ptr(), x.shape[0], w.data.data_ptr(), *_args(w), out.data_ptr(),
                                        cpu_gemv.threads())
    _check(rc, "bits_matmul")
    return out


def bits_dequant(w: BitsCPU) -> torch.Tensor:
    """[N, K] fp32, equal to the reference's (and so to GGUF's dequantisation where the weight came from one)."""
    out = torch.empty(w.n, w.k, dtype=torch.float32)
    _check(cpu_gemv._lib().ab_bits_dequant(w.data.data_ptr(), *_args(w), out.data_ptr(), cpu_gemv.threads()),
           "bits_dequant")
    return out


def bits_rows(w: BitsCPU, rows: torch.Tensor) -> torch.Tensor:
    """Dense fp32 rows of the weight (an embedding lookup): a row is its own stream, so this dequantises just
    the rows asked for."""
    idx = rows.reshape(-1).to(torch.int64)
    picked = BitsCPU(w.data[idx].contiguous(), w.bits, w.group, w.k, w.form, w.has_offset, w.blocks)
    return bits_dequant(picked).reshape(*rows.shape, w.k)


# ---- torch twins ---------------------------------------------------------------------------------------


def bits_dequant_ref(w: BitsCPU) -> torch.Tensor:
    q, scale, offset = unpack_bits_cpu(w)
    s = scale.repeat_interleave(w.group, 1)
    if offset is None:
        return (q.float() - float(1 << (w.bits - 1))) * s
    return q.float() * s + offset.repeat_interleave(w.group, 1)


def bits_matmul_ref(x: torch.Tensor, w: BitsCPU) -> torch.Tensor:
    q, scale, offset = unpack_bits_cpu(w)
    xq, d = quantize_activations_ref(x)  # [M, K/32, 32], [M, K/32]
    m, per = x.shape[0], BLOCK // w.group
    xg = xq.reshape(m, -1, w.group)
    dg = d.repeat_interleave(per, 1)  # per scale group
    qf = q.float().reshape(w.n, -1, w.group)
    if offset is None:
        qf = qf - float(1 << (w.bits - 1))
    dots = torch.einsum("mgj,ngj->mng", xg, qf)  # integer-valued group dots
    out = (dots * dg.unsqueeze(1) * scale.unsqueeze(0)).sum(-1)
    if offset is not None:
        out = out + (xg.sum(-1) * dg) @ offset.t()
    return out
