"""The triton backend: our own kernels (kernels/store_kv, paged_decode, prefix_extend) over the page tables.

Per layer: store the new k/v at their slots, then a decode-only step runs split-KV paged decode (one query
per sequence, GQA heads grouped), anything else (prefill chunks, prompts after a cache hit, mixed batches)
runs prefix-extend. Kernels read only the metadata's device tensors, so decode is CUDA-graph safe: the
grid depends on the batch size alone.

On CPU it runs only under Triton's interpreter (TRITON_INTERPRET=1, what the tests use to check the kernels
against transformers); `auto` never picks it there (the interpreter is thousands of times slower than torch).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import ModuleType
from typing import ClassVar

import torch

from agentbox.layers.backends.base import AttentionBackend, AttentionMetadata, KVCache, register_backend

# Splits of the KV length per decode (flash-decoding): enough programs to fill a GPU at batch 1 (Hkv * splits
# of them). Fixed, so a captured graph's grid never changes; the interpreter gets fewer, being serial.
GPU_DECODE_SPLITS = 16
INTERPRETER_DECODE_SPLITS = 1
# Tile sizes on a GPU (the kernels' defaults, 16/32, are the interpreter's): 64-row tiles feed the tensor cores
# in 16-bit; fp32 tiles are twice the bytes, so half the rows keep the pipelined loads within shared memory.


@dataclass(frozen=True)
class Tiles:
    decode_n: int  # keys per step of paged_decode's loop
    extend_m: int  # query rows per prefix_extend program
    extend_n: int  # keys per step of prefix_extend's loop


INTERPRETER_TILES = Tiles(32, 16, 32)
GPU_TILES_16BIT = Tiles(64, 64, 64)
GPU_TILES_FP32 = Tiles(32, 32, 32)
# Past this head size (Gemma 4's 512-wide global layers) a tile's rows are halved so the q, k and v tiles of one
# program still fit in shared memory (not yet measured on a GPU: a guess from the tile bytes).
WIDE_HEAD = 256


def tiles_for(tiles: Tiles, head_dim: int) -> Tiles:
    if head_dim <= WIDE_HEAD:
        return tiles
    return Tiles(max(16, tiles.decode_n // 2), max(16, tiles.extend_m // 2), max(16, tiles.extend_n // 2))


def _kernels() -> tuple[ModuleType, ModuleType, ModuleType]:
    # Imported on first use, not at registration: triton reads TRITON_INTERPRET when a kernel is decorated.
    from agentbox.kernels import paged_decode, prefix_extend, store_kv

    return store_kv, paged_decode, prefix_extend


@register_backend
class TritonAttention(AttentionBackend):
    name = "triton"
    supports_cuda_graphs: ClassVar[bool] = True

    def __init__(self, kv_cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(kv_cache, num_heads, num_kv_heads, head_dim, scale)
        self._store, self._decode, self._extend = _kernels()
        from agentbox.kernels._triton import interpreting

        self.num_splits = INTERPRETER_DECODE_SPLITS if interpreting() else GPU_DECODE_SPLITS
        if interpreting():
            self.tiles = INTERPRETER_TILES
        else:
            self.tiles = GPU_TILES_FP32 if kv_cache.k[0].dtype == torch.float32 else GPU_TILES_16BIT
        self.decode_only = False

    @classmethod
    def unavailable_reason(cls, device: str, auto: bool = False) -> str | None:
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed"
        from agentbox.kernels._triton import interpreting

        if device == "cpu" and auto:
            return "on CPU only under Triton's interpreter, for tests (far slower than torch)"
        if device == "cpu" and not interpreting():
            return "Triton runs on CPU only under its interpreter (TRITON_INTERPRET=1), for tests"
        if device not in ("cpu", "cuda"):
            return f"no Triton target for {device}"
        return None

    def begin(self, meta: AttentionMetadata) -> None:
        super().begin(meta)
        meta.ensure_device_tensors(self.kv_cache.k[0].device)
        self.decode_only = meta.is_decode_only

    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        meta = self.meta
        if meta is None or meta.query_start_loc is None or meta.kv_lens_tensor is None:
            raise RuntimeError("TritonAttention.forward before begin(meta)")
        k_cache, v_cache = self.kv_cache.k[layer_id], self.kv_cache.v[layer_id]
        self._store.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        common = dict(page_size=meta.page_size, scale=self.scale if scale is None else scale,
                      sliding_window=sliding_window, sinks=sinks)
        tiles = tiles_for(self.tiles, q.shape[-1])
        if self.decode_only:
            return self._decode.paged_decode(
                q, k_cache, v_cache, meta.page_table, meta.kv_lens_tensor, num_splits=self.num_splits,
                block_n=tiles.decode_n, **common,
            )
        return self._extend.prefix_extend(
            q, k_cache, v_cache, meta.page_table, meta.query_start_loc, meta.kv_lens_tensor,
            max_query_len=meta.max_query_len, block_m=tiles.extend_m, block_n=tiles.extend_n, **common,
        )

