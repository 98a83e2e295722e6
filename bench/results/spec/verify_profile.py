"""Where a verify step's time goes on the default CPU path (SmolLM2-135M Q4_1, one thread, process CPU time):
the runner's step at 1 + k rows split into the fused layers (kernels/cpu_decode.c), their 4-bit products alone
(kernels/cpu_gemv.c, the same weights and row counts), the LM head, the verify's sampling and the step's
preparation. Medians of interleaved repeats. Run: .venv/bin/python bench/results/spec/verify_profile.py"""

from __future__ import annotations

import json
import os
import time

import torch

from agentbox.bench.spec import FILE
from agentbox.config import EngineConfig, Speculative
from agentbox.engine.exec import cpu_decode as cd
from agentbox.engine.exec import verify
from agentbox.engine.llm import LLM
from agentbox.engine.request import Request
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.scheduler import ScheduledSeq, SchedulerOutput
from agentbox.hub.embedded import embedded_model_path
from agentbox.kernels import cpu_gemv
from agentbox.models.loader import load_tokenizer, resolve_model

KS = (0, 3, 7, 15)
REPEATS = 15


def main() -> dict:
    model = str(embedded_model_path())
    llm = LLM(EngineConfig(model=model, speculative=Speculative.OFF, cpu_threads=1))
    core, runner = llm.core, llm.core.runner
    prompt = load_tokenizer(resolve_model(model)).encode(FILE)
    parts: dict[str, float] = {}

    def timed(obj: object, name: str, key: str) -> None:
        f = getattr(obj, name)

        def w(*a: object, **k: object) -> object:
            t = time.process_time()
            out = f(*a, **k)
            parts[key] = parts.get(key, 0.0) + time.process_time() - t
            return out

        setattr(obj, name, w)

    timed(runner.cpu_decode, "run", "layers")
    timed(runner.loaded.model, "compute_logits", "lm_head")
    timed(runner, "prepare", "prepare")
    lins = [lin for layer in runner.cpu_decode.model.layers for lin in cd._linears(layer)]
    scratch = core.cache.scratch(len(prompt) + max(KS) + 1)
    handle = scratch.__enter__()
    req = Request("profile", list(prompt), SamplingParams(temperature=0.0), cache_handle=handle)
    runner.forward_logits(SchedulerOutput([ScheduledSeq(req, len(prompt), True)], []))
    req = Request("profile", list(prompt), SamplingParams(temperature=0.0), cache_handle=handle,
                  num_computed_tokens=len(prompt) - 1)
    samples: dict[int, list[dict[str, float]]] = {k: [] for k in KS}
    for _ in range(REPEATS):
        for k in KS:
            parts.clear()
            draft = prompt[:k]
            t = time.process_time()
            logits = runner.forward_logits(SchedulerOutput([ScheduledSeq(req, 1 + k, True, draft)], []))
            s = time.process_time()
            verify.sample_verified(logits, [req], [draft])
            parts["sample"] = time.process_time() - s
            parts["step"] = time.process_time() - t
            x = torch.randn(1 + k, lins[0].input_size)
            t = time.process_time()
            for lin in lins:  # the layers' products alone (inputs of the right width; values do not matter)
                xi = x if x.shape[1] == lin.input_size else torch.randn(1 + k, lin.input_size)
                cpu_gemv.q4_matmul(xi, lin.weight, lin.scale, lin.q4_rows)
            parts["q4_products"] = time.process_time() - t
            samples[k].append(dict(parts))
    scratch.__exit__(None, None, None)
    med = {k: {p: sorted(s[p] for s in v)[len(v) // 2] * 1e3 for p in v[0]} for k, v in samples.items()}
    one = med[0]
    return {
        "cpu": cpu_gemv.cpu_model(), "load_average": os.getloadavg(), "context_tokens": len(prompt),
        "ms": {str(1 + k): {p: round(v, 3) for p, v in m.items()} for k, m in med.items()},
        # time(rows) / rows / time(1 row): 1.0 is no sharing at all, 1 / rows is free rows
        "per_row_vs_one_row": {str(1 + k): {p: round(m[p] / (1 + k) / one[p], 3) for p in ("step", "layers",
                                                                                       "q4_products", "lm_head")}
                               for k, m in med.items() if k},
    }


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
