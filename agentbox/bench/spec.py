"""`agentbox bench spec`: decode speed with and without speculative decoding, in the same run (JSON).

Three agent-shaped workloads, greedy, through the in-process engine on one loaded model: (a) an edit, the
model is given a file and asked to return it with one change, as agents do; (b) a tool call that repeats
arguments from the conversation; (c) free prose, which repeats little. Each workload runs with speculation
off and on (`--speculative` mode), alternating, `repeats` times each; the fastest decode of each side is
kept. Decode tok/s counts the tokens after the first over the time after the first token (prefill excluded),
in the process's CPU time when the engine runs one thread (the CPU default on 2 cores), else the wall clock.
It also reports whether both sides produced the same tokens (greedy speculation is exact), the acceptance
rate and the mean tokens a verify step produced, and per draft source (the text match, the checkpoint's MTP head)
its verify steps and accepted tokens per step.

`workloads` replaces the three with prompts given as token ids (`--workloads FILE`, a JSON object of name ->
ids): a checkpoint without a tokenizer, such as the tiny Qwen3.5 whose MTP head the tests train.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from agentbox.config import EngineConfig, Speculative
from agentbox.engine.ipc.messages import AddRequest
from agentbox.engine.llm import LLM
from agentbox.engine.request import Request
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.scheduler import ScheduledSeq, SchedulerOutput
from agentbox.kernels.cpu_gemv import cpu_model

FILE = '''import json
from pathlib import Path


class Config:
    """Settings read from a JSON file, with defaults for every key."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.values = {"host": "127.0.0.1", "port": 8000, "workers": 2}

    def load(self) -> None:
        if self.path.exists():
            self.values.update(json.loads(self.path.read_text()))

    def get(self, key: str) -> object:
        return self.values[key]

    def save(self) -> None:
        self.path.write_text(json.dumps(self.values, indent=2))


def main() -> None:
    config = Config(Path("settings.json"))
    config.load()
    print(config.get("host"), config.get("port"))


if __name__ == "__main__":
    main()
