"""A checkpoint tensor not read yet: a safetensors slice that a layer narrows to its TP shard before any
byte is read, so each rank reads only its part of a sharded weight (narrowing a plain tensor after reading
all of it is what the loader did before). Plain tensors pass through `materialize` unchanged."""

from __future__ import annotations

from typing import Any

import torch


class LazySlice:
    def __init__(self, source: Any, shape: torch.Size, index: tuple[tuple[int, int], ...] | None = None) -> None:
        self._source = source  # safetensors' PySafeSlice, valid while its file is open
        self.shape = shape
        self._index = index or tuple((0, n) for n in shape)

    @staticmethod
    def of(source: Any) -> LazySlice:
        return LazySlice(source, torch.Size(source.get_shape()))

    def dim(self) -> int:
        return len(self.shape)

    def size(self, axis: int) -> int:
        return self.shape[axis]

    def narrow(self, axis: int, start: int, length: int) -> LazySlice:
        if start < 0 or length < 0 or start + length > self.shape[axis]:
            raise IndexError(f"narrow({axis}, {start}, {length}) is outside a tensor of shape {tuple(self.shape)}")
        base = self._index[axis][0]
        index = (*self._index[:axis], (base + start, base + start + length), *self._index[axis + 1 :])
        return LazySlice(self._source, torch.Size([*self.shape[:axis], length, *self.shape[axis + 1 :]]), index)

    def materialize(self) -> torch.Tensor:
        if not self.shape:
            return self._source[:]
        return self._source[tuple(slice(a, b) for a, b in self._index)]


def materialize(t: Any) -> Any:
    return t.materialize() if isinstance(t, LazySlice) else t
