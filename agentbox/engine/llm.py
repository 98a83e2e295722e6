"""The offline engine API: an in-process EngineCore driven to completion. Used by tests, benchmarks and
the canary check; serving uses the core in its own process through `EngineClient`."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from agentbox.config import EngineConfig
from agentbox.engine.core import EngineCore
from agentbox.engine.exec.logprob import TokenLogprob
from agentbox.engine.ipc.messages import AddRequest
from agentbox.engine.request import Request
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.scheduler import ScheduledSeq, SchedulerOutput
from agentbox.models.loader import LoadedModel


@dataclass
class Completion:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


class LLM:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.core = EngineCore(config, loaded)
        self._ids = itertools.count()

    def close(self) -> None:
        """Stops the tensor-parallel workers (a no-op at tp 1)."""
        self.core.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def loaded(self) -> LoadedModel:
        return self.core.runner.loaded

    def generate(
        self,
        prompt_token_ids: list[list[int]],
        sampling: SamplingParams | list[SamplingParams],
        session_ids: list[str | None] | None = None,
        history_ends: list[int] | None = None,
    ) -> list[Completion]:
        """Runs the prompts to completion. `history_ends`: each prompt's AddRequest.history_end (chat renders)."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompt_token_ids)
        done: dict[str, Completion] = {}
        order: list[str] = []
        for i, (ids, sp) in enumerate(zip(prompt_token_ids, params, strict=True)):
            rid = f"llm-{next(self._ids)}"
            order.append(rid)
            done[rid] = Completion(rid, list(ids), [], None, 0, [] if sp.logprobs is not None else None)
            err = self.core.add(AddRequest(rid, list(ids), sp.validate(), session_ids[i] if session_ids else None,
                                           history_end=history_ends[i] if history_ends else 0))
            if err is not None:
                done[rid].finish_reason, done[rid].error = "error", err.error
        while self.core.has_work():
            if not self.core.progress_possible():
                time.sleep(self.core.wait_timeout() or 0.0)  # only blocked admissions: wait for a lease to lapse
            for o in self.core.step():
                c = done[o.request_id]
                c.token_ids.extend(o.new_token_ids)
                c.num_cached_tokens = o.num_cached_tokens
                if o.logprobs and c.logprobs is not None:
                    c.logprobs.extend(o.logprobs)
                if o.finished:
                    c.finish_reason, c.error = o.finish_reason, o.error
        return [done[r] for r in order]

    @torch.inference_mode()
    def logits(self, prompt_token_ids: list[int]) -> torch.Tensor:
        """float32 logits [vocab] for the next token after the prompt, computed cold in scratch pages."""
        core = self.core
        with core.cache.scratch(len(prompt_token_ids)) as handle:
            req = Request(f"llm-logits-{next(self._ids)}", list(prompt_token_ids), SamplingParams(),
                          cache_handle=handle)
            out = core.runner.forward_logits(SchedulerOutput([ScheduledSeq(req, len(prompt_token_ids), True)], []))
            assert out is not None
            return out[0]

    @torch.inference_mode()
    def forced_logits(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [len(token_ids), vocab], row i the next-token logits after token i, teacher-forced one
        token a step in scratch pages: every step a decode step, so it takes the path a served decode takes
        (the fused CPU decode where it fits), whatever the model samples."""
        core = self.core
        rows: list[torch.Tensor] = []
        with core.cache.scratch(len(token_ids)) as handle:
            req = Request(f"llm-forced-{next(self._ids)}", list(token_ids), SamplingParams(), cache_handle=handle)
            for _ in token_ids:
                out = core.runner.forward_logits(SchedulerOutput([ScheduledSeq(req, 1, True)], []))
                assert out is not None
                rows.append(out[0])
                core.scheduler.computed(req, 1)  # the scheduler is the field's one writer
        return torch.stack(rows)
