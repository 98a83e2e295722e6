"""Causal attention over the paged KV cache on AVX2 (or AVX-512) CPUs (cpu_attention.c), and its torch twin.

Every sequence of a step in one call: a decode token or an extend (a prefill chunk, a warm turn's new
tokens) over its cached prefix, the keys read in place from the pages (no gather, no copy of the history,
no mask), the key range of a long sequence split across the threads and merged by log-sum-exp. Why: a warm
turn on a 128k conversation is ~25 new tokens over 121k keys; torch's fused CPU attention ran it on one
thread in 38-53 ms (the split into runs and a causal tail in prefix_attention.py; ~0.4 GFLOP), and the
gather path copies the whole history per layer.

Built on first use like cpu_gemv's library (the system `cc`, cached under ~/.cache/agentbox/kernels by the
source's digest), its own small library so it builds and loads apart from the weight kernels. `available()`
is False without a compiler, AVX2 + FMA or a successful build (callers keep the torch path); `supports`
says which layers it takes (an fp32 or fp16 cache, head size a multiple of 8 up to 256, no window, no sinks).
An fp16 cache (the default CPU pool, engine/exec/runner.py) is widened to fp32 tile by tile as it is read: a decode
step over a long history is bound by the bytes of keys and values it reads, and fp16 halves them.

Issue 52 (a later agent turn's extend of 300-700 tokens over 3-6k of history is attention-bound) made the kernel
register-blocked. Each item widens a span's keys and values once. S = Q K^T and P V each run on 6 query rows x 64
keys or dims in 24 AVX-512 accumulators. The online softmax takes one step per 256-key span, masked only on the
diagonal. Blocks of fewer rows are not padded. On the Zen 4 EPYC, for 512 tokens over 4,096 fp16 keys with SmolLM2's
heads: 90.6 → 101.6 GFLOP/s at 1 thread (87 % of the fp32 FMA peak), 167 → 198 at 2, and 2.2x on a decode row.
bench/results/cpu-attention has the runs.

On CPUs with AMX (amx_tile + amx_bf16) whose OS grants the tile state, the sequences of a call with at least
AMX_MIN_TOKENS new tokens and AMX_MIN_ROWS query rows a kv head (prefill chunks and warm turns) and a head size a
multiple of 16 go to cpu_attention_amx.c instead: the same attention with split-bf16 ("bf16x3") tile products,
~16 significant bits a product, 2.4x / 2.7x the fp32 kernel on a 1024-token chunk at 2k / 32k context on one
Xeon core, 1.3x on a 30-token warm turn at 121k. Over the default fp16 cache it widens keys and values as it
repacks them (their split into bf16 hi + lo is then exact): SmolLM2's heads, 650 new tokens over 5,000 fp16 keys at
two threads, 12.1 ms against the fp32 kernel's 30.1 (a later agent turn's extend, issue 52). Decode and spec verify
(few tokens) stay on the fp32 kernel, and so does every call with `amx=False` (the engine's --exact-cpu).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from agentbox.kernels.cpu_gemv import Isa, compile_cached, cpu_flags, threads

SOURCE = Path(__file__).with_name("cpu_attention.c")
AMX_SOURCE = Path(__file__).with_name("cpu_attention_amx.c")
SPREAD = Path(__file__).with_name("omp_spread.h")  # both kernels' placing of their threads
# cpu_attention.c's headers (its vectors at either width, its register tiles): in the build's digest with SPREAD
HEADERS = tuple(SOURCE.with_name(h) for h in ("cpu_attention_vec.h", "cpu_attention_tiles.h"))
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", *Isa.AVX2.cc_flags)
# The same source on 16-lane vectors where the CPU has AVX-512F: a warm 128k turn's attention (25 tokens over
# 121k keys, head 16) took 11.5 ms of one core in the AVX2 build on this Xeon, 5-6 ms in this one.
AVX512_FLAGS = (*FLAGS, "-mavx512f")
AMX_FLAGS = (*AVX512_FLAGS, "-mavx512bf16", "-mamx-tile", "-mamx-bf16")
AMX_CPU_FLAGS = frozenset({"avx512f", "avx512_bf16", "amx_tile", "amx_bf16"})
# Fewest query rows of one kv head (tokens x its query heads) worth the tiles: the rows share every key repacked
# into the tiles' layout, and the tiles take rows in blocks of 32. ms, min of 7, AMX kernel / fp32 kernel on
# 1 thread | on 2 (this 2-core Xeon, quiet; head 64 at 3, 9, 15, 33 rows: whole tokens of 3 heads):
#   rows a kv head  2-3              8-9             15-16            32-33           48             60
#   hd 16 g 2 121k  7.1/6.3|3.9/3.5  7.3/7.4|3.9/4.2  7.2/8.3|3.7/4.5  6.7/9.3|3.5/5.4  8.4/11|5.9/7.6  13/16|6.8/9.1
#   hd 16 g 2 8k    .42/.37|.31/.26  .46/.46|.36/.30  .44/.49|.32/.34  .52/.73|.36/.47  .57/.71|.46/.51 .54/.95|.38/.55
#   hd 64 g 3 121k  75/65|38/37      75/73|37/36      58/73|35/41      106/113|54/56    66/100|41/57    75/121|39/70
#   hd 64 g 3 8k    4.9/4.3|2.7/2.6  4.8/4.7|2.7/2.8  3.3/4.5|2.5/2.7  4.2/5.8|3.0/3.6  7.4/8.6|3.8/4.6 7.3/9.8|4.1/5.8
# From 16 rows the tiles win or tie at both head sizes, thread counts and lengths (96 rows: 1.4-1.8x); a decode's
# few rows lose 10-20 %, 8-12 tie. No head-size rule: the crossover is the same at 16 and 64.
AMX_MIN_ROWS = 16
# Fewest new tokens of a sequence for the tiles, whatever its rows (with these values the binding floor): a
# speculative verify (at most spec_max_draft + 1 = 17 tokens by default) stays on the fp32 kernel with the decode
# steps, so on the torch layers greedy output with drafts keeps plain decoding's numbers (tests/test_spec_decode.py)
# rather than the tiles' ~1e-5 of difference at a verify.
AMX_MIN_TOKENS = 18
_c_i64, _c_ptr, _c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
# (q, seqs, q_starts, q_lens, kv_lens, page_table, its stride, page size, k, v, hq, hkv, hd, scale, out, threads)
_ARGS = [_c_ptr, _c_i64, _c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_i64,
         ctypes.c_float, _c_ptr, _c_int]
# The cache's element types both kernels read (passed as their last argument, kv_f16).
KV_DTYPES = (torch.float32, torch.float16)


def _build(avx512: bool) -> tuple[Path | None, str]:
    return compile_cached("cpu_attention-avx512" if avx512 else "cpu_attention", (SOURCE,),
                          AVX512_FLAGS if avx512 else FLAGS, hashed=(SPREAD, *HEADERS))


@functools.cache
def _library(avx512: bool | None = None) -> tuple[ctypes.CDLL | None, str]:
    """The build for this CPU (AVX-512 when it has avx512f, else AVX2); `avx512` picks one (tests)."""
    missing = Isa.AVX2.cpu_flags - cpu_flags()
    if missing:
        return None, f"this CPU lacks {', '.join(sorted(missing))}"
    wide = "avx512f" in cpu_flags() if avx512 is None else avx512
    target, why = _build(wide)
    if target is None and avx512 is None and wide:
        target, why = _build(False)  # a compiler without AVX-512 support: the AVX2 build
    if target is None:
        return None, why
    lib = ctypes.CDLL(str(target))
    lib.ab_paged_attention.argtypes = [*_ARGS, _c_int]  # kv_f16
    lib.ab_paged_attention.restype = _c_int
    return lib, ""


@functools.cache
def _amx_library() -> tuple[ctypes.CDLL | None, str]:
    """The AMX build, loaded with the process's tile state granted, or (None, why)."""
    missing = AMX_CPU_FLAGS - cpu_flags()
    if missing:
        return None, f"this CPU lacks {', '.join(sorted(missing))}"
    target, why = compile_cached("cpu_attention-amx", (AMX_SOURCE,), AMX_FLAGS,
                                 hashed=(SPREAD, AMX_SOURCE.with_name("amx_tiles.h")))
    if target is None:
        return None, why
    lib = ctypes.CDLL(str(target))
    if lib.ab_amx_init() != 0:  # Linux before 5.16, or a kernel that refuses arch_prctl(ARCH_REQ_XCOMP_PERM)
        return None, "the OS did not grant the AMX tile state"
    lib.ab_paged_attention_amx.argtypes = [*_ARGS, _c_int]  # kv_f16
    lib.ab_paged_attention_amx.restype = _c_int
    return lib, ""


