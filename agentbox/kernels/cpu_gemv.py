"""Weight-only 4- and 8-bit matmuls for x86-64 CPUs (cpu_gemv.c), and their torch twins.

The C files are compiled on first use with the system C compiler (as Triton compiles its launchers), one
library per instruction-set variant (`Isa`: AVX-512 + VNNI, AVX-VNNI, AVX2), cached under
~/.cache/agentbox/kernels by variant and the sources' hash, and loaded with ctypes: no torch headers, so a
build takes a few seconds. The variant is picked from /proc/cpuinfo's flags (`pick_isa`); all of them give
the same bits (see cpu_gemv.h). Where there is no compiler, no AVX2/FMA or the build fails, `available()` is
False with the reason in `unavailable_reason()`, and callers keep the dense path.

Layouts (see the C file): rows in tiles of four, block by block. Q4 codes [N/4, K/32, 2, 4, 8] uint8 (half h,
row r, byte i: two elements, in the order q4_dot reads them: `Q4_LOW` / `Q4_HIGH`) and `so` [N/4, K/group,
2, 4] (a tile's scales, then its offsets), fp32,
or fp16 where that loses nothing (`exact_half`); Q8 codes [N/4, K/32, 4, 32] int8 and scales [N/4, K/32, 4]
(fp16 where exact). `pack_q4` / `pack_q8` build them from rows; every kernel takes the true N. The twins quantise the
activations exactly as the kernel does (per 32, d = max|x| / 127, round half to even) so kernel and twin
agree to fp32 summation order; `round_activations` + the dequantised weight gives the same numbers for
callers with many rows (prefill), where one sgemm beats the kernel.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_gemv.c")
# one library; cpu_gemv.h: shared
SOURCES = tuple(SOURCE.with_name(n) for n in ("cpu_gemv.c", "cpu_decode.c", "cpu_bits.c", "cpu_bits_dequant.c",
                                              "cpu_hybrid.c", "cpu_moe.c", "cpu_bits_amx.c",
                                              "cpu_q4_amx.c", "cpu_rows.c", "cpu_bits_q8z.c", "cpu_kbits_amx.c"))
BLOCK = 32
# fp-contract off: every variant must round the same products the same way (a fused a * b + c is one rounding)
FLAGS = ("-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
_c_i64, _c_ptr, _c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class Isa(enum.Enum):
    """The library's variants, best first; the value is the name the built library reports (AB_ISA)."""

    AVX512_AMX = "avx512-amx"  # avx512-vnni, plus AMX int8 tiles for many-row 8- and 4-bit products (cpu_*_amx.c)
    AVX512_VNNI = "avx512-vnni"  # vpdpbusd on 256-bit vectors (EVEX), 32 vector registers
    AVX_VNNI = "avx-vnni"  # vpdpbusd (VEX): AVX2 laptops and desktops since Alder Lake, Zen 5
    AVX2 = "avx2"  # vpmaddubsw + vpmaddwd, as llama.cpp's AVX2 dot products

    @property
    def cc_flags(self) -> tuple[str, ...]:
        base = ("-mavx2", "-mfma", "-mf16c")
        avx512 = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
        return base + {Isa.AVX2: (), Isa.AVX_VNNI: ("-mavxvnni",), Isa.AVX512_VNNI: avx512,
                       Isa.AVX512_AMX: (*avx512, "-mamx-tile", "-mamx-int8", "-mamx-bf16")}[self]

    @property
    def cpu_flags(self) -> frozenset[str]:
        """/proc/cpuinfo flags the variant needs."""
        base = {"avx2", "fma", "f16c"}
        avx512 = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
        return frozenset(base | {Isa.AVX2: set(), Isa.AVX_VNNI: {"avx_vnni"}, Isa.AVX512_VNNI: avx512,
                                 Isa.AVX512_AMX: avx512 | {"amx_tile", "amx_int8", "amx_bf16"}}[self])


def pick_isa(flags: set[str] | frozenset[str]) -> Isa | None:
    """The best variant a CPU with these /proc/cpuinfo flags runs, or None (no AVX2 + FMA + F16C). The AMX variant
    runs where the OS also grants the tile state; where it does not, its many-row 8- and 4-bit products take its
    VNNI kernels (cpu_bits_amx.c, cpu_q4_amx.c)."""
    return next((isa for isa in Isa if isa.cpu_flags <= flags), None)


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "agentbox" / "kernels"


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def build(isa: Isa) -> tuple[Path | None, str]:
    """(the variant's shared library, "") or (None, why): compiled once per variant and source digest."""
    return compile_cached(f"cpu_gemv-{isa.value}", SOURCES, (*FLAGS, *isa.cc_flags),
                          hashed=tuple(SOURCE.with_name(h) for h in ("cpu_gemv.h", "cpu_bits_layout.h",
                                                             "cpu_decode_attention.h", "amx_tiles.h", "amx_blocks.h")),
                          label=f"{SOURCE.name} ({isa.value})")


