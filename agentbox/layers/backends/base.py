"""The attention backend interface: chosen once at start, used by every attention layer.

The model never knows which backend runs. A backend gets, once per step, the batch's `AttentionMetadata`
(where each sequence's pages are, how many new tokens it brings) and then, for each layer, the new
q/k/v of the flattened batch. It writes the new k/v into the paged cache and returns the attention output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class AttentionMetadata:
    """One step's batch layout. Sequences are laid out one after another in the flattened token axis.

    query_lens[i]: new tokens of sequence i in this step (1 for a decode, a chunk for a prefill).
    kv_lens[i]: tokens of sequence i in the cache after this step (cached + new).
    page_table: [num_seqs, max_pages] int32, page ids of each sequence, padded with 0.
    slot_mapping: [num_tokens] int64, cache slot (page * page_size + offset) where each new token's k/v goes;
      a negative slot writes nowhere (the CUDA-graph runner's padding rows).
    query_start_loc: [num_seqs + 1] int32 on the device, offsets of each sequence's new tokens.
    kv_lens_tensor: [num_seqs] int32 on the device, kv_lens as a tensor (0 for a padding row).
    The two device tensors are what kernels and CUDA graphs read: the graph runner hands in views of its static
    buffers; otherwise `ensure_device_tensors` builds them from the lists once per step.
    """

    query_lens: list[int]
    kv_lens: list[int]
    page_table: torch.Tensor
    slot_mapping: torch.Tensor
    page_size: int
    query_start_loc: torch.Tensor | None = None
    kv_lens_tensor: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    def ensure_device_tensors(self, device: torch.device) -> None:
        if self.query_start_loc is None:
            starts = [0]
            for n in self.query_lens:
                starts.append(starts[-1] + n)
            self.query_start_loc = torch.tensor(starts, dtype=torch.int32).to(device, non_blocking=True)
        if self.kv_lens_tensor is None:
            self.kv_lens_tensor = torch.tensor(self.kv_lens, dtype=torch.int32).to(device, non_blocking=True)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)


class KVCache:
    """Per-layer paged key/value storage: k[layer] and v[layer] are [num_slots, num_kv_heads, head_dim]
    where num_slots = num_pages * page_size. Owned by the engine's runner; handed to backends."""

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        # zeros, not empty: padded rows of a batch read stale slots through a mask, and NaN garbage * 0 is NaN.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class AttentionBackend(ABC):
    """One instance per engine. `begin` is called once per step before the forward pass.

    CUDA graphs (engine/exec/graph_runner.py): a backend with `supports_cuda_graphs` reads only the metadata's device
    tensors on a decode step, so a graph captured once per batch size replays for any lengths. The runner calls
    `init_capture` once, `begin_capture` before capturing each batch size (the metadata's tensors are then its
    static buffers) and `begin_replay` before each replay (host-side work only: no allocation, no new tensors).
    """

    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False

    def __init__(self, kv_cache: KVCache, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.kv_cache = kv_cache
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.meta: AttentionMetadata | None = None

    def begin(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    def init_capture(self, max_batch: int, max_pages: int) -> None:
        """Once, before any capture: room for the largest captured batch (none needed by default)."""
        del max_batch, max_pages

    def begin_capture(self, meta: AttentionMetadata) -> None:
        self.begin(meta)

    def begin_replay(self, meta: AttentionMetadata) -> None:
        self.meta = meta

    @abstractmethod
    def forward(
        self,
        layer_id: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, num_heads, D]; k, v: [T, num_kv_heads, D] for the step's T new tokens.
        Stores k/v at meta.slot_mapping in layer `layer_id`'s cache, returns [T, num_heads, D].
        sliding_window W: a query at position p sees keys max(0, p-W+1)..p. sinks: [num_heads] float
        logits joining each row's softmax denominator, contributing no value."""

    @classmethod
    def unavailable_reason(cls, device: str, auto: bool = False) -> str | None:
        """None when the backend can run on `device` (a device type: cpu, cuda); else why not, for the log.
        auto: asked by `--attention auto`, which may decline a backend that runs but should not be the default."""
        return None

    @classmethod
    def available(cls, device: str) -> bool:
        return cls.unavailable_reason(device) is None


ATTENTION_BACKENDS: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    ATTENTION_BACKENDS[cls.name] = cls
    return cls
