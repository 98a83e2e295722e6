"""Drafts from the checkpoint's own multi-token-prediction head (models/mtp.py), on rank 0 after each step's
sampling: the head's KV is kept up to date for every sequence of the step, and each sampled sequence gets a
draft of up to `spec_mtp_tokens` tokens for its next step (engine/draft.py proposes it, the verify keeps what the
model agrees with, exactly as for a suffix draft).

Why after sampling: the head reads the model's hidden state at p with the token at p + 1, and for the last rows
of a step that token is the one just sampled (for a verify, only the rows the model agreed with are real). So the
step's rows are paired with their next tokens (`fill`): the prompt's own for a prefill chunk, the sampled ones for
the last rows; each pair's KV goes into position p's slot, which the step itself owns, so a rejected draft leaves
nothing to undo (its positions are written again when they are computed).

Drafting past the first token feeds the head its own output and the token it predicted (`chain`). Those positions
are past what the request has computed: a position inside a page the request holds writes its slot (computed
again later), one past them the pool's null page, read through a page table whose unheld columns point there; a
sequence's chain runs alone, so two chains never share a null-page slot. Only the head's own layer is written:
the model's KV and recurrent state are never touched, so greedy output with these drafts equals output without.

Tensor-parallel ranks would each need the sampled tokens before the next step: MTP drafting runs at tp 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agentbox.engine.exec.page_table import PageTable
from agentbox.engine.exec.step_inputs import StepInputs
from agentbox.layers.backends.base import AttentionBackend, AttentionMetadata
from agentbox.layers.context import forward_context
from agentbox.models.base import CausalLM

if TYPE_CHECKING:  # the core's types, for hints only: exec must not import the core at run time
    from agentbox.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class MtpDraft:
    """Draft tokens to follow a request whose token count is `after` (void for any other count: a stop or a
    closing grammar kept fewer of the step's tokens)."""

    tokens: list[int]
    after: int


@dataclass
class _Fill:
    rows: list[int]  # rows of the step's flattened batch with a known next token
    next_ids: list[int]
    query_lens: list[int]
    kv_lens: list[int]
    table_rows: list[int]
    last: dict[int, int]  # sampled index -> its last row in the fill batch


class MtpDrafter:
    """Runs the head: `run` after a step's sampling returns each sampled sequence's draft (or None)."""

    def __init__(self, model: CausalLM, backend: AttentionBackend, page_table: PageTable, page_size: int,
                 num_tokens: int, max_model_len: int) -> None:
        assert model.mtp is not None, "built only for a model whose MTP head is loaded"
        self.model, self.head = model, model.mtp
        self.backend, self.page_table, self.page_size = backend, page_table, page_size
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len  # a chain stops there: no page-table column or rope position past it
        self.device = page_table.table.device

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, step: StepInputs, hidden: torch.Tensor, tokens: list[list[int]],
            failed: dict[int, str]) -> list[MtpDraft | None]:
        fill = self._fill(out, step, tokens, failed)
        drafts: list[MtpDraft | None] = [None] * len(tokens)
        if not fill.rows:
            return drafts
        rows = torch.tensor(fill.rows, dtype=torch.int64)
        positions = step.positions[rows].to(self.device)
        meta = AttentionMetadata(
            query_lens=fill.query_lens, kv_lens=fill.kv_lens,
            page_table=self.page_table.rows(torch.tensor(fill.table_rows), -(-max(fill.kv_lens) // self.page_size)),
            slot_mapping=step.slot_mapping[rows].to(self.device), page_size=self.page_size,
        )
        with forward_context(self.backend, meta):
            out_hidden = self.head(torch.tensor(fill.next_ids, device=self.device), hidden[rows.to(hidden.device)],
                                   positions)
        sampled = [s for s in out.seqs if s.sample]
        for i, j in fill.last.items():
            s = sampled[i]
            first = int(self.model.compute_logits(out_hidden[j : j + 1]).argmax(-1))
            p_last = int(positions[j])
            chain = self._chain(s.request.cache_handle.pages, s.request.cache_handle.row, out_hidden[j : j + 1],
                                first, p_last)
            drafts[i] = MtpDraft([first, *chain], s.request.num_tokens + len(tokens[i]))
        return drafts

    def _fill(self, out: SchedulerOutput, step: StepInputs, tokens: list[list[int]],
              failed: dict[int, str]) -> _Fill:
        """Each sequence's rows paired with the token after them, where known."""
        fill = _Fill([], [], [], [], [], {})
        off, k = 0, 0
        for s, q in zip(out.seqs, step.query_lens, strict=True):
            r = s.request
            start, real = r.num_computed_tokens, q - len(s.draft)
            i = None
            if s.sample:
                i, k = k, k + 1
                nxt = r.token_ids[start + 1 : start + real] + ([] if i in failed else tokens[i])
            else:
                nxt = r.token_ids[start + 1 : start + real + 1]
            n = min(len(nxt), q)
            if n:
                fill.rows += range(off, off + n)
                fill.next_ids += nxt[:n]
                fill.query_lens.append(n)
                fill.kv_lens.append(start + n)
                fill.table_rows.append(r.cache_handle.row)
                if i is not None and i not in failed and n == real - 1 + len(tokens[i]):
                    fill.last[i] = len(fill.rows) - 1
            off += q
        return fill

    def _chain(self, pages: list[int], row: int, hidden: torch.Tensor, token: int, p_last: int) -> list[int]:
        """Draft tokens 2..num_tokens: the head on its own output and the token it predicted."""
        ps, drafts = self.page_size, []
        for m in range(1, self.num_tokens):
            pos = p_last + m
            if pos >= self.max_model_len:
                break
            held = pos // ps < len(pages)
            slot = (pages[pos // ps] if held else 0) * ps + pos % ps
            cols = pos // ps + 1
            table = self.page_table.rows(torch.tensor([row]), cols).clone()
            table[0, len(pages):] = 0  # columns the request does not hold: the null page, where the chain writes
            meta = AttentionMetadata(query_lens=[1], kv_lens=[pos + 1], page_table=table,
                                     slot_mapping=torch.tensor([slot], device=self.device), page_size=ps)
            with forward_context(self.backend, meta):
                hidden = self.head(torch.tensor([token], device=self.device), hidden,
                                   torch.tensor([pos], device=self.device))
            token = int(self.model.compute_logits(hidden).argmax(-1))
            drafts.append(token)
        return drafts
