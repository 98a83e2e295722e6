"""A large embedding table that stays in the checkpoint's file: memory-mapped, never copied into RAM, never put on
the accelerator. Qwen3.8-Flash-Next's n-gram tables (layers/ngram_embedding.py) are about 51 B parameters (~95
GiB in bf16) of which a step reads a few rows per token; the page cache holds the rows tokens touched, the
operating system drops them under pressure, and every tensor-parallel rank maps the same file (one copy in RAM).

safetensors' own `get_tensor` reads the whole tensor into memory, so a table is mapped from the file's header
instead: an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and byte range
after the header. A checkpoint may split one table into consecutive row shards (transformers saves `shard_{i}`
parts, `split_ngram_parts`): `HostTable` stitches them into one row space.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# safetensors dtype -> (the numpy dtype its bytes are read as, the torch dtype they are viewed as)
_DTYPES: dict[str, tuple[type, torch.dtype]] = {
    "F32": (np.float32, torch.float32),
    "F16": (np.float16, torch.float16),
    "BF16": (np.uint16, torch.bfloat16),  # numpy has no bfloat16: the bits are read as uint16 and viewed
}


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's bytes sit in a safetensors file."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the start of the file


def tensor_locations(paths: list[Path]) -> dict[str, TensorLocation]:
    """Every tensor of these safetensors files, from their headers only (nothing else is read)."""
    out: dict[str, TensorLocation] = {}
    for path in paths:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            out[name] = TensorLocation(path, info["dtype"], tuple(info["shape"]), 8 + length + info["data_offsets"][0])
    return out


class HostTable:
    """A [rows, dim] table over one or more row shards mapped read-only from their files."""

    def __init__(self, shards: list[TensorLocation]) -> None:
        if not shards:
            raise ValueError("a host table needs at least one shard")
        dims = {s.shape[1] for s in shards}
        kinds = {s.dtype for s in shards}
        if len(dims) != 1 or len(kinds) != 1 or any(len(s.shape) != 2 for s in shards):
            raise ValueError(f"host table shards differ in width or dtype: {[(s.shape, s.dtype) for s in shards]}")
        kind = kinds.pop()
        if kind not in _DTYPES:
            raise ValueError(f"host table of dtype {kind} is not supported (only {', '.join(_DTYPES)})")
        np_dtype, self.dtype = _DTYPES[kind]
        self.dim = dims.pop()
        self._maps = [np.memmap(s.path, dtype=np_dtype, mode="r", offset=s.offset, shape=s.shape) for s in shards]
        for m in self._maps:
            # Rows are read at random: the kernel's readahead would pull 128 KiB or more around each row into RAM.
            m._mmap.madvise(mmap.MADV_RANDOM)  # type: ignore[attr-defined]
        sizes = [s.shape[0] for s in shards]
        self._starts = np.cumsum([0, *sizes])  # shard i holds rows [starts[i], starts[i + 1])
        self.rows = int(self._starts[-1])
        self.nbytes = self.rows * self.dim * self.dtype.itemsize

    def gather(self, ids: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (any shape of int64 row numbers) -> [*ids.shape, dim] on `device` in `dtype`: only these
        rows are read from the file."""
        flat = ids.reshape(-1).cpu().numpy()
        if flat.size and (flat.min() < 0 or flat.max() >= self.rows):
            raise IndexError(f"host table row out of range [0, {self.rows})")
        out = np.empty((flat.size, self.dim), dtype=self._maps[0].dtype)
        shard = np.searchsorted(self._starts, flat, side="right") - 1
        for i in np.unique(shard):
            pick = shard == i
            out[pick] = self._maps[i][flat[pick] - self._starts[i]]
        rows = torch.from_numpy(out).view(self.dtype)
        return rows.view(*ids.shape, self.dim).to(device=device, dtype=dtype)
