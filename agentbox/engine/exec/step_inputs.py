"""The step contract: what every tensor-parallel rank needs to run one forward pass, and nothing more.

Rank 0 builds a `StepInputs` from a SchedulerOutput (engine/exec/runner.py `prepare`); every rank runs it
(`execute`). It holds plain tensors and ints, never a Request, so it crosses to a worker as one compact
int64 buffer (`pack` / `unpack`). Page tables do not travel whole: each rank keeps a persistent table
(engine/exec/page_table.py) and the step carries only the entries that changed since the last step, so neither
the host work nor the bytes sent grow with a request's context length.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

_HEADER = 9  # num tokens, num seqs, num page updates, num sampled rows, page table columns, state copies,
# state commits, state verifies, entry groups


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # int64 [T]: the step's new tokens, sequences one after another
    positions: torch.Tensor  # int64 [T]: each token's position in its sequence
    slot_mapping: torch.Tensor  # int64 [T]: KV slot (page * page_size + offset) each token's k/v goes to
    query_lens: list[int]  # [B]: new tokens per sequence (1 when decoding)
    kv_lens: list[int]  # [B]: tokens per sequence in the cache after this step
    table_rows: torch.Tensor  # int64 [B]: each sequence's row in the persistent page table
    page_updates: torch.Tensor  # int64 [U, 3]: (row, column, page) entries written before the step
    sample_rows: torch.Tensor  # int64 [S]: token rows whose logits are sampled (last new token of a seq)
    num_table_cols: int  # page-table columns this step reads (pages of its longest sequence)
    # int64 [C, 2]: hybrid models' (src, dst) recurrent-state slot copies done before the step (a snapshot
    # saved at a turn's end, a request seeded from one)
    state_copies: torch.Tensor = field(default_factory=lambda: torch.empty(0, 2, dtype=torch.int64))
    # int64 [M, 3]: the last step's verifies, (slot, positions kept, page-aligned copy after) done before the
    # copies (engine/exec/verify_state.py); int64 [V]: this step's sequences that are verifies of such models
    state_commits: torch.Tensor = field(default_factory=lambda: torch.empty(0, 3, dtype=torch.int64))
    state_verifies: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    # int64 [G, T]: for each paged group size of more than one token an entry (the layout's `entry_groups`, in
    # order), the slot of the entry each new token completes (-1: none). The page table is every group's: the
    # pool's page ids index every group's tensors (layers/cache_layout.py).
    entry_slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, 0, dtype=torch.int64))

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    def pack(self) -> bytes:
        """One int64 buffer: a header of counts, then every field in order."""
        t, b, u, s = self.num_tokens, len(self.query_lens), int(self.page_updates.shape[0]), int(self.sample_rows.numel())
        c, m, v = int(self.state_copies.shape[0]), int(self.state_commits.shape[0]), int(self.state_verifies.numel())
        g = int(self.entry_slots.shape[0])
        head = np.array([t, b, u, s, self.num_table_cols, c, m, v, g, *self.query_lens, *self.kv_lens], dtype=np.int64)
        parts = [self.input_ids, self.positions, self.slot_mapping, self.table_rows, self.page_updates.reshape(-1),
                 self.sample_rows, self.state_copies.reshape(-1), self.state_commits.reshape(-1), self.state_verifies,
                 self.entry_slots.reshape(-1)]
        # numpy, not torch.cat: a decode step's pack is a few microseconds instead of tens (measured 70 us).
        return np.concatenate([head, *(p.numpy() for p in parts)]).tobytes()

    @staticmethod
    def unpack(buf: bytes) -> StepInputs:
        flat = torch.frombuffer(bytearray(buf), dtype=torch.int64)
        t, b, u, s, cols, c, m, v, g = flat[:_HEADER].tolist()
        lens = flat[_HEADER : _HEADER + 2 * b].tolist()
        o = _HEADER + 2 * b
        sizes = [t, t, t, b, 3 * u, s, 2 * c, 3 * m, v, g * t]
        ids, pos, slots, rows, updates, sample, copies, commits, verifies, entries = torch.split(
            flat[o : o + sum(sizes)], sizes)
        return StepInputs(ids, pos, slots, lens[:b], lens[b:], rows, updates.reshape(u, 3), sample, cols,
                          copies.reshape(c, 2), commits.reshape(m, 3), verifies, entries.reshape(g, t))
