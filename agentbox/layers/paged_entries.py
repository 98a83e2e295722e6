"""A step's view of a paged group that keeps one entry per `tokens_per_entry` tokens (compressed entries,
layers/cache_layout.py): where the entries this step completes go, and where each sequence's entries are.

Entry e of a sequence covers its tokens [e t, (e + 1) t) (t = tokens_per_entry) and is complete once token
(e + 1) t - 1 is computed: the step's slot mapping for the group names, for each new token, the slot of the entry it
completes (-1 for a token that completes none). An entry lives in the page of its last token, at slot
page * entries_per_page + (l mod page_size) / t (l = (e + 1) t - 1). Every group shares the step's page-table rows
(the pool's page ids are every group's): the runner builds this per step (engine/exec/runner.py) and a layer that
keeps such entries reads it from the forward context (`ForwardContext.entries[t]`).

Why the last token's page: a cached page is shared by every sequence whose tokens match up to its end, and an
entry depends on all of its tokens. In the page of its last token an entry is written only by a sequence that
computes that whole page, so every sharer holds the same entry; an entry spanning pages (HCA: 128 tokens, pages
of 16) kept in the page of its first token would be written into a page already shared at a prefix that ends
inside the entry, by each sequence that continues it differently.

A layer writes what its step completes (`write`) and reads a sequence's complete entries (`gather`); what is
not yet a whole entry (the tail after the last complete one) is the layer's own business: it can recompute it
from the token-granular cache, or keep it in the model's state group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EntryStep:
    tokens_per_entry: int
    entries_per_page: int
    page_size: int
    slot_mapping: torch.Tensor  # int64 [T]: the slot of the entry each new token completes, -1 for none
    page_table: torch.Tensor  # [B, cols] the step's rows of the page table (shared by every group)
    query_lens: list[int]
    kv_lens: list[int]

    def num_entries(self, i: int) -> int:
        """Sequence i's complete entries after this step."""
        return self.kv_lens[i] // self.tokens_per_entry

    def entry_slots(self, i: int, count: int | None = None) -> torch.Tensor:
        """int64 [count]: the slots of sequence i's first `count` entries (all its complete ones by default)."""
        n = self.num_entries(i) if count is None else count
        t = self.tokens_per_entry
        last = torch.arange(1, n + 1, dtype=torch.int64, device=self.page_table.device) * t - 1  # each entry's last token
        pages = self.page_table[i, last // self.page_size].to(torch.int64)
        return pages * self.entries_per_page + (last % self.page_size) // t

    def write(self, cache: torch.Tensor, values: torch.Tensor) -> None:
        """values [T, ...]: row j is what token j's completed entry holds (rows of tokens that complete none are
        ignored); written into `cache` (a layer's [slots, ...] tensor of this group) at their slots."""
        mask = self.slot_mapping >= 0
        if bool(mask.any()):
            cache[self.slot_mapping[mask].to(cache.device)] = values[mask.to(values.device)].to(cache.dtype)

    def gather(self, cache: torch.Tensor, i: int, count: int | None = None) -> torch.Tensor:
        """[count, ...]: sequence i's first `count` entries (its complete ones by default) from `cache`."""
        return cache[self.entry_slots(i, count).to(cache.device)]


def entry_slot_mapping(tokens_per_entry: int, entries_per_page: int, page_size: int, positions: list[int],
                       pages: list[int]) -> list[int]:
    """For each of one sequence's new tokens at `positions`, the slot of the entry it completes (-1: none);
    `pages`: the sequence's page ids."""
    t = tokens_per_entry
    out = []
    for p in positions:
        if (p + 1) % t:
            out.append(-1)
            continue
        out.append(pages[p // page_size] * entries_per_page + (p % page_size) // t)  # p: the entry's last token
    return out
