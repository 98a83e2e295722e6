"""A lean GGUF parser: metadata and tensor locations, with the tensor bytes left memory-mapped.

The `gguf` package's reader builds a numpy view per array element; on a vocabulary of 49k tokens and
49k merges that is seconds to tens of seconds of start-up on a busy CPU. The format is simple enough to
read directly (header, key/values, tensor infos, aligned data); `gguf` is still used for its enums, block
sizes and dequantisation kernels.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
# GGUF value type id -> (struct format, numpy dtype) for fixed-size scalars
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("B", "u1"),
    1: ("b", "i1"),
    2: ("H", "<u2"),
    3: ("h", "<i2"),
    4: ("I", "<u4"),
    5: ("i", "<i4"),
    6: ("f", "<f4"),
    7: ("?", "?"),
    10: ("Q", "<u8"),
    11: ("q", "<i8"),
    12: ("d", "<f8"),
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # PyTorch order (outermost first); GGUF stores the innermost dim first
    qtype: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    nbytes: int


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._map[:4] != _MAGIC:
            raise ValueError(f"{str(path)!r} is not a GGUF file (bad magic)")
        self._pos = 4
        version = self._scalar(4)
        if not 2 <= version <= 3:
            raise ValueError(
                f"{str(path)!r}: GGUF version {version} is not supported (2 or 3, little-endian)"
            )
        tensor_count, kv_count = self._scalar(10), self._scalar(10)
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._string()
            self.metadata[key] = self._value(self._scalar(4))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = [self._scalar(10) for _ in range(self._scalar(4))]
            infos.append((name, dims, GGMLQuantizationType(self._scalar(4)), self._scalar(10)))
        alignment = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        for name, dims, qtype, offset in infos:
            block_size, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims)) if dims else 1
            nbytes = n // block_size * type_size
            self.tensors.append(GGUFTensor(name, tuple(reversed(dims)), qtype, data_start + offset, nbytes))

    def raw(self, tensor: GGUFTensor) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 array [rows, bytes per row] (what dequantize takes)."""
        data = np.frombuffer(self._map, dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset)
        rows = int(np.prod(tensor.shape[:-1])) if len(tensor.shape) > 1 else 1
        return data.reshape(rows, tensor.nbytes // rows)

    def _scalar(self, vtype: int) -> Any:
        fmt, _ = _SCALARS[vtype]
        size = struct.calcsize("<" + fmt)
        (value,) = struct.unpack_from("<" + fmt, self._map, self._pos)
        self._pos += size
        return value

    def _string(self) -> str:
        length = self._scalar(10)
        raw = self._map[self._pos : self._pos + length]
        self._pos += length
        return raw.decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, count = self._scalar(4), self._scalar(10)
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type][1])
                values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos)
                self._pos += count * dtype.itemsize
                return values.tolist()
            return [self._value(item_type) for _ in range(count)]
        if vtype not in _SCALARS:
            raise ValueError(f"{str(self.path)!r}: unknown GGUF value type {vtype}")
        return self._scalar(vtype)
