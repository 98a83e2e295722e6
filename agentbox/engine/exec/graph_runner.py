"""CUDA graphs for decode steps: capture the model's decode forward once per batch size, replay it per step.

A decode step at batch size B launches the same kernels with the same shapes whatever the sequences'
lengths, as long as attention reads its lengths and page table from device tensors (the triton backend
does: AttentionBackend.supports_cuda_graphs). So at start we capture one graph per size in 1, 2, 4, 8, then
steps of 8 up to max_num_seqs, all reading static buffers (token ids, positions, slots, kv lengths, query
offsets, page table). A step of n sequences copies its inputs into the buffers, pads rows n..B-1 of the next
captured size B with rows that write nowhere (slot -1: store_kv skips it; kv_len 0: attention reads nothing
and returns zeros), replays, and returns the first n rows of the logits. Prefill and mixed steps, and decode
batches past the largest size, run eagerly (their shapes vary every step).

Graphs share one memory pool and are captured largest first (so smaller ones fit in its blocks). The logits a
replay returns are a view of the graph's static output: the caller samples before the next step, as it does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from agentbox.layers.backends.base import AttentionBackend, AttentionMetadata
from agentbox.layers.context import forward_context

log = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 8


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_batch (max_batch itself included)."""
    sizes = [s for s in SMALL_SIZES if s < max_batch]
    sizes += range(SIZE_STEP * 2 if max_batch > SIZE_STEP else max_batch, max_batch, SIZE_STEP)
    sizes.append(max_batch)
    return sorted(set(sizes))


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds n rows (None: too many, run eagerly)."""
    return next((s for s in sizes if s >= n), None)


class DecodeGraphs:
    """The decode graphs of one model and backend. capture=False keeps every part but the graphs (the padded
    buffers, the eager forward over them): what the CPU tests run, and the warm-up before each capture."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: AttentionBackend,
        page_size: int,
        max_batch: int,
        max_pages: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.backend = backend
        self.page_size = page_size
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_pages = max_pages
        n = self.max_batch
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.kv_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)  # one token per row, always
        self.page_table = torch.zeros((n, max_pages), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def _meta(self, bs: int) -> AttentionMetadata:
        # The lists are placeholders of the right length (a backend with supports_cuda_graphs reads only the
        # tensors on decode); the tensors are views of the static buffers.
        return AttentionMetadata(
            query_lens=[1] * bs,
            kv_lens=[1] * bs,
            page_table=self.page_table[:bs],
            slot_mapping=self.slot_mapping[:bs],
            page_size=self.page_size,
            query_start_loc=self.query_start[: bs + 1],
            kv_lens_tensor=self.kv_lens[:bs],
        )

    def _forward(self, bs: int, capture: bool = False) -> torch.Tensor:
        with forward_context(self.backend, self._meta(bs), capture=capture):
            hidden = self.model(self.input_ids[:bs], self.positions[:bs])
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        if not self.backend.supports_cuda_graphs:
            raise ValueError(f"the {self.backend.name} attention backend cannot run under CUDA graphs")
        self.backend.init_capture(self.max_batch, self.max_pages)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for bs in reversed(self.sizes):
            # Every padded row: slot -1 and kv_len 0, so warm-up and capture write nothing to the cache.
            self._forward(bs)  # warm-up: compiles kernels, settles lazy allocations outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bs] = self._forward(bs, capture=True)
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        log.info("CUDA graphs captured for decode batch sizes %s", self.sizes)

    def fits(self, query_lens: list[int], num_sampled: int) -> bool:
        """Whether a step can replay: decode only (one token per sequence, each sampled), small enough."""
        n = len(query_lens)
        return 0 < n <= self.max_batch and num_sampled == n and all(q == 1 for q in query_lens)

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        kv_lens: list[int],
        page_table: torch.Tensor,
    ) -> torch.Tensor:
        """One decode step of n = len(kv_lens) sequences (page_table [n, cols]). Returns float32 logits [n, vocab]."""
        n = len(kv_lens)
        bs = padded_size(n, self.sizes)
        if bs is None:
            raise ValueError(f"decode batch {n} is larger than the largest captured size {self.max_batch}")
        cols = page_table.shape[1]
        if cols > self.max_pages:
            raise ValueError(f"page table of {cols} columns exceeds the captured {self.max_pages}")
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.kv_lens[:n].copy_(torch.tensor(kv_lens, dtype=torch.int32), non_blocking=True)
        self.page_table[:n, :cols].copy_(page_table, non_blocking=True)
        if bs > n:
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slot_mapping[n:bs].fill_(-1)
            self.kv_lens[n:bs].zero_()
        graph = self.graphs.get(bs)
        if graph is None:  # built with capture=False: the same padded buffers, run eagerly
            return self._forward(bs).float()[:n]
        self.backend.begin_replay(self._meta(bs))
        graph.replay()
        return self.outputs[bs].float()[:n]


def build_decode_graphs(
    enabled: bool, device: torch.device, backend: AttentionBackend, make: Callable[[], DecodeGraphs]
) -> DecodeGraphs | None:
    """The runner's decode graphs, or None with the reason logged (--enforce-eager, CPU, a backend without
    graph support)."""
    if not enabled:
        log.info("CUDA graphs off: --enforce-eager")
        return None
    if device.type != "cuda":
        return None
    if not backend.supports_cuda_graphs:
        log.info("CUDA graphs off: the %s attention backend reads host-side lengths (eager decode)", backend.name)
        return None
    return make()
