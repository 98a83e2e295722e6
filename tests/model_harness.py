"""A tiny paged runner for model tests: what the engine's runner does, minus scheduling.

Each sequence owns a list of pages (taken from the top of the pool, so page ids are not in order and the
page-table indirection is really exercised). `step` runs one batch where every listed sequence brings some
new tokens (1 for a decode, more for a prefill chunk) and returns each sequence's logits. A model whose layout has
paged groups of several tokens an entry (DeepSeek-V4's compressed entries) gets each group's slots per step, as
the engine's runner gives them.
"""

from __future__ import annotations

import torch

from agentbox.engine.exec.cpu_decode import CpuDecode
from agentbox.engine.exec.cpu_hybrid import HybridCpuDecode
from agentbox.layers.backends.base import AttentionBackend, AttentionMetadata, KVCache
from agentbox.layers.backends.torch_backend import TorchAttention
from agentbox.layers.context import forward_context
from agentbox.layers.paged_entries import EntryStep, entry_slot_mapping
from agentbox.layers.recurrent_state import StateCache, StateStep
from agentbox.models.loader import LoadedModel


class PagedRunner:
    def __init__(
        self,
        loaded: LoadedModel,
        num_pages: int = 64,
        page_size: int = 4,
        backend_cls: type[AttentionBackend] = TorchAttention,
        device: str = "cpu",
        kv_dtype: torch.dtype | None = None,  # None: the model's dtype (the engine's default CPU pool is fp16)
    ) -> None:
        self.model = loaded.model
        self.device = device
        self.page_size = page_size
        dtype = loaded.dtype
        layout = loaded.layout
        self.cache = KVCache(loaded.kv_specs, num_pages, page_size, kv_dtype or dtype, device,
                             tokens_per_entry=layout.tokens_per_entry)
        self.entry_groups = layout.entry_groups
        self.backend = backend_cls(
            self.cache, loaded.num_heads, loaded.num_kv_heads, loaded.head_dim, loaded.head_dim**-0.5
        )
        dev = torch.device(device)  # as the engine's runner chooses
        self.cpu_decode = CpuDecode.build(self.model, dev) or HybridCpuDecode.build(self.model, dev)
        self.free_pages = list(range(num_pages))
        # Hybrid models: a recurrent-state slot per sequence (sequence ids are small ints: the slot is the id)
        state = loaded.layout.state
        self.state = StateCache(list(state.specs), 16, dtype, device) if state is not None else None
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, chunks: dict[int, list[int]], verifies: frozenset[int] = frozenset()) -> dict[int, torch.Tensor]:
        """chunks: sequence id -> its new token ids this step; verifies: indices (in `chunks` order) of sequences
        whose state waits for a commit (a speculative verify). Returns sequence id -> logits [n_new, vocab]."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        kv_lens: list[int] = []
        for seq, tokens in chunks.items():
            start = self.lens.get(seq, 0)
            pages = self.pages.setdefault(seq, [])
            for pos in range(start, start + len(tokens)):
                if pos // self.page_size >= len(pages):
                    pages.append(self.free_pages.pop())
                slots.append(pages[pos // self.page_size] * self.page_size + pos % self.page_size)
                positions.append(pos)
            ids += tokens
            query_lens.append(len(tokens))
            kv_lens.append(start + len(tokens))
            self.lens[seq] = start + len(tokens)
        max_pages = max(len(self.pages[s]) for s in chunks)
        table = [self.pages[s] + [0] * (max_pages - len(self.pages[s])) for s in chunks]
        meta = AttentionMetadata(
            query_lens=query_lens,
            kv_lens=kv_lens,
            page_table=torch.tensor(table, dtype=torch.int32, device=self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            page_size=self.page_size,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=self.device)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=self.device)
        state = None if self.state is None else StateStep.of(self.state, list(chunks), query_lens, kv_lens, verifies)
        with forward_context(self.backend, meta, state=state, entries=self._entries(chunks, meta)):
            if self.cpu_decode is not None and self.cpu_decode.fits(meta, self.cache):
                hidden = self.cpu_decode.run(input_ids, pos_t)
            else:
                hidden = self.model(input_ids, pos_t)
        logits = self.model.compute_logits(hidden)
        return dict(zip(chunks, logits.split(query_lens), strict=True))

    def _entries(self, chunks: dict[int, list[int]], meta: AttentionMetadata) -> dict[int, EntryStep]:
        out = {}
        for t in self.entry_groups:
            per_page = self.cache.slots_per_page[self.cache.tokens_per_entry.index(t)]
            slots: list[int] = []
            for seq, tokens in chunks.items():
                end = self.lens[seq]
                slots += entry_slot_mapping(t, per_page, self.page_size, list(range(end - len(tokens), end)),
                                            self.pages[seq])
            out[t] = EntryStep(t, per_page, self.page_size, torch.tensor(slots, dtype=torch.int64, device=self.device),
                               meta.page_table, meta.query_lens, meta.kv_lens)
        return out

    def greedy(self, seq: int, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Prefill the prompt in one step, then decode greedily; returns the generated ids."""
        out: list[int] = []
        logits = self.step({seq: prompt})[seq]
        for _ in range(max_new_tokens):
            out.append(int(logits[-1].argmax()))
            logits = self.step({seq: [out[-1]]})[seq]
        return out


def assert_mixed_batch_equals_alone(ours: LoadedModel, prompt: list[int]) -> None:
    """Four sequences (`prompt` and three others) stepped together on 4-token pages: step 1 prefills first
    chunks; step 2 has 0 and 2 decoding while 1 and 3 prefill a chunk after their cached prefix; step 3 has
    everyone finish in one mixed step. Their logits equal each sequence run alone."""
    seqs = {0: prompt, 1: [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11], 2: [100, 101], 3: list(range(30, 47))}
    alone = {s: PagedRunner(ours).step({s: toks})[s] for s, toks in seqs.items()}
    runner = PagedRunner(ours, num_pages=64, page_size=4)
    plan = [
        {0: prompt[:10], 1: seqs[1][:5], 2: seqs[2][:1], 3: seqs[3][:3]},
        {0: prompt[10:11], 1: seqs[1][5:9], 2: seqs[2][1:2], 3: seqs[3][3:12]},
        {0: prompt[11:], 1: seqs[1][9:], 3: seqs[3][12:]},
    ]
    pieces: dict[int, list[torch.Tensor]] = {s: [] for s in seqs}
    for chunks in plan:
        for s, logits in runner.step(chunks).items():
            pieces[s].append(logits)
    for s in seqs:
        torch.testing.assert_close(torch.cat(pieces[s]), alone[s], atol=1e-5, rtol=1e-5)
