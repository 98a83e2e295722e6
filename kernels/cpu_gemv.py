"""Weight-only 4- and 8-bit matmuls for AVX2 CPUs (cpu_gemv.c), and their torch twins.

The C file is compiled on first use with the system C compiler (as Triton compiles its launchers), cached
under ~/.cache/agentbox/kernels by the source's hash, and loaded with ctypes: no torch headers, so a build
takes about a second. Where there is no compiler, no AVX2/FMA or the build fails, `available()` is False
with the reason in `unavailable_reason()`, and callers keep the dense path.

Layouts (see the C file): Q4 codes [N, K/32, 16] uint8 (byte j: element j low nibble, j + 16 high), scale
and offset [N, K/group], both fp32 or both fp16 (`exact_half` says when fp16 loses nothing); Q8 codes [N, K/32, 32] int8, scale fp32 [N, K/32]. The twins quantise the
activations exactly as the kernel does (per 32, d = max|x| / 127, round half to even) so kernel and twin
agree to fp32 summation order; `round_activations` + the dequantised weight gives the same numbers for
callers with many rows (prefill), where one sgemm beats the kernel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_gemv.c")
SOURCES = (SOURCE, SOURCE.with_name("cpu_decode.c"), SOURCE.with_name("cpu_bits.c"))  # one library; cpu_gemv.h: shared
BLOCK = 32
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC")
_c_i64, _c_ptr, _c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "agentbox" / "kernels"


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    missing = {"avx2", "fma", "f16c"} - _cpu_flags()
    if missing:
        return None, f"this CPU lacks {', '.join(sorted(missing))}"
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None, "no C compiler (cc / gcc) on PATH"
    source = b"".join(p.read_bytes() for p in (*SOURCES, SOURCE.with_name("cpu_gemv.h")))
    digest = hashlib.sha256(source + " ".join(FLAGS).encode()).hexdigest()[:16]
    target = _cache_dir() / f"cpu_gemv-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # Build beside the target and rename: tensor-parallel workers may build at the same moment.
        with tempfile.NamedTemporaryFile(dir=target.parent, suffix=".so", delete=False) as tmp:
            partial = Path(tmp.name)
        result = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", str(partial), "-lm"], capture_output=True, text=True)
        if result.returncode != 0:
            partial.unlink(missing_ok=True)
            return None, f"building {SOURCE.name} failed: {result.stderr.strip()[:300]}"
        partial.replace(target)
    lib = ctypes.CDLL(str(target))
    lib.ab_q4_matmul.argtypes = [_c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_ptr, _c_int, _c_int]
    lib.ab_q8_matmul.argtypes = [_c_ptr, _c_i64, _c_i64, _c_ptr, _c_ptr, _c_i64, _c_ptr, _c_int]
    lib.ab_q4_dequant.argtypes = [_c_ptr, _c_ptr, _c_ptr, _c_i64, _c_i64, _c_i64, _c_ptr, _c_int, _c_int]
    lib.ab_q8_rows.argtypes = [_c_ptr, _c_ptr, _c_i64, _c_ptr, _c_i64, _c_ptr]
    # (layer*, dims*, hidden, residual, first, m, positions, slots, page_table, stride, page_size, kv_lens, threads)
    lib.ab_decode_layer.argtypes = [_c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_int, _c_i64, _c_ptr, _c_ptr, _c_ptr, _c_i64,
                                    _c_i64, _c_ptr, _c_int]
    # cpu_bits.c: (x, m, w, bits, group, form, offset, k, n, out, threads) / (w, ..., n, out, threads)
    lib.ab_bits_matmul.argtypes = [_c_ptr, _c_i64, _c_ptr, *[_c_int] * 4, _c_i64, _c_i64, _c_ptr, _c_int]
    lib.ab_bits_dequant.argtypes = [_c_ptr, *[_c_int] * 4, _c_i64, _c_i64, _c_ptr, _c_int]
    lib.ab_bits_row_bytes.argtypes = [*[_c_int] * 4, _c_i64]
    lib.ab_bits_row_bytes.restype = _c_i64
    for f in (lib.ab_q4_matmul, lib.ab_q8_matmul, lib.ab_decode_layer, lib.ab_bits_matmul, lib.ab_bits_dequant):
        f.restype = _c_int
    return lib, ""


def available() -> bool:
    return _library()[0] is not None


def unavailable_reason() -> str:
    return _library()[1]


def _lib() -> ctypes.CDLL:
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"the CPU weight-only kernels are unavailable: {why}")
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed (code {rc}: shapes must be multiples of {BLOCK})")


# ---- packing -------------------------------------------------------------------------------------------


def pack_q4(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) -> [N, K/32, 16] uint8: byte j holds element j (low) and j + 16 (high)."""
    n, k = q.shape
    blocks = q.to(torch.uint8).reshape(n, k // BLOCK, BLOCK)
    return (blocks[..., :16] | (blocks[..., 16:] << 4)).contiguous()


def exact_half(scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 copies when they hold the same numbers (GGUF Q4_0 / Q4_1: the file's own fp16 d and m; 4 bytes
    less per 32 weights, 20 % of a Q4 layer's bytes), else fp32."""
    s16, o16 = scale.half(), offset.half()
    if torch.equal(s16.float(), scale.float()) and torch.equal(o16.float(), offset.float()):
        return s16.contiguous(), o16.contiguous()
    return scale.float().contiguous(), offset.float().contiguous()


def unpack_q4(codes: torch.Tensor) -> torch.Tensor:
    n, nb, _ = codes.shape
    return torch.cat([codes & 0x0F, codes >> 4], dim=-1).reshape(n, nb * BLOCK)


# ---- kernels -------------------------------------------------------------------------------------------


def threads() -> int:
    return torch.get_num_threads()


def _half(scale: torch.Tensor, offset: torch.Tensor) -> int:
    if scale.dtype != offset.dtype or scale.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"Q4 scale/offset must both be fp32 or fp16, got {scale.dtype} / {offset.dtype}")
    return int(scale.dtype == torch.float16)


def q4_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32, with w[n, k] = q * scale[n, k // g] + offset[n, k // g]."""
    x = x.contiguous().float()
    m, k = x.shape
    n = codes.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    group = k // scale.shape[1]
    rc = _lib().ab_q4_matmul(
        x.data_ptr(), m, k, codes.data_ptr(), scale.data_ptr(), offset.data_ptr(), n, group, out.data_ptr(),
        threads(), _half(scale, offset),
    )
    _check(rc, "q4_matmul")
    return out


def q8_matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 -> [M, N] fp32, with w[n, k] = q[n, k] * scale[n, k // 32]."""
    x = x.contiguous().float()
    m, k = x.shape
    n = codes.shape[0]
    out = torch.empty(m, n, dtype=torch.float32)
    _check(_lib().ab_q8_matmul(x.data_ptr(), m, k, codes.data_ptr(), scale.data_ptr(), n, out.data_ptr(), threads()),
           "q8_matmul")
    return out


def q4_dequant(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    n, nb, _ = codes.shape
    k = nb * BLOCK
    out = torch.empty(n, k, dtype=torch.float32)
    _lib().ab_q4_dequant(codes.data_ptr(), scale.data_ptr(), offset.data_ptr(), n, k, k // scale.shape[1],
                         out.data_ptr(), threads(), _half(scale, offset))
    return out


def q8_rows(codes: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Dense fp32 rows of a Q8 weight [N, K] (codes [N, K/32, 32] int8): an embedding lookup."""
    idx = rows.reshape(-1).to(torch.int64).contiguous()
    k = codes.shape[1] * BLOCK
    out = torch.empty(idx.numel(), k, dtype=torch.float32)
    _lib().ab_q8_rows(codes.data_ptr(), scale.data_ptr(), k, idx.data_ptr(), idx.numel(), out.data_ptr())
    return out.reshape(*rows.shape, k)


# ---- torch twins ---------------------------------------------------------------------------------------


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


def q4_matmul_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    xq, d = quantize_activations_ref(x)
    sums = (xq.sum(-1) * d).reshape(x.shape[0], -1, xq.shape[1] // scale.shape[1]).sum(-1)  # per scale group
    n, nb, _ = codes.shape
    q = unpack_q4(codes).reshape(n, nb, BLOCK).float()
    per = nb // scale.shape[1]
    s = scale.float().repeat_interleave(per, 1)  # [N, nb]
    dots = torch.einsum("mbj,nbj->mnb", xq, q)  # integer-valued block dots
    return (dots * d.unsqueeze(1) * s.unsqueeze(0)).sum(-1) + sums @ offset.float().t()


def q8_matmul_ref(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    xq, d = quantize_activations_ref(x)
    dots = torch.einsum("mbj,nbj->mnb", xq, codes.float())
    return (dots * d.unsqueeze(1) * scale.unsqueeze(0)).sum(-1)


def q4_dequant_ref(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    n, nb, _ = codes.shape
    q = unpack_q4(codes).reshape(n, nb, BLOCK).float()
    per = nb // scale.shape[1]
    s, o = scale.float().repeat_interleave(per, 1), offset.float().repeat_interleave(per, 1)
    return (q * s.unsqueeze(-1) + o.unsqueeze(-1)).reshape(n, nb * BLOCK)