def compile_cached(name: str, sources: Sequence[Path], flags: Sequence[str],
                   hashed: Sequence[Path] = (), label: str = "") -> tuple[Path | None, str]:
    """(a shared library of `sources`, "") or (None, why): built once per digest of the sources, `hashed` (headers)
    and flags, under the user's cache directory. Shared by every kernels/cpu_*.c."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc / gcc) on PATH"
    source = b"".join(p.read_bytes() for p in (*sources, *hashed))
    digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: tensor-parallel workers may build at the same moment.
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        result = subprocess.run([cc, *flags, *map(str, sources), "-o", str(partial), "-lm"], capture_output=True,
                                text=True)
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            return None, f"building {label or sources[0].name} failed: {result.stderr.strip()[:300]}"
        partial.replace(target)
    return target, ""


@functools.cache
def load(isa: Isa) -> tuple[ctypes.CDLL | None, str]:
    """The variant's library with its signatures declared, or (None, why). Loading a variant the CPU lacks
    is allowed (a test may compile one), calling into it is not: `_library` only loads `pick_isa`'s."""
    target, why = build(isa)
    if target is None:
        return None, why
    lib = ctypes.CDLL(str(target))
    lib.ab_isa.restype = ctypes.c_char_p
    lib.ab_q4_matmul.argtypes = [_c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_ptr, _c_int, _c_int, _c_int]
    lib.ab_q8_matmul.argtypes = [_c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_i64, _c_ptr, _c_int, _c_int]
    lib.ab_q4_dequant.argtypes = [_c_ptr, _c_ptr, _c_i64, _c_i64, _c_i64, _c_ptr, _c_int, _c_int]
    lib.ab_q8_rows.argtypes = [_c_ptr, _c_ptr, _c_i64, _c_ptr, _c_i64, _c_ptr, _c_int]
    lib.ab_q4_rows.argtypes = [_c_ptr, _c_ptr, _c_i64, _c_i64, _c_ptr, _c_i64, _c_ptr, _c_int]
    # (layer*, dims*, hidden, residual, first, m, positions, slots, page_table, stride, page_size, kv_lens, threads)
    lib.ab_decode_layer.argtypes = [_c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_int, _c_i64, _c_ptr, _c_ptr, _c_ptr, _c_i64,
                                    _c_i64, _c_ptr, _c_int]
    # cpu_bits.c: (x, m, w, bits, group, form, offset, k, n, out, threads) / (w, ..., n, out, threads)
    lib.ab_bits_matmul.argtypes = [_c_ptr, _c_i64, _c_ptr, *[_c_int] * 4, _c_i64, _c_i64, _c_ptr, _c_int, _c_int]
    lib.ab_bits_dequant.argtypes = [_c_ptr, *[_c_int] * 4, _c_i64, _c_i64, _c_ptr, _c_int]
    lib.ab_bits_row_bytes.argtypes = [*[_c_int] * 4, _c_i64]
    lib.ab_bits_row_bytes.restype = _c_i64
    # cpu_hybrid.c: (x, m, k, w fp16 / bf16, n, out, threads); (layer*, dims*, step*, hidden, residual, first, m, threads)
    lib.ab_f16_matmul.argtypes = [_c_ptr, _c_i64, _c_i64, _c_ptr, _c_i64, _c_ptr, _c_int]
    lib.ab_bf16_matmul.argtypes = lib.ab_f16_matmul.argtypes
    lib.ab_hybrid_layer.argtypes = [_c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_int, _c_i64, _c_int]
    # (q, k, v, g, beta, state in / out, out, pairs, tokens, dk, dv, threads)
    lib.ab_delta_rule.argtypes = [*[_c_ptr] * 7, *[_c_i64] * 4, _c_int]
    # (mixed, b, a, len, C, conv_w, K, conv_state, A_log, dt_bias, Hk, Hv, Dk, Dv, state, out, threads)
    lib.ab_delta_net_chunk.argtypes = [_c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_ptr, _c_i64, _c_ptr, _c_ptr, _c_ptr,
                                       *[_c_i64] * 4, _c_ptr, _c_ptr, _c_int]
    # cpu_decode.c's KV store, for its test: (cache, f16, at, src fp32, n)
    lib.ab_store_kv.argtypes = [_c_ptr, _c_int, _c_i64, _c_ptr, _c_i64]
    lib.ab_store_kv.restype = None
    # cpu_decode.c's paged attention (the hybrid's too), for its test: (k, v, kv_f16, heads, kv heads, head size, scale,
    # qkv rows, m, page table, its stride, page size, kv lens, out, threads)
    lib.ab_attend.argtypes = [_c_ptr, _c_ptr, _c_int, _c_i64, _c_i64, _c_i64, ctypes.c_float, _c_ptr, _c_i64, _c_ptr,
                              _c_i64, _c_i64, _c_ptr, _c_ptr, _c_int]
    lib.ab_moe_routed.argtypes = [_c_ptr, _c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_ptr, _c_int]  # cpu_moe.c
    lib.ab_argmax.argtypes = [_c_ptr, _c_i64, _c_i64, _c_ptr]  # (logits fp32, rows, n, out int64)
    lib.ab_silu_mul_rows.argtypes = [_c_ptr, _c_i64, _c_i64, _c_ptr, _c_int]  # ([gate | up] rows, m, in, out, threads)
    lib.ab_silu_mul_rows.restype = None
    lib.ab_argmax.restype = None
    for f in (lib.ab_q4_matmul, lib.ab_q8_matmul, lib.ab_decode_layer, lib.ab_attend, lib.ab_bits_matmul, lib.ab_bits_dequant,
              lib.ab_f16_matmul, lib.ab_bf16_matmul, lib.ab_hybrid_layer, lib.ab_delta_rule,
              lib.ab_delta_net_chunk, lib.ab_moe_routed):
        f.restype = _c_int
    return lib, ""


