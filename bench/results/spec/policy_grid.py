"""The edit workload's drafting policy, varied: tokens, engine steps, verified rows and accepted tokens of one
greedy run per setting (SmolLM2-135M Q4_1, default CPU path), and the speedup those counts give at a verified
row's measured cost (0.3 of a decode step): steps + 0.3 * rows against one step per token. Counts, unlike
timings, do not depend on the load. Run: .venv/bin/python bench/results/spec/policy_grid.py [edit|tool_call|prose]"""

from __future__ import annotations

import sys

from agentbox.bench import spec as bench
from agentbox.config import EngineConfig, Speculative
from agentbox.engine.llm import LLM
from agentbox.hub.embedded import embedded_model_path
from agentbox.models.loader import load_tokenizer, resolve_model

ROW_COST = 0.3
GRID = [{}, {"spec_match_factor": 1.0}, {"spec_match_factor": 2.0}, {"spec_min_match": 2},
        {"spec_min_match": 2, "spec_match_factor": 1.0}, {"spec_match_factor": 1.0, "spec_row_cost": 0.2}]


def main(work: str) -> None:
    model = str(embedded_model_path())
    tok = load_tokenizer(resolve_model(model))
    base = LLM(EngineConfig(model=model, speculative=Speculative.OFF))
    msgs, start = bench.WORKLOADS[work]
    prompt = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False) + start)
    ref, _ = bench._decode(base, prompt, 300)
    for kw in GRID:
        spec = LLM(EngineConfig(model=model, speculative=Speculative.SUFFIX, **kw), loaded=base.loaded)  # type: ignore[arg-type]
        c0 = (spec.core.counters.steps, spec.core.counters.drafted_tokens, spec.core.counters.accepted_tokens)
        toks, _ = bench._decode(spec, prompt, 300)
        c = spec.core.counters
        steps, rows, kept = c.steps - c0[0] - 1, c.drafted_tokens - c0[1], c.accepted_tokens - c0[2]
        print(work, kw, "same", toks == ref, "tokens", len(toks) - 1, "steps", steps, "rows", rows, "accepted", kept,
              "modeled speedup", round((len(toks) - 1) / (steps + ROW_COST * rows), 3), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "edit")