def amx_available() -> bool:
    return _amx_library()[0] is not None


def amx_unavailable_reason() -> str:
    return _amx_library()[1]


def available() -> bool:
    return _library()[0] is not None


def unavailable_reason() -> str:
    return _library()[1]


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Shapes and dtypes the kernel takes (the caller checks window and sinks)."""
    hd, hkv = k_cache.shape[-1], k_cache.shape[-2]
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype in KV_DTYPES
            and k_cache.is_contiguous() and hd % 8 == 0 and hd <= 256 and q.shape[1] % hkv == 0)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                    page_size: int, query_lens: list[int], kv_lens: list[int], scale: float,
                    n_threads: int | None = None, avx512: bool | None = None, amx: bool | None = None) -> torch.Tensor:
    """q [T, H, D] fp32 (each sequence's new tokens in order: the last query_lens[s] of its kv_lens[s]
    positions), k/v cache [slots, Hkv, D] fp32 or fp16 (one dtype) holding every position already, page_table [B, P] (its
    pages) -> [T, H, D]: causal attention. `avx512` picks a build (tests); None: this CPU's best. `amx`:
    None sends sequences of AMX_MIN_TOKENS tokens and AMX_MIN_ROWS rows or more to the AMX kernel where it runs,
    False none, True all
    (tests; it must run)."""
    lib, why = _library(avx512)
    if lib is None:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {why}")
    if k_cache.dtype not in KV_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged_attention reads an fp32 or fp16 cache, not k {k_cache.dtype} / v {v_cache.dtype}")
    kv_f16 = k_cache.dtype == torch.float16
    q = q.contiguous()
    table = page_table.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    _, h, d = q.shape
    hkv = k_cache.shape[1]
    q_lens = torch.tensor(query_lens, dtype=torch.int64)
    starts = torch.cumsum(q_lens, 0) - q_lens
    tiled = _tiled(query_lens, h // hkv, d, amx)
    parts = [(lambda *args: lib.ab_paged_attention(*args, int(kv_f16)), [s for s, t in enumerate(tiled) if not t])]
    if any(tiled):
        amx_lib = _amx_library()[0]
        parts.append((lambda *args: amx_lib.ab_paged_attention_amx(*args, int(kv_f16)),
                      [s for s, t in enumerate(tiled) if t]))
    for kernel, seqs in parts:
        if not seqs:
            continue
        whole = len(seqs) == len(query_lens)
        pick = torch.tensor(seqs, dtype=torch.int64)
        rows = table if whole else table[pick].contiguous()
        q_at, n_q = (starts, q_lens) if whole else (starts[pick].contiguous(), q_lens[pick].contiguous())
        kv = torch.tensor([kv_lens[s] for s in seqs], dtype=torch.int64)
        rc = kernel(q.data_ptr(), len(seqs), q_at.data_ptr(), n_q.data_ptr(), kv.data_ptr(), rows.data_ptr(),
                    rows.shape[1], page_size, k_cache.data_ptr(), v_cache.data_ptr(), h, hkv, d, scale, out.data_ptr(),
                    n_threads or threads())
        if rc != 0:
            raise RuntimeError(f"paged_attention refused q {tuple(q.shape)} over kv heads of {k_cache.shape[1:]} "
                               f"(code {rc}): head size a multiple of 8 up to 256, query heads a multiple of kv heads")
    return out


def _tiled(query_lens: list[int], group: int, head_dim: int, amx: bool | None) -> list[bool]:
    """Which sequences the AMX kernel takes (head sizes a multiple of 16; it pads one of 16, 48, 80 ... to 32s)."""
    if amx is False:
        return [False] * len(query_lens)
    if amx and not amx_available():
        raise RuntimeError(f"the AMX attention kernel is unavailable: {amx_unavailable_reason()}")
    if head_dim % 16 or not amx_available():
        if amx:
            raise RuntimeError(f"the AMX attention kernel takes head sizes a multiple of 16, not {head_dim}")
        return [False] * len(query_lens)
    return [bool(amx) or (n >= AMX_MIN_TOKENS and n * group >= AMX_MIN_ROWS) for n in query_lens]


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                        page_size: int, query_lens: list[int], kv_lens: list[int], scale: float) -> torch.Tensor:
    """The twin: gather each sequence's keys through its pages, SDPA with the causal offset mask, fp64."""
    outs, start = [], 0
    for s, (n_q, n_kv) in enumerate(zip(query_lens, kv_lens, strict=True)):
        pos = torch.arange(n_kv)
        slots = page_table[s].to(torch.int64)[pos // page_size] * page_size + pos % page_size
        keys, values = k_cache[slots].double().transpose(0, 1), v_cache[slots].double().transpose(0, 1)
        qs = q[start:start + n_q].double().transpose(0, 1)  # [H, Q, D]
        visible = pos[None, :] <= (n_kv - n_q + torch.arange(n_q))[:, None]
        o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=visible, scale=scale,
                                           enable_gqa=keys.shape[0] != qs.shape[0])
        outs.append(o.transpose(0, 1).float())
        start += n_q
    return torch.cat(outs)