_override: Isa | None = None


@contextlib.contextmanager
def use_isa(isa: Isa) -> Iterator[None]:
    """Kernels called inside run `isa`'s build (tests compare the variants this CPU runs)."""
    if not isa.cpu_flags <= cpu_flags():
        raise ValueError(f"this CPU lacks {', '.join(sorted(isa.cpu_flags - cpu_flags()))} for the {isa.value} kernels")
    global _override
    previous, _override = _override, isa
    try:
        yield
    finally:
        _override = previous


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The best variant this CPU runs that builds (a compiler too old for -mavxvnni keeps the AVX2 one)."""
    runnable = [i for i in Isa if i.cpu_flags <= cpu_flags()]
    if not runnable:
        return None, f"this CPU lacks {', '.join(sorted(Isa.AVX2.cpu_flags - cpu_flags()))}"
    why = ""
    for variant in runnable:
        lib, why = load(variant)
        if lib is not None:
            return lib, ""
    return None, why  # the AVX2 build's reason: the others need what it needs


def isa() -> Isa | None:
    """The variant the kernels run on this CPU (None where they are unavailable)."""
    if _override is not None:
        return _override
    lib = _library()[0]
    return None if lib is None else Isa(lib.ab_isa().decode())


def passed_over() -> list[tuple[Isa, str]]:
    """The variants better than the one picked, each with why it was not: the CPU lacks its flags, or it did
    not build here (a build is only tried where the CPU has the flags)."""
    picked, out = isa(), []
    for variant in Isa:
        if variant is picked:
            break
        missing = variant.cpu_flags - cpu_flags()
        out.append((variant, f"the CPU lacks {' '.join(sorted(missing))}" if missing
                    else f"{load(variant)[1]} (a newer C compiler builds it)"))
    return out


def describe() -> str:
    """One line for `agentbox doctor` and the serve log: the variant, the CPU, its flags that matter, and why
    each better variant was not picked."""
    picked = isa()
    flags = " ".join(f for f in ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni") if f in cpu_flags())
    why_not = "".join(f"; not {variant.value}: {why}" for variant, why in passed_over())
    if picked is Isa.AVX512_AMX and not _lib().ab_bits_amx_ready():  # the request the first tile call makes anyway
        why_not += "; AMX tiles refused by the OS (Linux 5.16+ grants them): its VNNI kernels run"
    if picked is None:
        return f"unavailable ({unavailable_reason()}): quantised layers are dequantised ({cpu_model()}; {flags or 'no AVX2'})"
    return f"{picked.value} ({cpu_model()}; {flags}{why_not})"


def available() -> bool:
    return _library()[0] is not None


def unavailable_reason() -> str:
    return _library()[1]


def _lib() -> ctypes.CDLL:
    lib, why = load(_override) if _override is not None else _library()
    if lib is None:
        raise RuntimeError(f"the CPU weight-only kernels are unavailable: {why}")
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed (code {rc}: shapes must be multiples of {BLOCK})")


# ---- packing ----------------------------------------------------------------------------------------

TILE = 4  # weight rows per tile (NR in the C file)
# A Q4 row's byte i of half h holds elements 16 h + Q4_LOW[i] (low nibble) and 16 h + Q4_HIGH[i] (high) of its
# block; odd rows of a tile swap the two nibbles (the C file's layout comment says why).
Q4_LOW = (0, 1, 2, 3, 8, 9, 10, 11)
Q4_HIGH = (4, 5, 6, 7, 12, 13, 14, 15)


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[N, G, ...] -> [ceil(N/4), G, 4, ...]: rows grouped in fours (zero rows pad the last tile)."""
    pad = -t.shape[0] % TILE
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.reshape(-1, TILE, *t.shape[1:]).transpose(1, 2).contiguous()


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `_tiles`: [T, G, 4, ...] -> [N, G, ...]."""
    return t.transpose(1, 2).reshape(-1, *t.shape[1:2], *t.shape[3:])[:n]


def exact_half(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """fp16 copies when all of them hold the same numbers in fp16 (GGUF Q4_0 / Q4_1 / Q8_0: the file's own
    fp16 d and m; 4 bytes less per 32 weights, 20 % of a Q4 layer's bytes), else fp32."""
    halves = tuple(t.half() for t in tensors)
    if all(torch.equal(h.float(), t.float()) for h, t in zip(halves, tensors, strict=True)):
        return halves
    return tuple(t.float() for t in tensors)


def _q4_swap(codes: torch.Tensor) -> torch.Tensor:
    """Codes [T, K/32, 4, 2, 8] with the nibbles of odd rows swapped (its own inverse)."""
    out = codes.clone()
    out[:, :, 1::2] = (codes[:, :, 1::2] >> 4) | (codes[:, :, 1::2] << 4)
    return out


def pack_q4(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, K] (0..15), scale / offset [N, K/g] -> (codes [N/4, K/32, 2, 4, 8] uint8 (see Q4_LOW);
    so [N/4, K/g, 2, 4] fp16 where exact, else fp32)."""
    n, k = q.shape
    halves = q.to(torch.uint8).reshape(n, k // BLOCK, 2, 16)
    nibbles = halves[..., list(Q4_LOW)] | (halves[..., list(Q4_HIGH)] << 4)  # [N, K/32, 2, 8]
    codes = _q4_swap(_tiles(nibbles)).transpose(2, 3).contiguous()  # [T, K/32, 4, 2, 8] -> [T, K/32, 2, 4, 8]
    s, o = exact_half(scale, offset)
    return codes, torch.stack([_tiles(s), _tiles(o)], dim=2).contiguous()


def unpack_q4(codes: torch.Tensor, so: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of pack_q4: (codes [N, K], scale [N, K/g], offset [N, K/g] in so's dtype)."""
    nibbles = _rows(_q4_swap(codes.transpose(2, 3)), n)  # [N, K/32, 2, 8]
    halves = torch.empty(*nibbles.shape[:-1], 16, dtype=torch.uint8)
    halves[..., list(Q4_LOW)] = nibbles & 0x0F
    halves[..., list(Q4_HIGH)] = nibbles >> 4
    return halves.reshape(n, -1), _rows(so[:, :, 0], n), _rows(so[:, :, 1], n)


def pack_q8(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, K/32, 32] int8, scale [N, K/32] -> ([N/4, K/32, 4, 32], [N/4, K/32, 4] fp16 where exact)."""
    (s,) = exact_half(scale)
    return _tiles(codes.to(torch.int8)), _tiles(s)


def unpack_q8(codes: torch.Tensor, scale: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _rows(codes, n), _rows(scale, n)


# ---- kernels -------------------------------------------------------------------------------------------


def threads() -> int:
    return torch.get_num_threads()


def _half(t: torch.Tensor) -> int:
    if t.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"scales must be fp32 or fp16, got {t.dtype}")
    return int(t.dtype == torch.float16)


def q4_matmul(x: torch.Tensor, codes: torch.Tensor, so: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32, with w[n, k] = q * scale[n, k // g] + offset[n, k // g]."""
    x = x.contiguous().float()
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    group = k // so.shape[1]
    rc = _lib().ab_q4_matmul(x.data_ptr(), m, k, codes.data_ptr(), so.data_ptr(), n, group, out.data_ptr(), threads(), _half(so), 1)
    _check(rc, "q4_matmul")
    return out


def q8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32, with w[n, k] = q[n, k] * scale[n, k // 32]."""
    x = x.contiguous().float()
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    rc = _lib().ab_q8_matmul(x.data_ptr(), m, k, codes.data_ptr(), scale.data_ptr(), n, out.data_ptr(), threads(), _half(scale))
    _check(rc, "q8_matmul")
    return out


def argmax_rows(logits: torch.Tensor) -> list[int] | None:
    """Each row's argmax of fp32 logits [B, V] on the CPU (the first index of its maximum), or None where a row
    holds a NaN (torch's max propagates it: the caller asks torch)."""
    x = logits.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    _lib().ab_argmax(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    ids = out.tolist()
    return None if -1 in ids else ids


def q4_dequant(codes: torch.Tensor, so: torch.Tensor, n: int) -> torch.Tensor:
    k = codes.shape[1] * BLOCK
    out = torch.empty(n, k, dtype=torch.float32)
    _lib().ab_q4_dequant(codes.data_ptr(), so.data_ptr(), n, k, k // so.shape[1], out.data_ptr(), threads(), _half(so))
    return out


def q4_rows(codes: torch.Tensor, so: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Dense fp32 rows of a Q4 weight (tiled codes [N/4, K/32, 2, 4, 8]): an embedding lookup, those rows alone."""
    idx = rows.reshape(-1).to(torch.int64).contiguous()
    k = codes.shape[1] * BLOCK
    out = torch.empty(idx.numel(), k, dtype=torch.float32)
    _lib().ab_q4_rows(codes.data_ptr(), so.data_ptr(), k, k // so.shape[1], idx.data_ptr(), idx.numel(), out.data_ptr(),
                      _half(so))
    return out.reshape(*rows.shape, k)


def q8_rows(codes: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Dense fp32 rows of a Q8 weight (tiled codes [N/4, K/32, 4, 32] int8): an embedding lookup."""
    idx = rows.reshape(-1).to(torch.int64).contiguous()
    k = codes.shape[1] * BLOCK
    out = torch.empty(idx.numel(), k, dtype=torch.float32)
    _lib().ab_q8_rows(codes.data_ptr(), scale.data_ptr(), k, idx.data_ptr(), idx.numel(), out.data_ptr(), _half(scale))
    return out.reshape(*rows.shape, k)


# ---- torch twins (they take the packed tensors and read them through the unpackers) ---------------------


def quantize_activations_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(xq [M, K/32, 32] integer-valued fp32, d [M, K/32]): x rounded to d * xq per block of 32."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(blocks * inv.unsqueeze(-1)), d


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernels see it (d * xq): many-row callers multiply this by the dequantised weight,
    so a row's numbers do not depend on how many rows share the call."""
    xq, d = quantize_activations_ref(x)
    return (xq * d.unsqueeze(-1)).reshape(x.shape)


def q4_matmul_ref(x: torch.Tensor, codes: torch.Tensor, so: torch.Tensor, n: int) -> torch.Tensor:
    xq, d = quantize_activations_ref(x)
    q, scale, offset = unpack_q4(codes, so, n)
    nb = q.shape[1] // BLOCK
    sums = (xq.sum(-1) * d).reshape(x.shape[0], scale.shape[1], -1).sum(-1)  # per scale group
    s = scale.float().repeat_interleave(nb // scale.shape[1], 1)  # [N, nb]
    dots = torch.einsum("mbj,nbj->mnb", xq, q.reshape(n, nb, BLOCK).float())  # integer-valued block dots
    return (dots * d.unsqueeze(1) * s.unsqueeze(0)).sum(-1) + sums @ offset.float().t()


def q8_matmul_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, n: int) -> torch.Tensor:
    xq, d = quantize_activations_ref(x)
    c, s = unpack_q8(codes, scale, n)
    dots = torch.einsum("mbj,nbj->mnb", xq, c.float())
    return (dots * d.unsqueeze(1) * s.float().unsqueeze(0)).sum(-1)


def q4_dequant_ref(codes: torch.Tensor, so: torch.Tensor, n: int) -> torch.Tensor:
    q, scale, offset = unpack_q4(codes, so, n)
    g = q.shape[1] // scale.shape[1]
    return (q.reshape(n, -1, g).float() * scale.float().unsqueeze(-1) + offset.float().unsqueeze(-1)).reshape(n, -1)