'''

TOOL_HISTORY = (
    "You are a coding agent. Call tools as JSON objects on one line.\n"
    'Tool call: {"name": "read_file", "arguments": {"path": "src/app/config.py", "start_line": 1, "end_line": 40}}\n'
    "Tool result: (40 lines of src/app/config.py)\n"
    'Tool call: {"name": "grep", "arguments": {"pattern": "def load", "path": "src/app/config.py"}}\n'
    "Tool result: src/app/config.py:14:    def load(self) -> None:\n"
    'Tool call: {"name": "read_file", "arguments": {"path": "src/app/server.py", "start_line": 1, "end_line": 40}}\n'
    "Tool result: (40 lines of src/app/server.py)\n"
    "Next, read lines 40 to 80 of src/app/config.py, then grep for def save in it.\n"
    "Tool call:"
)

# name -> (chat messages, the start of the assistant's reply the prompt ends with). SmolLM2-135M follows
# these (checked by eye): it returns the file from its opening fence, and continues the tool call's JSON.
WORKLOADS: dict[str, tuple[list[dict[str, str]], str]] = {
    "edit": ([{"role": "system", "content": "You are a code editor. You reply with the complete edited file and "
               "nothing else."},
              {"role": "user", "content": "```python\n" + FILE + "```\nIn this file, change 8000 to 9000."}],
             "```python\n"),
    "tool_call": ([{"role": "user", "content": TOOL_HISTORY}],
                  'Tool call: {"name": "read_file", "arguments": {"path": "'),
    "prose": ([{"role": "user", "content": "Explain how a refrigerator works."}], ""),
}


def _clock() -> float:
    """The process's CPU time when the engine runs one thread (on a shared machine the wall clock counts other
    processes' turns; CPU time does not, though shared caches and memory bandwidth still do), else wall time."""
    return time.process_time() if torch.get_num_threads() == 1 else time.perf_counter()


def _decode(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """(tokens, seconds after the first token, by `_clock`) of one greedy request run alone."""
    core = llm.core
    rid = f"spec-{time.monotonic_ns()}"
    err = core.add(AddRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0).validate()))
    if err is not None:
        raise RuntimeError(err.error)
    tokens: list[int] = []
    first = 0.0
    while core.has_work():
        for o in core.step():
            if not tokens and o.new_token_ids:
                first = _clock()
            tokens += o.new_token_ids
    return tokens, _clock() - first


def _workload(engines: dict[str, LLM], prompt: list[int], max_tokens: int, repeats: int) -> dict[str, Any]:
    best: dict[str, float] = {}
    outs: dict[str, list[int]] = {}
    counts = {}
    by_source: dict[str, dict[str, dict[str, float]]] = {}
    for _ in range(repeats):
        for side, llm in engines.items():
            if llm.core.drafter is not None:
                llm.core.drafter.forget()  # each run drafts from its own prompt only, never the last run's answer
            before = (llm.core.counters.drafted_tokens, llm.core.counters.accepted_tokens, llm.core.counters.steps)
            sources = _sources(llm)
            toks, secs = _decode(llm, prompt, max_tokens)
            c = llm.core.counters
            counts[side] = (c.drafted_tokens - before[0], c.accepted_tokens - before[1], c.steps - before[2])
            by_source[side] = {name: _per_step([a - b for a, b in zip(now, sources[name], strict=True)])
                               for name, now in _sources(llm).items()}
            rate = (len(toks) - 1) / secs if secs > 0 and len(toks) > 1 else 0.0
            best[side] = max(best.get(side, 0.0), rate)
            outs[side] = toks
    drafted, accepted, steps = counts["spec"]
    return {
        "prompt_tokens": len(prompt), "output_tokens": len(outs["spec"]),
        "decode_tok_s_off": round(best["off"], 1), "decode_tok_s_spec": round(best["spec"], 1),
        "speedup": round(best["spec"] / best["off"], 3) if best["off"] else None,
        "identical_output": outs["spec"] == outs["off"],
        "drafted_tokens": drafted, "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
        # tokens per engine step after the first (prefill) one: 1.0 is plain decoding
        "mean_tokens_per_step": round((len(outs["spec"]) - 1) / max(1, steps - 1), 3),
        "drafters": by_source["spec"],  # the last run's, per source
    }


def _sources(llm: LLM) -> dict[str, list[int]]:
    """The drafter's [verify steps, drafted, accepted] per source so far (engine/draft.py by_source)."""
    d = llm.core.drafter
    return {} if d is None else {src.value: list(counts) for src, counts in d.by_source.items()}


def _per_step(counts: list[int]) -> dict[str, float]:
    steps, drafted, accepted = counts
    return {"verify_steps": steps, "drafted_tokens": drafted, "accepted_tokens": accepted,
            "accepted_per_step": round(accepted / steps, 3) if steps else 0.0}


def verify_cost(llm: LLM, prompt: list[int], ks: tuple[int, ...] = (0, 1, 3, 7, 15), repeats: int = 15) -> dict[str, Any]:
    """The forward pass of one sequence scoring its next token plus k drafts, against k = 0 (a decode step),
    after `prompt`: the fastest of `repeats` each, in scratch pages (as LLM.logits uses)."""
    core = llm.core
    with core.cache.scratch(len(prompt) + max(ks) + 1) as handle:
        req = Request("spec-verify-cost", list(prompt), SamplingParams(temperature=0.0), cache_handle=handle)
        core.runner.forward_logits(SchedulerOutput([ScheduledSeq(req, len(prompt), True)], []))
        # its last token again, as a decode, then k drafts after it
        req = Request("spec-verify-cost", list(prompt), SamplingParams(temperature=0.0), cache_handle=handle,
                      num_computed_tokens=len(prompt) - 1)
        best = {}
        for k in ks:
            step = SchedulerOutput([ScheduledSeq(req, 1 + k, True, prompt[:k])], [])
            times = []
            for _ in range(repeats):
                t = _clock()
                core.runner.forward_logits(step)
                times.append(_clock() - t)
            best[k] = min(times)
    return {"context_tokens": len(prompt), "decode_step_ms": round(best[0] * 1e3, 2),
            "verify_vs_decode": {str(k): round(best[k] / best[0], 3) for k in ks}}


def spec_report(model: str, mode: Speculative = Speculative.AUTO, max_tokens: int = 256, repeats: int = 2,
                exact_cpu: bool = False, workloads: dict[str, list[int]] | None = None) -> dict[str, Any]:
    if mode is Speculative.OFF:
        raise ValueError("--speculative off compares nothing: pick auto, suffix, ngram or mtp")
    # The drafting side loads the model (with its MTP head where the mode drafts with it); both sides share it.
    spec = LLM(EngineConfig(model=model, exact_cpu=exact_cpu, speculative=mode))
    off = LLM(EngineConfig(model=model, exact_cpu=exact_cpu, speculative=Speculative.OFF), loaded=spec.loaded)
    engines = {"off": off, "spec": spec}
    prompts = workloads if workloads is not None else _text_workloads(model)
    load0, start = os.getloadavg()[0], time.time()
    results = {name: _workload(engines, prompt, max_tokens, repeats) for name, prompt in prompts.items()}
    cost = verify_cost(off, _text_workloads(model, FILE)["file"] if workloads is None else next(iter(prompts.values())))
    return {
        "model": os.path.basename(model), "device": str(off.core.runner.device), "cpu_model": cpu_model(),
        "cpu_threads": torch.get_num_threads(), "exact_cpu": exact_cpu,
        "clock": "process CPU time" if torch.get_num_threads() == 1 else "wall clock", "mode": mode.value,
        "drafters": spec.core.drafter.describe() if spec.core.drafter is not None else "off",
        "max_tokens": max_tokens, "repeats": repeats, "workloads": results, "verify_cost": cost,
        "goals": {"edit": 2.0, "tool_call": 1.3, "prose": 0.97},
        "load_average_before_after": [load0, os.getloadavg()[0]], "seconds": round(time.time() - start, 1),
    }


def _text_workloads(model: str, file: str | None = None) -> dict[str, list[int]]:
    """The three workloads' prompts in the model's tokens (or, given `file`, that text alone)."""
    from agentbox.models.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(model))
    if file is not None:
        return {"file": tok.encode(file)}
    return {name: tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) + start)
            for name, (messages, start) in WORKLOADS.items()}
