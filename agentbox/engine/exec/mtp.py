"""Drafts from the checkpoint's own multi-token-prediction head (models/mtp.py), after each step's sampling: the
head's KV is kept up to date for every sequence of the step, and each sampled sequence gets a
draft of up to `spec_mtp_tokens` tokens for its next step (engine/draft.py proposes it, the verify keeps what the
model agrees with, exactly as for a suffix draft).

Why after sampling: the head reads the model's hidden state at p with the token at p + 1, and for the last rows
of a step that token is the one just sampled (for a verify, only the rows the model agreed with are real). So the
step's rows are paired with their next tokens (`plan`): the prompt's own for a prefill chunk, the sampled ones for
the last rows; each pair's KV goes into position p's slot, which the step itself owns, so a rejected draft leaves
nothing to undo (its positions are written again when they are computed).

Drafting past the first token feeds the head its own output and the token it predicted (`chain`). Those positions
are past what the request has computed: a position inside a page the request holds writes its slot (computed
again later), one past them the pool's null page, read through a page table whose unheld columns point there; a
sequence's chain runs alone, so two chains never share a null-page slot. Only the head's own layer is written:
the model's KV and recurrent state are never touched, so greedy output with these drafts equals output without.

At tp > 1 the head's layers are split like the model's: rank 0 plans the head's work from its sampling
(`MtpStep`, the rows, their next tokens, where each chain starts) and sends it to the workers as a second message
of the step; every rank runs it, and since every rank gathers the same logits, every rank's chain drafts the same
tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
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


# The first int64 of an MtpStep's buffer: a StepInputs' is its token count (at least 1), so a worker tells them apart.
MTP_STEP_TAG = -1


@dataclass
class MtpStep:
    """What every rank runs of the head after a step (rank 0 plans it from the step's sampling; at tp > 1 it
    crosses to the workers as one int64 buffer, like StepInputs): the step's rows paired with the token after
    them, and per drafting sequence its chain's start (its last fill row, its page-table row, the pages it holds,
    its last filled position)."""

    rows: list[int]  # rows of the step's flattened batch with a known next token
    next_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_lens: list[int]
    kv_lens: list[int]
    table_rows: list[int]
    chains: list[tuple[int, int, int, int]] = field(default_factory=list)  # (fill row, table row, held pages, last)

    def pack(self) -> bytes:
        n, b, c = len(self.rows), len(self.query_lens), len(self.chains)
        flat = [MTP_STEP_TAG, n, b, c, *self.rows, *self.next_ids, *self.positions, *self.slots, *self.query_lens,
                *self.kv_lens, *self.table_rows, *(v for chain in self.chains for v in chain)]
        return np.array(flat, dtype=np.int64).tobytes()

    @staticmethod
    def unpack(buf: bytes) -> MtpStep:
        flat = np.frombuffer(buf, dtype=np.int64).tolist()
        _, n, b, c = flat[:4]
        o = 4
        parts = []
        for size in (n, n, n, n, b, b, b):
            parts.append(flat[o : o + size])
            o += size
        chains = [tuple(flat[o + 4 * i : o + 4 * i + 4]) for i in range(c)]
        return MtpStep(*parts, chains=chains)  # type: ignore[arg-type]


def is_mtp_step(buf: bytes) -> bool:
    return int(np.frombuffer(buf[:8], dtype=np.int64)[0]) == MTP_STEP_TAG


class MtpDrafter:
    """The head on every rank: rank 0 `plan`s a step's MtpStep from its sampling; every rank `execute`s it
    (collectives meet in the head's layers at tp > 1) and gets the same drafts, one per chain."""

    def __init__(self, model: CausalLM, backend: AttentionBackend, page_table: PageTable, page_size: int,
                 num_tokens: int, max_model_len: int) -> None:
        assert model.mtp is not None, "built only for a model whose MTP head is loaded"
        self.model, self.head = model, model.mtp
        self.backend, self.page_table, self.page_size = backend, page_table, page_size
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len  # a chain stops there: no page-table column or rope position past it
        self.device = page_table.table.device

    def plan(self, out: SchedulerOutput, step: StepInputs, tokens: list[list[int]],
             failed: dict[int, str]) -> tuple[MtpStep, list[tuple[int, int]]]:
        """The step's MtpStep, and per chain (its sampled seq's index, the token count its draft follows)."""
        plan = MtpStep([], [], [], [], [], [], [])
        owners: list[tuple[int, int]] = []
        off, k = 0, 0
        for s, q in zip(out.seqs, step.query_lens, strict=True):
            r, h = s.request, s.request.cache_handle
            start, real = r.num_computed_tokens, q - len(s.draft)
            i = None
            if s.sample:
                i, k = k, k + 1
                nxt = r.token_ids[start + 1 : start + real] + ([] if i in failed else tokens[i])
            else:
                nxt = r.token_ids[start + 1 : start + real + 1]
            n = min(len(nxt), q)
            if n:
                plan.rows += range(off, off + n)
                plan.next_ids += nxt[:n]
                plan.query_lens.append(n)
                plan.kv_lens.append(start + n)
                plan.table_rows.append(h.row)
                if i is not None and i not in failed and n == real - 1 + len(tokens[i]):
                    plan.chains.append((len(plan.rows) - 1, h.row, len(h.pages), start + n - 1))
                    owners.append((i, r.num_tokens + len(tokens[i])))
            off += q
        plan.positions = step.positions[plan.rows].tolist() if plan.rows else []
        plan.slots = step.slot_mapping[plan.rows].tolist() if plan.rows else []
        return plan, owners

    @torch.inference_mode()
    def execute(self, plan: MtpStep, hidden: torch.Tensor) -> list[list[int]]:
        """Fills the head's KV for the plan's rows; returns each chain's draft tokens."""
        if not plan.rows:
            return []
        dev = self.device
        meta = AttentionMetadata(
            query_lens=plan.query_lens, kv_lens=plan.kv_lens,
            page_table=self.page_table.rows(torch.tensor(plan.table_rows), -(-max(plan.kv_lens) // self.page_size)),
            slot_mapping=torch.tensor(plan.slots, device=dev), page_size=self.page_size,
        )
        rows = torch.tensor(plan.rows, device=hidden.device)
        with forward_context(self.backend, meta):
            out_hidden = self.head(torch.tensor(plan.next_ids, device=dev), hidden[rows],
                                   torch.tensor(plan.positions, device=dev))
        drafts = []
        for j, row, held, last in plan.chains:
            first = int(self.model.compute_logits(out_hidden[j : j + 1]).argmax(-1))
            drafts.append([first, *self._chain(row, held, out_hidden[j : j + 1], first, last)])
        return drafts

    def _chain(self, row: int, held: int, hidden: torch.Tensor, token: int, p_last: int) -> list[int]:
        """Draft tokens 2..num_tokens: the head on its own output and the token it predicted."""
        ps, drafts = self.page_size, []
        for m in range(1, self.num_tokens):
            pos = p_last + m
            if pos >= self.max_model_len:
                break
            cols = pos // ps + 1
            table = self.page_table.rows(torch.tensor([row]), cols).clone()
            table[0, held:] = 0  # columns the request does not hold: the null page, where the chain writes
            slot = int(table[0, pos // ps]) * ps + pos % ps
            meta = AttentionMetadata(query_lens=[1], kv_lens=[pos + 1], page_table=table,
                                     slot_mapping=torch.tensor([slot], device=self.device), page_size=ps)
            with forward_context(self.backend, meta):
                hidden = self.head(torch.tensor([token], device=self.device), hidden,
                                   torch.tensor([pos], device=self.device))
            token = int(self.model.compute_logits(hidden).argmax(-1))
            drafts.append(token)
        return drafts
