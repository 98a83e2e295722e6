"""The context a server serves and why it is that number: the model's own, `--max-model-len`, agentbox's CPU
default, or cut to what the KV pool holds. `serve` prints it at start, the log records it and `GET /v1/models`
reports it, so a user who asked for 64k and got 32k sees why and the flag that changes it."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from agentbox.config import PLAN_CONTEXT, EngineConfig
from agentbox.engine.ipc.messages import EngineReady


class ContextSource(str, Enum):
    FLAG = "flag"  # --max-model-len, served whole
    MODEL = "model"  # the model's own positions
    CPU_DEFAULT = "cpu_default"  # on CPU without the flag: the plan's context (config.PLAN_CONTEXT)
    KV_POOL = "kv_pool"  # cut to what the KV pool holds (--kv-cache-gb, --num-pages, or the GPU's free memory)


@dataclass(frozen=True)
class ServedContext:
    tokens: int
    source: ContextSource
    model_tokens: int  # the model's own positions
    asked: int | None  # --max-model-len
    pool_flag: str = "--kv-cache-gb"  # what sizes the pool: --num-pages where that was given

    def describe(self, device: str) -> str:
        """One line: the context, why it is that, and the flag that raises it where it could be larger."""
        text = f"context {self.tokens:,} tokens"
        if self.source is ContextSource.FLAG:
            return f"{text} (--max-model-len)"
        if self.source is ContextSource.MODEL:
            return f"{text} (the model's own)"
        if self.source is ContextSource.CPU_DEFAULT:
            return (f"{text} (agentbox's default on CPU; the model supports {self.model_tokens:,}: "
                    f"--max-model-len {self.model_tokens} raises it)")
        wanted = self.asked or self.model_tokens
        where = "the free GPU memory" if device.startswith("cuda") else "the RAM given to it"
        return (f"{text} (cut from {wanted:,} to what the KV pool holds in {where}: {self.pool_flag} raises it, "
                "a smaller --max-model-len makes it the limit)")


def served_context(engine: EngineConfig, info: EngineReady) -> ServedContext:
    model = info.model_max_len or info.max_model_len
    asked = engine.max_model_len
    if asked and info.max_model_len >= asked:
        source = ContextSource.FLAG
    elif info.max_model_len >= model:
        source = ContextSource.MODEL
    elif (not asked and info.device == "cpu" and engine.kv_cache_gb is None and engine.num_pages is None
          and info.max_model_len == min(PLAN_CONTEXT, model)):
        source = ContextSource.CPU_DEFAULT
    else:
        source = ContextSource.KV_POOL
    return ServedContext(info.max_model_len, source, model, asked,
                         "--num-pages" if engine.num_pages is not None else "--kv-cache-gb")
