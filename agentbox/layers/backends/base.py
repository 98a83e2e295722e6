"""The attention backend interface: chosen once at start, used by every attention layer.

The model never knows which backend runs. A backend gets, once per step, the batch's `AttentionMetadata`
(where each sequence's pages are, how many new tokens it brings) and then, for each layer, the new
q/k/v of the flattened batch. It writes the new k/v into the paged cache and returns the attention output.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
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
    cpu_threads: int | None = None  # threads of a CPU attention kernel in this step (None: torch's)

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


@dataclass(frozen=True)
class KVLayerSpec:
    """What one attention layer keeps per token: num_kv_heads heads of head_dim for K, and of v_head_dim for V.

    Layers of one model may differ (Gemma 4: 256 on sliding layers, 512 on global ones). tied: V is K, stored
    once (Gemma 4's global layers; MLA's latent, whose first v_head_dim values serve as V).
    """

    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None  # None: head_dim
    tied: bool = False

    @property
    def values_per_token(self) -> int:
        v = 0 if self.tied else self.num_kv_heads * (self.v_head_dim or self.head_dim)
        return self.num_kv_heads * self.head_dim + v

    @staticmethod
    def uniform(num_layers: int, num_kv_heads: int, head_dim: int) -> list[KVLayerSpec]:
        return [KVLayerSpec(num_kv_heads, head_dim)] * num_layers


class KVCache:
    """Per-layer paged key/value storage: k[layer] is [num_slots, num_kv_heads, head_dim] and v[layer]
    [num_slots, num_kv_heads, v_head_dim] (the same tensor as k[layer] for a tied layer), where a layer keeping
    one entry per token has num_slots = num_pages * page_size. A layer of a group that keeps one entry per
    `tokens_per_entry` tokens (compressed entries, layers/cache_layout.py) has `entries_per_page` slots a page
    instead: page p's entries are its slots [p * n, (p + 1) * n). Owned by the engine's runner; handed to
    backends."""

    def __init__(
        self,
        specs: Sequence[KVLayerSpec],
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        *,
        zeroed: bool = True,
        pin_memory: bool = False,
        tokens_per_entry: Sequence[int] | None = None,
    ) -> None:
        self.specs = list(specs)
        self.num_pages = num_pages
        self.page_size = page_size
        self.tokens_per_entry = list(tokens_per_entry) if tokens_per_entry is not None else [1] * len(self.specs)
        if len(self.tokens_per_entry) != len(self.specs):
            raise ValueError(f"{len(self.tokens_per_entry)} entry sizes for {len(self.specs)} layers")
        # Entry slots a page holds, per layer (page_size for a layer that keeps every token).
        self.slots_per_page = [entries_per_page(t, page_size) for t in self.tokens_per_entry]
        # zeros by default: padded rows of a batch read stale slots through a mask, and NaN garbage * 0 is NaN.
        # A host tier asks for empty memory: its pages are always written before they are read.
        make = torch.zeros if zeroed else torch.empty

        def alloc(heads: int, dim: int, per_page: int) -> torch.Tensor:
            return make((num_pages * per_page, heads, dim), dtype=dtype, device=device, pin_memory=pin_memory)

        self.k = [alloc(s.num_kv_heads, s.head_dim, n) for s, n in zip(self.specs, self.slots_per_page, strict=True)]
        self.v = [k if s.tied else alloc(s.num_kv_heads, s.v_head_dim or s.head_dim, n)
                  for s, k, n in zip(self.specs, self.k, self.slots_per_page, strict=True)]

    @classmethod
    def uniform(
        cls, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str,
    ) -> KVCache:
        """Every layer the same shape (most models)."""
        return cls(KVLayerSpec.uniform(num_layers, num_kv_heads, head_dim), num_pages, page_size, dtype, device)

    def like(self, num_pages: int, device: torch.device | str, *, zeroed: bool = True,
             pin_memory: bool = False) -> KVCache:
        """A cache of num_pages pages with this one's layers, entry sizes, page size and dtype (a host tier)."""
        return KVCache(self.specs, num_pages, self.page_size, self.dtype, device, zeroed=zeroed,
                       pin_memory=pin_memory, tokens_per_entry=self.tokens_per_entry)

    def same_layout(self, other: KVCache) -> bool:
        """Pages of one may be copied into the other as they are: the dtype too (an fp32 page is not fp16 bytes)."""
        return (self.page_size, self.specs, self.tokens_per_entry, self.dtype) == (
            other.page_size, other.specs, other.tokens_per_entry, other.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds data, each once (a tied layer's V is its K)."""
        return [*self.k, *(v for s, v in zip(self.specs, self.v, strict=True) if not s.tied)]

    def tensor_slots_per_page(self) -> list[int]:
        """Entry slots a page holds in each of `tensors()`, in the same order."""
        n = self.slots_per_page
        return [*n, *(m for s, m in zip(self.specs, n, strict=True) if not s.tied)]

    def page_slots(self, pages: Sequence[int], per_page: int, device: torch.device) -> torch.Tensor:
        """int64 [len(pages) * per_page]: the slots of `pages`, page-major, in a tensor of per_page slots a page."""
        p = torch.tensor(list(pages), dtype=torch.int64)
        return (p[:, None] * per_page + torch.arange(per_page, dtype=torch.int64)[None, :]).reshape(-1).to(device)

    @property
    def page_bytes(self) -> int:
        return self.bytes_per_page(self.specs, self.page_size, self.dtype, self.tokens_per_entry)

    @staticmethod
    def bytes_per_page(specs: Sequence[KVLayerSpec], page_size: int, dtype: torch.dtype,
                       tokens_per_entry: Sequence[int] | None = None) -> int:
        element = torch.tensor([], dtype=dtype).element_size()
        per_entry = tokens_per_entry if tokens_per_entry is not None else [1] * len(specs)
        return element * sum(entries_per_page(t, page_size) * s.values_per_token
                             for s, t in zip(specs, per_entry, strict=True))


def entries_per_page(tokens_per_entry: int, page_size: int) -> int:
    """Entry slots a page holds for a layer keeping one entry per tokens_per_entry tokens: page_size /
    tokens_per_entry, and one for an entry spanning several pages (kept in the page of its last token)."""
    if tokens_per_entry < 1:
        raise ValueError(f"tokens_per_entry must be at least 1, not {tokens_per_entry}")
    if tokens_per_entry <= page_size:
        if page_size % tokens_per_entry:
            raise ValueError(f"{tokens_per_entry} tokens an entry do not divide a page of {page_size}")
        return page_size // tokens_per_entry
    if tokens_per_entry % page_size:
        raise ValueError(f"an entry of {tokens_per_entry} tokens is not a whole number of {page_size}-token pages")
    return 1


class AttentionBackend(ABC):
    """One instance per engine. `begin` is called once per step before the forward pass.

    CUDA graphs (engine/exec/graph_runner.py): a backend with `supports_cuda_graphs` reads only the metadata's device
    tensors on a decode step, so a graph captured once per batch size replays for any lengths. The runner calls
    `init_capture` once, `begin_capture` before capturing each batch size (the metadata's tensors are then its
    static buffers) and `begin_replay` before each replay (host-side work only: no allocation, no new tensors).
    """

    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False
    # --exact-cpu: CPU attention in fp32 products only (the torch backend's AMX tiles for prefill chunks are off).
    exact_cpu: bool = False

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
        scale: float | None = None,
    ) -> torch.Tensor:
        """q: [T, num_heads, D]; k, v: [T, num_kv_heads, D] for the step's T new tokens.
        Stores k/v at meta.slot_mapping in layer `layer_id`'s cache, returns [T, num_heads, D].
        sliding_window W: a query at position p sees keys max(0, p-W+1)..p. sinks: [num_heads] float
        logits joining each row's softmax denominator, contributing no value. Head counts and sizes are read
        from q and the layer's cache, and `scale` (None: the constructor's) is the layer's, so layers of one
        model may differ (Gemma 4: 256-wide sliding layers, 512-wide global ones, scale 1)."""

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
