"""The model runner: owns the model, the paged KV tensors and the attention backend; turns a
SchedulerOutput into one forward pass and one sampled token per request that reached its end."""

from __future__ import annotations

import logging
import os

import torch

from agentbox.config import EngineConfig
from agentbox.engine.messages import TokenLogprob
from agentbox.engine.sampler import sample
from agentbox.engine.scheduler import SchedulerOutput
from agentbox.layers.backends import ATTENTION_BACKENDS
from agentbox.layers.backends.base import AttentionBackend, AttentionMetadata, KVCache
from agentbox.layers.context import forward_context
from agentbox.models.loader import LoadedModel, load_model

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Share of free memory the KV pool may take when no size is given: most of a GPU (weights are already
# loaded), a modest slice of host RAM on CPU (the rest is the OS's, the API process's and the host tier's).
GPU_KV_SHARE = 0.85
CPU_KV_SHARE = 0.25
CPU_KV_MAX_BYTES = 4 << 30


def pick_backend(name: str, device: str) -> type[AttentionBackend]:
    if name == "auto":
        for candidate in ("flashinfer", "triton", "torch"):
            cls = ATTENTION_BACKENDS.get(candidate)
            if cls is not None and cls.available(device):
                return cls
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(ATTENTION_BACKENDS)}")
    cls = ATTENTION_BACKENDS[name]
    if not cls.available(device):
        raise ValueError(f"attention backend {name!r} cannot run on {device}")
    return cls


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        if config.tensor_parallel_size != 1:
            # The layers are TP-aware, but the multi-process worker loop is not built yet: say so plainly.
            raise ValueError(
                f"tensor parallel size {config.tensor_parallel_size} is not supported yet (only 1); "
                "pick a model or variant that fits one device (`agentbox plan` shows which)"
            )
        self.device = torch.device(config.resolved_device)
        self.dtype = DTYPES[config.resolved_dtype]
        torch.manual_seed(config.seed)
        if self.device.type == "cpu":
            # Oversubscribed threads are far slower than fewer threads on a small CPU (measured 5x at 2 vs 1
            # thread on 2 cores with the API process busy), so leave one core to everything else.
            torch.set_num_threads(config.cpu_threads or max(1, (os.cpu_count() or 2) - 1))
        self.loaded = loaded or load_model(config.model, self.dtype, self.device)
        lm = self.loaded
        self.page_size = config.page_size
        page_bytes = KVCache.bytes_per_page(lm.num_layers, self.page_size, lm.num_kv_heads, lm.head_dim, self.dtype)
        self.num_pages = config.num_pages or self._auto_num_pages(page_bytes)
        self.kv_cache = KVCache(
            lm.num_layers, self.num_pages, self.page_size, lm.num_kv_heads, lm.head_dim, self.dtype, self.device
        )
        # The pool must hold at least one full-length request, or such a request could never run.
        pool_tokens = (self.num_pages - 1) * self.page_size
        if config.max_model_len and config.max_model_len > lm.max_model_len:
            raise ValueError(f"--max-model-len {config.max_model_len} is above the {lm.max_model_len} positions this model supports")
        self.max_model_len = min(config.max_model_len or lm.max_model_len, lm.max_model_len, pool_tokens)
        backend_cls = pick_backend(config.attention, self.device.type)
        self.backend = backend_cls(
            self.kv_cache, lm.num_heads, lm.num_kv_heads, lm.head_dim, lm.head_dim**-0.5
        )
        log.info(
            "KV pool: %d pages of %d tokens (%.1f MiB), attention backend %s, max_model_len %d",
            self.num_pages, self.page_size, self.num_pages * page_bytes / 2**20, backend_cls.name, self.max_model_len,
        )

    def _auto_num_pages(self, page_bytes: int) -> int:
        if self.config.kv_cache_gb is not None:
            budget = int(self.config.kv_cache_gb * 2**30)
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * GPU_KV_SHARE)
        else:
            import psutil  # here, not at the top: the GPU check imports the engine where psutil may be absent

            budget = min(int(psutil.virtual_memory().available * CPU_KV_SHARE), CPU_KV_MAX_BYTES)
        return max(2, budget // page_bytes)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[int], list[TokenLogprob | None]]:
        """Runs the step's forward pass; returns one token (and logprobs) per seq with sample=True, in order."""
        logits = self.forward_logits(out)
        if logits is None:
            return [], []
        return sample(logits, [s.request for s in out.seqs if s.sample])

    @torch.inference_mode()
    def forward_logits(self, out: SchedulerOutput) -> torch.Tensor | None:
        """float32 logits [N, vocab] at the last new token of each seq with sample=True (None if none)."""
        ps = self.page_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        kv_lens: list[int] = []
        last_rows: list[int] = []
        for s in out.seqs:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            toks = r.all_token_ids
            ids.extend(toks[start:end])
            pos.extend(range(start, end))
            pages = r.pages
            slots.extend(pages[p // ps] * ps + p % ps for p in range(start, end))
            query_lens.append(s.num_new_tokens)
            kv_lens.append(end)
            if s.sample:
                last_rows.append(len(ids) - 1)
        max_pages = max(len(s.request.pages) for s in out.seqs)
        table = torch.zeros((len(out.seqs), max_pages), dtype=torch.int32)
        for i, s in enumerate(out.seqs):
            table[i, : len(s.request.pages)] = torch.tensor(s.request.pages, dtype=torch.int32)
        dev = self.device
        meta = AttentionMetadata(
            query_lens=query_lens,
            kv_lens=kv_lens,
            page_table=table.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            page_size=ps,
        )
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        positions = torch.tensor(pos, dtype=torch.int64, device=dev)
        with forward_context(self.backend, meta):
            hidden = self.loaded.model(input_ids, positions)
        if not last_rows:
            return None
        return self.loaded.model.compute_logits(hidden[torch.tensor(last_rows, device=dev)]).float()
