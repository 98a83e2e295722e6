"""What a model caches, as the model declares it (`CausalLM.cache_layout`, models/base.py) and the engine reads it:
the engine sizes its pools, its page tables and its snapshots from this, never from the model's class.

- A `PagedGroup` is a set of layers whose cache grows with the context: one entry per `tokens_per_entry` tokens
  (1 for ordinary and latent attention; 4 or 128 for compressed entries), kept in the paged pool. Every group
  shares the pool's page ids: page p holds, in each group's own tensors, that group's entries for the
  page's `page_size` tokens (`entries_per_page`). So one page table and one radix tree serve every group, and a
  prefix cached for one group is cached for all. A group whose entry spans more than a page keeps one entry
  slot per page, in the page holding the entry's last token (the price of one table: at page 16 and 128
  tokens an entry, 7 of 8 such slots stay empty; the last token's page, because only a sequence that computes
  that whole page writes there, layers/paged_entries.py).
- A `StateGroup` is per-sequence state of fixed size (a Gated DeltaNet layer's conv and matrix, a sliding
  window's ring): it describes exactly the position it was computed to, so a cached prefix resumes only where a
  snapshot of it was saved (engine/cache/state_snapshots.py). A ring (`WindowKVSpec`) keeps a page of slack
  and so resumes anywhere in its last page by itself; any other spec needs the page-aligned copy the runner
  keeps.

The first paged group's layers come first in the flat layer numbering (`kv_specs`): an attention layer's
`layer_id` indexes that list, and the attention backend writes the token-granular groups at the step's slot
mapping; a group of `tokens_per_entry` > 1 gets its own slot mapping per step (layers/paged_entries.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from agentbox.layers.backends.base import KVLayerSpec, entries_per_page
from agentbox.layers.recurrent_state import StateSpec


@dataclass(frozen=True)
class PagedGroup:
    """Layers that keep one entry per `tokens_per_entry` tokens in the paged pool (their KV shapes on this rank)."""

    layers: tuple[KVLayerSpec, ...]
    tokens_per_entry: int = 1

    def __post_init__(self) -> None:
        if self.tokens_per_entry < 1:
            raise ValueError(f"tokens_per_entry must be at least 1, not {self.tokens_per_entry}")

    def entries_per_page(self, page_size: int) -> int:
        """Entry slots a page holds for this group: page_size / tokens_per_entry, at least one."""
        return entries_per_page(self.tokens_per_entry, page_size)


@dataclass(frozen=True)
class StateGroup:
    """Layers that keep fixed-size per-sequence state (their `state_index` is their place in `specs`)."""

    specs: tuple[StateSpec, ...]


@dataclass(frozen=True)
class CacheLayout:
    paged: tuple[PagedGroup, ...]
    state: StateGroup | None = None

    def __post_init__(self) -> None:
        if not self.paged or not any(g.layers for g in self.paged):
            raise ValueError("a cache layout needs at least one paged layer (the radix cache keys on pages)")

    @property
    def kv_specs(self) -> list[KVLayerSpec]:
        """Every paged layer, group after group: the flat numbering attention layers' `layer_id` index."""
        return [s for g in self.paged for s in g.layers]

    @property
    def has_state(self) -> bool:
        return self.state is not None and bool(self.state.specs)

    @property
    def tokens_per_entry(self) -> list[int]:
        """For each layer of `kv_specs`, its group's tokens per entry (KVCache's `tokens_per_entry`)."""
        return [g.tokens_per_entry for g in self.paged for _ in g.layers]

    @property
    def entry_groups(self) -> list[int]:
        """The distinct tokens-per-entry sizes above 1, ascending: a step carries a slot mapping for each."""
        return sorted({g.tokens_per_entry for g in self.paged if g.tokens_per_entry > 1})

    @staticmethod
    def uniform(num_layers: int, num_kv_heads: int, head_dim: int) -> CacheLayout:
        """One paged group of num_layers layers of num_kv_heads x head_dim (most models)."""
        return CacheLayout((PagedGroup(tuple(KVLayerSpec.uniform(num_layers, num_kv_heads, head_dim))),))
