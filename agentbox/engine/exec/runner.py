"""The model runner, in two halves. Rank 0 turns a SchedulerOutput into a `StepInputs` (`prepare`: the
only half that sees Requests); every tensor-parallel rank runs `execute(StepInputs)` on its own shard of
the weights and its own heads of the KV pool. Only rank 0 samples: the LM head all-gathers the logits, so
rank 0 holds the whole vocabulary row after `execute`."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from agentbox import allocator
from agentbox.config import EngineConfig
from agentbox.engine.exec import memory_budget
from agentbox.engine.exec.cpu_decode import CpuDecode
from agentbox.engine.exec.cpu_hybrid import HybridCpuDecode
from agentbox.engine.exec.cpu_threads import Spare, step_threads, torch_threads
from agentbox.engine.exec.graph_runner import DecodeGraphs, build_decode_graphs
from agentbox.engine.exec.logprob import TokenLogprob
from agentbox.engine.exec.mtp import MtpDraft, MtpDrafter, MtpStep
from agentbox.engine.exec.page_table import PageTable, RowWriter
from agentbox.engine.exec.step_inputs import StepInputs
from agentbox.engine.exec.verify import sample_verified
from agentbox.engine.exec.verify_state import PendingVerifies
from agentbox.layers.backends import select_backend
from agentbox.layers.backends.base import AttentionMetadata, KVCache
from agentbox.layers.cache_layout import CacheLayout
from agentbox.layers.context import forward_context
from agentbox.layers.experts.placement import ExpertPlacement, ExpertTimes
from agentbox.layers.paged_entries import EntryStep, entry_slot_mapping
from agentbox.layers.quant import int4, resident_weight_bytes
from agentbox.layers.recurrent_state import StateStep
from agentbox.models.loader import LoadedModel, host_expert_bytes, load_model
from agentbox.parallel.state import control_all_gather, tp_rank, tp_size

if TYPE_CHECKING:  # the core's types, for hints only: exec must not import the core at run time
    from agentbox.engine.cache.seq_cache import SeqCache
    from agentbox.engine.scheduler import ScheduledSeq, SchedulerOutput

log = logging.getLogger(__name__)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """Rank r runs on the r-th GPU after the configured one (cuda -> cuda:r, cuda:2 -> cuda:2+r), or the CPU."""
    dev = torch.device(config.resolved_device)
    if dev.type != "cuda":
        return dev
    return torch.device("cuda", (dev.index or 0) + rank)


@dataclass
class StepResult:
    """What a step computed, for the core: per sampled seq, in order, its new tokens (one, or a verified draft's
    accepted prefix plus one) and logprobs; the seqs whose sampling failed (index -> why: that request's error,
    not the engine's); and where the rows' page-aligned state copies now stand ((handle, position), in the
    order they moved: the core tells the cache)."""

    tokens: list[list[int]]
    logprobs: list[TokenLogprob | None]
    failed: dict[int, str]
    aligned: list[tuple[SeqCache, int]] = field(default_factory=list)
    drafts: list[MtpDraft | None] = field(default_factory=list)  # per sampled seq: the MTP head's draft, if any


class StepSender(Protocol):
    """Where rank 0 sends each step for ranks 1..tp-1 (engine/exec/worker.py TPWorkers)."""

    def send_step(self, step: StepInputs) -> None: ...

    def send_mtp(self, plan: MtpStep) -> None: ...


class ModelRunner:
    def __init__(
        self, config: EngineConfig, loaded: LoadedModel | None = None, workers: StepSender | None = None
    ) -> None:
        self.config = config
        self.rank, self.tp = tp_rank(), tp_size()
        if self.tp != config.tensor_parallel_size:
            raise RuntimeError(f"tp state {self.tp} != config {config.tensor_parallel_size} (join the group first)")
        self.workers = workers
        self.device = rank_device(config, self.rank)
        self.dtype = DTYPES[config.resolved_dtype]
        torch.manual_seed(config.seed)
        self._set_threads()
        allocator.keep_freed_memory()  # steps reuse the memory they free (allocator.py)
        if loaded is None:
            exact = int4.cpu_kernel(int4.Int4Kernel.DENSE) if config.exact_cpu else contextlib.nullcontext()
            with exact:
                loaded = load_model(config.model, self.dtype, self.device,
                                    ExpertPlacement.of(config.cpu_moe, config.n_cpu_moe),
                                    with_mtp=config.speculative.uses_mtp)
        self.loaded = loaded
        self.kv_dtype = self._kv_dtype()
        self.placement = loaded.placement
        self.host_expert_bytes = host_expert_bytes(loaded.model)
        self.expert_times = ExpertTimes()
        self.layout: CacheLayout = loaded.layout
        self.weight_bytes = resident_weight_bytes(loaded.model)
        self.weight_bytes_per_rank = control_all_gather(self.weight_bytes)
        self.page_size = config.resolved_page_size
        # One page-table row per running request, and one for LLM.logits unless a row carries state (a ring of
        # Gemma 4 31B is 800 MiB: LLM.logits waits for a free row instead).
        self.num_rows = config.max_num_seqs + (0 if self.layout.has_state else 1)
        self.num_snapshots = self.num_rows if config.state_snapshots is None else config.state_snapshots
        self.state_in_place = False  # sliding rings: the live slot is its own page-aligned copy (memory_budget.py)
        self.max_num_seqs = config.max_num_seqs  # fewer when per-sequence state does not fit (memory_budget.py)
        self.num_host_snapshots = 0  # snapshots demoted to host RAM; set with the state cache
        # Before the KV pool, which takes a share of what is free after it.
        self.state_cache = memory_budget.state_cache(self)
        self.verifies = PendingVerifies(self.page_size) if self.state_cache is not None else None
        page_bytes = self._make_pool()
        self._make_execution()
        log.info(
            "rank %d/%d: weights %.1f MiB, KV pool %d pages of %d tokens (%.1f MiB, %s), attention backend %s, "
            "max_model_len %d", self.rank, self.tp, self.weight_bytes / 2**20, self.num_pages, self.page_size,
            self.num_pages * page_bytes / 2**20, str(self.kv_dtype).removeprefix("torch."), self.backend.name,
            self.max_model_len,
        )
        if self.device.type == "cpu":
            from agentbox.kernels import cpu_gemv

            log.info("CPU kernels: %s", cpu_gemv.describe())

    def _kv_dtype(self) -> torch.dtype:
        """The KV pool's: fp16 on CPU by default (EngineConfig.kv_dtype says why), unless the model reads it raw or
        keeps compressed entries (several tokens an entry: their layers read them as stored)."""
        narrow = self.loaded.model.narrow_cpu_kv and not self.loaded.layout.entry_groups
        return DTYPES[self.config.resolved_kv_dtype] if narrow else self.dtype

    def _set_threads(self) -> None:
        self.spare = Spare()  # whether a step may take the API process's core too (cpu_threads.py)
        if self.device.type == "cpu":
            # Oversubscribed threads are far slower than fewer threads on a small CPU (measured 5x at 2 vs 1
            # thread on 2 cores with the API process busy), so leave one core to everything else and split
            # the rest between the ranks.
            torch.set_num_threads(self.config.cpu_threads or max(1, ((os.cpu_count() or 2) - 1) // self.tp))
        elif self.tp > 1:
            torch.cuda.set_device(self.device)

    def _make_pool(self) -> int:
        """The KV pool and the context length it allows; returns the bytes of one page."""
        config, lm = self.config, self.loaded
        layout = self.layout
        page_bytes = KVCache.bytes_per_page(layout.kv_specs, self.page_size, self.kv_dtype, layout.tokens_per_entry)
        # Page ids mean the same slots on every rank, so every rank's pool has the smallest rank's size.
        self.num_pages = min(control_all_gather(config.num_pages or memory_budget.auto_num_pages(self, page_bytes)))
        self.kv_cache = KVCache(layout.kv_specs, self.num_pages, self.page_size, self.kv_dtype, self.device,
                                tokens_per_entry=layout.tokens_per_entry)
        # The pool must hold at least one full-length request, or such a request could never run.
        pool_tokens = (self.num_pages - 1) * self.page_size
        if config.max_model_len and config.max_model_len > lm.max_model_len:
            raise ValueError(f"--max-model-len {config.max_model_len} is above the {lm.max_model_len} positions this model supports")
        self.max_model_len = min(config.max_model_len or lm.max_model_len, lm.max_model_len, pool_tokens)
        return page_bytes

    def _make_execution(self) -> None:
        """The attention backend, the page table, and the ways a step can run: CUDA graphs, the CPU fused
        decode, eager (`execute` picks one per step)."""
        config, lm = self.config, self.loaded
        backend_cls = select_backend(config.attention, self.device.type)
        self.backend = backend_cls(
            self.kv_cache, lm.num_heads, lm.num_kv_heads, lm.head_dim, lm.head_dim**-0.5
        )
        self.backend.exact_cpu = config.exact_cpu
        self.page_table = PageTable(self.num_rows, -(-self.max_model_len // self.page_size) + 1, self.device)
        self.rows = RowWriter(self.num_rows) if self.rank == 0 else None
        # Rank 0: where each row's page-aligned state copy stands (verify_state.py, `prepare`).
        self.aligned = [0] * self.num_rows
        self._reports: list[tuple[SeqCache, int]] = []
        # The sizes of the paged groups that keep an entry per several tokens: their slots travel per step.
        self.entry_groups = self.layout.entry_groups
        self.graphs = build_decode_graphs(
            # The delta-net layers pick their path per sequence in Python: not capturable yet; nor are the
            # layers that keep compressed entries (their slots are not in the graphs' static buffers).
            not config.enforce_eager and self.state_cache is None and not self.entry_groups
            and lm.model.supports_cuda_graphs  # MLA reads host-side lengths (eager)
            and not self.host_expert_bytes,  # experts in host RAM: a graph cannot hold the CPU's part of a step
            self.device, self.backend,
            lambda: DecodeGraphs(
                lm.model, self.backend, self.page_size, config.max_num_seqs, self.page_table.table.shape[1],
                self.device,
            ),
        )
        # None on GPU and for models neither can run (what the model declares: a Llama-family or a hybrid stack)
        self.cpu_decode: CpuDecode | HybridCpuDecode | None = (
            CpuDecode.build(lm.model, self.device) or HybridCpuDecode.build(lm.model, self.device))
        self.mtp = (MtpDrafter(lm.model, self.backend, self.page_table, self.page_size, config.spec_mtp_tokens,
                               self.max_model_len)
                    if lm.model.mtp is not None and config.speculative.uses_mtp else None)
        self._hidden: torch.Tensor | None = None  # the last step's hidden states, for the MTP head
        self._mtp_threads: int | None = None  # and the step's CPU threads, which the head runs on too

    # ---- rank 0: Requests -> StepInputs ----

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """The step's tensors. Work is proportional to the step's new tokens and new pages, never to a
        request's context: tokens are sliced from the request's list, pages reach the table once. Reads the
        requests and their cache handles; writes neither (what moved is reported: `StepResult.aligned`)."""
        ps = self.page_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        kv_lens: list[int] = []
        sample_rows: list[int] = []
        handles = [_handle_of(s) for s in out.seqs]
        commits, updates = self._rows(handles)
        entries: list[list[int]] = [[] for _ in self.entry_groups]
        for s, h in zip(out.seqs, handles, strict=True):
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            if self.state_cache is not None:
                self._state_of(s, h, end)
            ids += r.token_ids[start:end]  # a draft's positions are past the list's end: the slice stops there
            ids += s.draft
            pages = h.pages
            if end - start == 1:
                pos.append(start)
                slots.append(pages[start // ps] * ps + start % ps)
            else:
                pos += range(start, end)
                slots += [pages[p // ps] * ps + p % ps for p in range(start, end)]
            for j, t in enumerate(self.entry_groups):
                entries[j] += entry_slot_mapping(t, self._entries_per_page(t), ps, list(range(start, end)), pages)
            query_lens.append(end - start)
            kv_lens.append(end)
            if s.sample:  # a drafted seq samples after its last real token and after each draft token
                sample_rows += range(len(ids) - 1 - len(s.draft), len(ids))
        return StepInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(pos, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_lens=query_lens,
            kv_lens=kv_lens,
            table_rows=torch.tensor([h.row for h in handles], dtype=torch.int64),
            page_updates=torch.tensor(updates, dtype=torch.int64).reshape(-1, 3),
            sample_rows=torch.tensor(sample_rows, dtype=torch.int64),
            num_table_cols=-(-max(kv_lens) // ps),
            state_copies=torch.tensor(out.state_copies, dtype=torch.int64).reshape(-1, 2),
            state_commits=torch.empty(0, 3, dtype=torch.int64) if commits is None else commits,
            state_verifies=torch.tensor([i for i, s in enumerate(out.seqs) if s.draft], dtype=torch.int64),
            entry_slots=torch.tensor(entries, dtype=torch.int64).reshape(len(entries), len(ids)),
        )

    def _rows(self, handles: list[SeqCache]) -> tuple[torch.Tensor | None, list[int]]:
        """The last step's verify commits (before rows move: verify_state.py) and the page-table entries this
        step writes; a row taken by a new admission starts with no page-aligned copy."""
        assert self.rows is not None, "only rank 0 prepares steps"
        self._reports = []
        commits = self.verifies.commits(self.aligned, self._report) if self.verifies is not None else None
        for h in handles:
            if self.rows.fresh(h):
                self.aligned[h.row] = 0
        return commits, self.rows.updates(handles)

    def _entries_per_page(self, tokens_per_entry: int) -> int:
        return self.kv_cache.slots_per_page[self.kv_cache.tokens_per_entry.index(tokens_per_entry)]

    def _report(self, h: SeqCache, position: int) -> None:
        self._reports.append((h, position))

    def _state_of(self, s: ScheduledSeq, h: SeqCache, end: int) -> None:
        """Where a stateful sequence's page-aligned state copy will stand after this step."""
        if not s.draft and (self.state_in_place or end % self.page_size == 0):  # a verify's is set at sampling
            # rings resume at their last page boundary themselves; others at the copy execute takes there
            self.aligned[h.row] = end // self.page_size * self.page_size
            self._report(h, self.aligned[h.row])

    # ---- every rank: StepInputs -> logits ----

    @torch.inference_mode()
    def execute(self, step: StepInputs) -> torch.Tensor | None:
        """The forward pass; float32 logits [S, vocab] at step.sample_rows (None when nothing samples).
        At tp > 1 every rank gets the gathered logits; rank 0 is the one that samples them. The step runs as
        a CUDA graph replay when one fits, else through the CPU fused decode when it fits, else eagerly."""
        self.page_table.apply(step.page_updates)
        dev = self.device
        self._hidden = None  # set again below when the MTP head reads this step's hidden states
        if self.graphs is not None and self.graphs.fits(step.query_lens, int(step.sample_rows.numel())):
            return self.graphs.run(
                step.input_ids.to(dev), step.positions.to(dev), step.slot_mapping.to(dev), step.kv_lens,
                self.page_table.rows(step.table_rows, step.num_table_cols),
            )
        meta = AttentionMetadata(
            query_lens=step.query_lens,
            kv_lens=step.kv_lens,
            page_table=self.page_table.rows(step.table_rows, step.num_table_cols),
            slot_mapping=step.slot_mapping.to(dev),
            page_size=self.page_size,
            cpu_threads=step_threads(self.device, self.config.cpu_threads, self.tp, self.spare),
        )
        state = None
        if self.state_cache is not None:
            if step.state_commits.numel():  # the last step's verifies: before a copy reads their slots
                self.state_cache.commit(step.state_commits.tolist(), None if self.state_in_place else self.num_rows)
            if step.state_copies.numel():
                self.state_cache.copy(step.state_copies[:, 0].tolist(), step.state_copies[:, 1].tolist())
            state = StateStep.of(self.state_cache, step.table_rows.tolist(), step.query_lens, step.kv_lens,
                                 frozenset(step.state_verifies.tolist()))
        entries = {t: EntryStep(t, self._entries_per_page(t), self.page_size, step.entry_slots[j].to(dev),
                                meta.page_table, step.query_lens, step.kv_lens)
                   for j, t in enumerate(self.entry_groups)}
        with torch_threads(meta.cpu_threads):  # the whole step, its largest matrix (the LM head) included
            with forward_context(self.backend, meta, state=state, entries=entries):
                if self.cpu_decode is not None and self.cpu_decode.fits(meta, self.kv_cache):
                    hidden = self.cpu_decode.run(step.input_ids.to(dev), step.positions.to(dev))
                else:
                    hidden = self.loaded.model(step.input_ids.to(dev), step.positions.to(dev))
            if state is not None and not self.state_in_place:  # sequences ending on a page boundary: state kept aside
                ended = [row for row, kv, verify in zip(state.slots, step.kv_lens, state.pending, strict=True)
                         if kv % self.page_size == 0 and not verify]  # a verify's copy is taken at its commit
                if ended:
                    self.state_cache.copy(ended, [row + self.num_rows for row in ended])
            if self.mtp is not None:
                self._hidden, self._mtp_threads = hidden, meta.cpu_threads
            if not step.sample_rows.numel():
                return None
            return self.loaded.model.compute_logits(hidden[step.sample_rows.to(dev)]).float()

    # ---- rank 0: one whole step ----

    def forward_logits(self, out: SchedulerOutput) -> torch.Tensor | None:
        """float32 logits [N, vocab] at the last new token of each seq with sample=True (None if none)."""
        step = self.prepare(out)
        if self.workers is not None:
            self.workers.send_step(step)
        return self.execute(step)

    def step(self, out: SchedulerOutput) -> StepResult:
        """Runs the step on every rank (`StepResult` says what it computed), timing it and its host experts."""
        clock = self.placement.clock if self.placement is not None else None
        if clock is not None:
            clock.take()  # what ran outside steps (LLM.logits, warm-up) is not this step's
        t0 = time.perf_counter()
        result = self._step(out)
        if clock is not None:
            self.expert_times.add(time.perf_counter() - t0, clock.take()[0])
        return result

    def _step(self, out: SchedulerOutput) -> StepResult:
        step = self.prepare(out)
        if self.workers is not None:
            self.workers.send_step(step)
        logits = self.execute(step)
        tokens: list[list[int]] = []
        lps: list[TokenLogprob | None] = []
        failed: dict[int, str] = {}
        if logits is not None:
            sampled = [s for s in out.seqs if s.sample]
            tokens, lps, failed = sample_verified(logits, [s.request for s in sampled], [s.draft for s in sampled])
            if self.verifies is not None:  # stateful verifies: how far each slot's state goes
                self.verifies.sampled(sampled, tokens, failed, self.aligned, self._report)
        drafts: list[MtpDraft | None] = [None] * len(tokens)
        if self.mtp is not None and self._hidden is not None:  # the head's KV follows every step, prefill too
            plan, owners = self.mtp.plan(out, step, tokens, failed)
            if plan.rows and self.workers is not None:
                self.workers.send_mtp(plan)
            for (i, after), chain in zip(owners, self.run_mtp(plan), strict=True):
                drafts[i] = MtpDraft(chain, after)
        return StepResult(tokens, lps, failed, self._reports, drafts)

    def run_mtp(self, plan: MtpStep) -> list[list[int]]:
        """Every rank: the MTP head's part of the last step (engine/exec/mtp.py); the drafts of its chains."""
        assert self.mtp is not None and self._hidden is not None, "an MTP step follows a step of a model with a head"
        hidden, self._hidden = self._hidden, None
        with torch_threads(self._mtp_threads):  # a layer and the LM head: the step's cores, not the engine's one
            return self.mtp.execute(plan, hidden)


def _handle_of(s: ScheduledSeq) -> SeqCache:
    h = s.request.cache_handle
    if h is None:
        raise RuntimeError(f"request {s.request.request_id} was scheduled without a cache handle")
    return h
