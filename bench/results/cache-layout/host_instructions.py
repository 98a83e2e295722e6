"""The engine's host work of warm agent turns, in CPU instructions (callgrind): deterministic where wall time on a
shared 2-core machine is not. One engine on a tiny random Qwen3 (so the model's forward is not what is counted),
a session's history of CONTEXT tokens in the cache, then TURNS warm turns of the session, each: admission (match,
lock, reserve), the step's preparation (`runner.prepare`: rows, slots, page-table updates), the turn's end (its
pages back into the tree). No forward pass runs. Works on a checkout from before the cache-layout refactor and
after it (the engine's public calls are the same; the history is inserted through whichever cache API exists).

    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python host_instructions.py TURNS
    (the difference between TURNS=12 and TURNS=2 is ten turns' instructions)
"""

from __future__ import annotations

import sys
from array import array

import torch
from transformers import Qwen3Config

from agentbox.bench.throughput import random_model
from agentbox.config import EngineConfig
from agentbox.engine.core import EngineCore
from agentbox.engine.ipc.messages import AddRequest
from agentbox.engine.ipc.prompt_delta import Rebuilt
from agentbox.engine.sampling import SamplingParams

CONTEXT, NEW, PS = 32768, 32, 16


def main(turns: int) -> None:
    cfg = Qwen3Config(architectures=["Qwen3ForCausalLM"], hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, head_dim=16, vocab_size=256,
                      max_position_embeddings=CONTEXT + 64 * (turns + 2))
    pages = -(-(CONTEXT + NEW * (turns + 2)) // PS) * 2 + 64
    config = EngineConfig(model="random", device="cpu", dtype="float32", num_pages=pages,
                          max_model_len=cfg.max_position_embeddings, cpu_threads=1, disk_cache_gb=0.0,
                          host_cache_gb=0.0)
    core = EngineCore(config, random_model(cfg, torch.float32, "cpu"))
    history = [(i * 7 + 3) % 250 for i in range(CONTEXT)]
    cache = getattr(core.cache, "page_cache", core.cache)  # after the refactor: the paged half of the manager
    cache.insert(array("i", history), cache.pool.alloc(CONTEXT // PS), "s")
    for t in range(turns):
        ids = history + [(t * 5 + j) % 250 for j in range(NEW)]
        core.add(AddRequest(f"r{t}", ids, SamplingParams(max_tokens=1, temperature=0.0), "s"),
                 Rebuilt(ids, array("i", ids)))
        out = core.scheduler.schedule()
        assert len(out.seqs) == 1 and out.seqs[0].num_new_tokens == NEW, out
        core.runner.prepare(out)
        core.scheduler.finish(out.seqs[0].request, "stop")
    core.close()


if __name__ == "__main__":
    main(int(sys.argv[1]))
