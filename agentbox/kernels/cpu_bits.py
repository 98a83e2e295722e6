"""k-bit (2, 3, 5, 6, 8) weights on AVX2 CPUs (cpu_bits.c, built into cpu_gemv's library), and their torch twins.

The form is the shared k-bit contract (layers/quant/gguf.py `bits_groups`): codes q in [0, 2^bits) per
element, per (row, group of 16 or 32 columns) a scale and optionally an offset; w = q * scale + offset, or
w = (q - 2^(bits-1)) * scale without offsets. `pack_bits_cpu` lays a weight out as one byte stream per row
(see the C file): records of 8 blocks of 32 columns (a row's last may be shorter), each a header of its
scales then its codes (planes of high bits, nibble pairs; or int8). Scales are kept in the smallest form that
holds them exactly:

- U4: one fp32 per record and 4-bit multiples of it, two a byte (Q2_K's d * sc and -dmin * m): Q2_K 2.75 bits
  per weight (its file: 2.625, fp16 d and dmin);
- I8: one fp32 per record and int8 multiples of it (the K-quants: Q5_K's d * sc and dmin * m, Q6_K's
  d * sc, over GGUF's 256-column super-blocks): Q5_K 5.75 bits per weight (its file: 5.5), Q6_K 6.625 (6.5625),
  Q3_K 3.625 (3.4375: 6-bit scales in a byte each);
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
from agentbox.kernels.huge_pages import huge

__all__ = ["BitsCPU", "ScaleForm", "bits_dequant", "bits_dequant_ref", "bits_matmul", "bits_matmul_ref",
           "bits_rows", "pack_bits_cpu", "resident_bytes", "round_activations", "unpack_bits_cpu"]

RECORD = 8  # 32-column blocks per record: 256 columns, a GGUF K-quant super-block; a row's last may have fewer


class ScaleForm(enum.IntEnum):  # values are cpu_bits.c's; a larger value holds a record in fewer bytes
    F32 = 0
    F16 = 1
    I8 = 2
    U4 = 3


@dataclass(frozen=True)
class BitsCPU:
    data: torch.Tensor  # [N, row_bytes] uint8: the rows' streams
    bits: int
    group: int  # 16 or 32 columns per scale
    k: int
    form: ScaleForm
    has_offset: bool

    @property
    def n(self) -> int:
        return self.data.shape[0]

    def records(self) -> list[int]:
        """Blocks in each record of a row."""
        nb = self.k // BLOCK
        return [RECORD] * (nb // RECORD) + ([nb % RECORD] if nb % RECORD else [])

    def header_bytes(self, p: int) -> int:
        g, parts = p * BLOCK // self.group, 1 + self.has_offset
        return {ScaleForm.F32: 4 * g, ScaleForm.F16: 2 * g, ScaleForm.I8: 4 + g, ScaleForm.U4: 4 + (g + 1) // 2}[self.form] * parts

    def body_bytes(self, p: int) -> int:
        if self.bits <= 3:
            return _plane_bytes(self.bits, p)
        return 32 * p if self.bits == 8 else _plane_bytes(self.bits, p) + 32 * ((p + 1) // 2)


def _plane_bytes(bits: int, p: int) -> int:
    """A record's bytes of bit planes: 1-bit (5 bits' high bit, 3 bits' top bit: 16 bytes for 4 blocks or
    fewer) and 2-bit ones (6 bits' high bits, the low bits of 2 and 3: 32 bytes per 4 blocks)."""
    one, two = (32 if p > 4 else 16), 32 * ((p + 3) // 4)
    return {5: one, 6: two, 2: two, 3: two + one}[bits]


def _one_plane(bit: torch.Tensor) -> torch.Tensor:
    """[N, R, p, 32] bits -> [N, R, 32 or 16] bytes, byte e: bit j = block j's element e (16 bytes for p <= 4:
    element j + 16's bits in byte j's high nibble)."""
    p = bit.shape[2]
    planes = (bit << torch.arange(p, dtype=torch.uint8).view(p, 1)).sum(2, dtype=torch.uint8)
    return planes[..., :16] | planes[..., 16:] << 4 if p <= 4 else planes


def _two_planes(pairs: torch.Tensor) -> torch.Tensor:
    """[N, R, p, 32] 2-bit values -> [N, R, 32 per 4 blocks] bytes, byte e: bits 2j, 2j + 1 = block 4i + j's."""
    n, r, p, _ = pairs.shape
    quads = -(-p // 4) * 4
    pad = torch.zeros(n, r, quads - p, BLOCK, dtype=torch.uint8)
    pairs = torch.cat([pairs, pad], dim=2).reshape(n, r, -1, 4, BLOCK)
    return (pairs << (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)).sum(3, dtype=torch.uint8).reshape(n, r, -1)


def _unplane_one(planes: torch.Tensor, p: int) -> torch.Tensor:
    plane = planes if p > 4 else torch.cat([planes & 15, planes >> 4], dim=-1)
    return (plane.unsqueeze(2) >> torch.arange(p, dtype=torch.uint8).view(p, 1)) & 1


def _unplane_two(planes: torch.Tensor, p: int) -> torch.Tensor:
    n, r = planes.shape[:2]
    j = torch.arange(p)
    planes = planes.reshape(n, r, -1, BLOCK)
    return (planes[:, :, j // 4] >> (2 * (j % 4)).to(torch.uint8).view(p, 1)) & 3


def resident_bytes(w: BitsCPU) -> int:
    return w.data.numel() * w.data.element_size()


def _factor(v: torch.Tensor, unsigned4: bool = False) -> tuple[torch.Tensor, torch.Tensor] | None:
    """v [..., G] fp32 as d [...] fp32 times c [..., G] int8, exactly, or None. The largest |v| is t * d for
    some t <= 128; trying t from 128 down settles GGUF's own records at once (its quantisers put the largest
    sub-scale at -128 for Q6_K, 63 for Q5_K: t = 126 with d / 2). `unsigned4`: c in 0..15 (t <= 15), d taking
    the sign the record's values share (Q2_K's offsets -dmin * m are all <= 0)."""
    flat = v.reshape(-1, v.shape[-1])
    amax = flat.abs().amax(-1)
    if unsigned4:
        if ((flat > 0).any(-1) & (flat < 0).any(-1)).any():
            return None
        amax = torch.where(flat.amin(-1) < 0, -amax, amax)  # d carries the sign
    lo, hi, top = (0, 15, 15) if unsigned4 else (-128, 127, 128)
    d = torch.zeros_like(amax)
    c = torch.zeros(flat.shape, dtype=torch.int8)
    todo = (amax != 0).nonzero().squeeze(1)
    for t in range(top, 0, -1):
        if len(todo) == 0:
            break
        vals, dt = flat[todo], amax[todo] / t
        ct = torch.round(vals / dt.unsqueeze(-1))
        ok = ((ct >= lo) & (ct <= hi) & (ct * dt.unsqueeze(-1) == vals)).all(-1)
        d[todo[ok]], c[todo[ok]] = dt[ok], ct[ok].to(torch.int8)
        todo = todo[~ok]
    return None if len(todo) else (d.reshape(v.shape[:-1]), c.reshape(v.shape))


def _pack_nibbles(c: torch.Tensor) -> torch.Tensor:
    """[..., G] values 0..15 -> [..., ceil(G / 2)] bytes, byte i: element 2i low, 2i + 1 high."""
    c = c.view(torch.uint8)
    if c.shape[-1] % 2:
        c = torch.cat([c, torch.zeros_like(c[..., :1])], dim=-1)
    return c[..., 0::2] | c[..., 1::2] << 4


def _unpack_nibbles(b: torch.Tensor, g: int) -> torch.Tensor:
    return torch.stack([b & 15, b >> 4], dim=-1).reshape(*b.shape[:-1], -1)[..., :g]


def _header(parts: list[torch.Tensor], form: ScaleForm) -> torch.Tensor | None:
    """Scale (and offset) [N, R, G] fp32 -> [N, R, header bytes] uint8 in `form`, or None where not exact."""
    if form in (ScaleForm.I8, ScaleForm.U4):
        # a few rows first: per-group fp16 scales (Q5_0 / Q5_1 / Q8_0) never factor, and proving that costs
        # all 128 tries per record (3 s for 16 M weights)
        u4 = form is ScaleForm.U4
        if any(_factor(p[:2, :4], u4) is None for p in parts):
            return None
        factored = [_factor(p, u4) for p in parts]
        if any(f is None for f in factored):
            return None
        ds = [f[0].unsqueeze(-1).contiguous().view(torch.uint8) for f in factored]
        cs = [_pack_nibbles(f[1]) if u4 else f[1].view(torch.uint8) for f in factored]
        return torch.cat([*ds, *cs], dim=-1)
    if form is ScaleForm.F16:
        halves = [p.half() for p in parts]
        if not all(torch.equal(h.float(), p) for h, p in zip(halves, parts, strict=True)):
            return None
        return torch.cat([h.contiguous().view(torch.uint8) for h in halves], dim=-1)
    return torch.cat([p.contiguous().view(torch.uint8) for p in parts], dim=-1)


def _body(b: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes [N, R, p, 32] uint8 -> [N, R, body bytes] (the C file's record bodies)."""
    n, r, p, _ = b.shape
    if bits == 8:
        return (b.to(torch.int16) - 128).to(torch.int8).view(torch.uint8).reshape(n, r, -1)
    if bits == 2:
        return _two_planes(b)
    if bits == 3:
        return torch.cat([_two_planes(b & 3), _one_plane(b >> 2)], dim=-1)
    nib = b & 15
    if p % 2:
        nib = torch.cat([nib, torch.zeros_like(nib[:, :, :1])], dim=2)
    pairs = (nib[:, :, 0::2] | nib[:, :, 1::2] << 4).reshape(n, r, -1)
    high = b >> 4
    if bits == 5:  # byte e: bit j = block j's high bit
        planes = (high << torch.arange(p, dtype=torch.uint8).view(p, 1)).sum(2, dtype=torch.uint8)
        if p <= 4:  # a short record's plane in 16 bytes: element j + 16's bits in byte j's high nibble
            planes = planes[..., :16] | planes[..., 16:] << 4
    else:  # a plane per four blocks, byte e: bits 2j, 2j + 1 = block 4i + j
        quads = -(-p // 4) * 4
        pad = torch.zeros(n, r, quads - p, BLOCK, dtype=torch.uint8)
        high = torch.cat([high, pad], dim=2).reshape(n, r, -1, 4, BLOCK)
        planes = (high << (2 * torch.arange(4, dtype=torch.uint8)).view(4, 1)).sum(3, dtype=torch.uint8)
    return torch.cat([planes.reshape(n, r, -1), pairs], dim=-1)


def _chunks(k: int) -> list[tuple[int, int, int]]:
    """(first block, records, blocks each) of a row: full records, then the last shorter one."""
    nb = k // BLOCK
    out = [(0, nb // RECORD, RECORD)] if nb >= RECORD else []
    return out + ([(nb // RECORD * RECORD, 1, nb % RECORD)] if nb % RECORD else [])


def pack_bits_cpu(codes: torch.Tensor, bits: int, scale: torch.Tensor, offset: torch.Tensor | None,
                  form: ScaleForm | None = None) -> BitsCPU:
    """Codes [N, K] uint8 in [0, 2^bits), scale (and offset) [N, K / group] -> the CPU form. `form` None picks
    the smallest exact scale form (I8, then F16, then F32); a named form that is not exact raises ValueError."""
    n, k = codes.shape
    if bits not in (2, 3, 5, 6, 8):
        raise ValueError(f"bits must be 2, 3, 5, 6 or 8, got {bits}")
    group = k // scale.shape[1] if scale.shape[1] else 0
    if group not in (16, 32) or k % BLOCK or group * scale.shape[1] != k:
        raise ValueError(f"scale groups must be 16 or 32 columns of K (a multiple of 32): K {k}, {scale.shape[1]} groups")
    if bits <= 3 and group != 16:  # GGUF Q2_K / Q3_K's groups: the kernel is built for those alone
        raise ValueError(f"{bits}-bit codes take scale groups of 16 columns, got {group}")
    if offset is not None and offset.shape != scale.shape:
        raise ValueError(f"offset shape {tuple(offset.shape)} differs from scale's {tuple(scale.shape)}")
    if int(codes.max()) >= 1 << bits:
        raise ValueError(f"codes exceed {bits} bits")
    per = BLOCK // group  # groups per block
    q = codes.to(torch.uint8).reshape(n, -1, BLOCK)
    tables = [t.float() for t in (scale, offset) if t is not None]
    for candidate in [form] if form is not None else list(reversed(ScaleForm)):
        heads = []
        for first, recs, p in _chunks(k):
            span = slice(first * per, (first + recs * p) * per)
            heads.append(_header([t[:, span].reshape(n, recs, p * per) for t in tables], candidate))
        if all(h is not None for h in heads):
            break
    else:
        raise ValueError(f"the scales (or offsets) are not exact in {form.name if form else 'any form'}")
    rows = []
    for head, (first, recs, p) in zip(heads, _chunks(k), strict=True):
        body = _body(q[:, first:first + recs * p].reshape(n, recs, p, BLOCK), bits)
        rows.append(torch.cat([head, body], dim=-1).reshape(n, -1))
    w = BitsCPU(huge(torch.cat(rows, dim=1).contiguous()), bits, group, k, candidate, offset is not None)
    expect = cpu_gemv._lib().ab_bits_row_bytes(bits, group, int(candidate), int(offset is not None), k)
    if w.data.shape[1] != expect:  # the two sides of the layout disagree: a bug here, not bad input
        raise RuntimeError(f"packed {w.data.shape[1]} bytes a row, cpu_bits.c reads {expect}")
    return w


def unpack_bits_cpu(w: BitsCPU) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The twin of pack_bits_cpu: (codes [N, K] uint8, scale [N, K/g] fp32, offset [N, K/g] fp32 | None)."""
    n, parts, per = w.n, 1 + w.has_offset, BLOCK // w.group
    at, codes, tables = 0, [], []
    for _, recs, p in _chunks(w.k):
        hb, bb, g = w.header_bytes(p), w.body_bytes(p), p * per
        rec = w.data[:, at:at + recs * (hb + bb)].reshape(n, recs, hb + bb)
        at += recs * (hb + bb)
        head, body = rec[..., :hb], rec[..., hb:]
        if w.form in (ScaleForm.I8, ScaleForm.U4):
            d = head[..., :4 * parts].contiguous().view(torch.float32)  # [N, R, parts]
            if w.form is ScaleForm.U4:
                packed = head[..., 4 * parts:].reshape(n, recs, parts, (g + 1) // 2)
                c = _unpack_nibbles(packed, g).float()
            else:
                c = head[..., 4 * parts:].contiguous().view(torch.int8).reshape(n, recs, parts, g).float()
            vals = d.unsqueeze(-1) * c
        else:
            dtype = torch.float32 if w.form is ScaleForm.F32 else torch.float16
            vals = head.contiguous().view(dtype).reshape(n, recs, parts, g).float()
        tables.append(vals.transpose(1, 2).reshape(n, parts, -1))
        if w.bits == 8:
            q = (body.view(torch.int8).to(torch.int16) + 128).to(torch.uint8).reshape(n, recs, p, BLOCK)
        elif w.bits <= 3:
            two = 32 * ((p + 3) // 4)
            q = _unplane_two(body[..., :two], p)
            if w.bits == 3:
                q = q | _unplane_one(body[..., two:], p) << 2
        else:
            pb = _plane_bytes(w.bits, p)
            pairs = body[..., pb:].reshape(n, recs, -1, BLOCK)
            low = torch.stack([pairs & 15, pairs >> 4], dim=3).reshape(n, recs, -1, BLOCK)[:, :, :p]
            planes, j = body[..., :pb], torch.arange(p)
            if w.bits == 5:
                plane = planes if p > 4 else torch.cat([planes & 15, planes >> 4], dim=-1)
                high = (plane.unsqueeze(2) >> j.to(torch.uint8).view(p, 1)) & 1
            else:
                planes = planes.reshape(n, recs, -1, BLOCK)
                high = (planes[:, :, j // 4] >> (2 * (j % 4)).to(torch.uint8).view(p, 1)) & 3
            q = low | high << 4
        codes.append(q.reshape(n, -1))
    table = torch.cat(tables, dim=2)
    return torch.cat(codes, dim=1), table[:, 0], table[:, 1] if w.has_offset else None


# ---- kernels -------------------------------------------------------------------------------------------


def _args(w: BitsCPU) -> tuple[int, ...]:
    return w.bits, w.group, int(w.form), int(w.has_offset), w.k, w.n


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed (code {rc}: bits 2 / 3 (groups of 16), 5 / 6 / 8 (16 / 32), K a multiple of 32)")


def bits_matmul(x: torch.Tensor, w: BitsCPU) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32 (x rounded to int8 per 32 columns, as round_activations)."""
    x = x.contiguous().float()
    if x.shape[-1] != w.k:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {w.k}")
    out = torch.empty(x.shape[0], w.n, dtype=torch.float32)
    if x.shape[0] == 0:
        return out
    rc = cpu_gemv._lib().ab_bits_matmul(x.data_ptr(), x.shape[0], w.data.data_ptr(), *_args(w), out.data_ptr(),
                                        cpu_gemv.threads(), 1)
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
    picked = BitsCPU(w.data[idx].contiguous(), w.bits, w.group, w.k, w.form, w.has_offset)
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
