"""`agentbox bench spec`: decode speed with and without speculative decoding, in the same run (JSON).

Three agent-shaped workloads, greedy, through the in-process engine on one loaded model: (a) an edit, the
model is given a file and asked to return it with one change, as agents do; (b) a tool call that repeats
arguments from the conversation; (c) free prose, which repeats little. Each workload runs with speculation
off and on (`--speculative` mode), alternating, `repeats` times each; the fastest decode of each side is
kept. Decode tok/s counts the tokens after the first over the time after the first token (prefill excluded).
It also reports whether both sides produced the same tokens (greedy speculation is exact), the acceptance
rate and the mean tokens a verify step produced.
"""

from __future__ import annotations

import os
import time
from typing import Any

from agentbox.config import EngineConfig, Speculative
from agentbox.engine.ipc.messages import AddRequest
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
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

WORKLOADS: dict[str, list[dict[str, str]]] = {
    "edit": [{"role": "user", "content": "Here is a file:\n\n" + FILE + "\nReturn the whole file with the default "
              "port changed from 8000 to 9000. Reply with the file only."}],
    "tool_call": [{"role": "user", "content": TOOL_HISTORY}],
    "prose": [{"role": "user", "content": "Write a short story about a lighthouse keeper who finds a message "
               "in a bottle."}],
}


def _decode(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """(tokens, seconds after the first token) of one greedy request run alone."""
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
                first = time.perf_counter()
            tokens += o.new_token_ids
    return tokens, time.perf_counter() - first


def _workload(engines: dict[str, LLM], prompt: list[int], max_tokens: int, repeats: int) -> dict[str, Any]:
    best: dict[str, float] = {}
    outs: dict[str, list[int]] = {}
    counts = {}
    for _ in range(repeats):
        for side, llm in engines.items():
            before = (llm.core.counters.drafted_tokens, llm.core.counters.accepted_tokens, llm.core.counters.steps)
            toks, secs = _decode(llm, prompt, max_tokens)
            c = llm.core.counters
            counts[side] = (c.drafted_tokens - before[0], c.accepted_tokens - before[1], c.steps - before[2])
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
    }


def spec_report(model: str, mode: Speculative = Speculative.AUTO, max_tokens: int = 256, repeats: int = 2,
                exact_cpu: bool = False) -> dict[str, Any]:
    from agentbox.models.loader import load_tokenizer, resolve_model

    if mode is Speculative.OFF:
        raise ValueError("--speculative off compares nothing: pick auto, suffix or ngram")
    base = EngineConfig(model=model, exact_cpu=exact_cpu, speculative=Speculative.OFF)
    off = LLM(base)
    engines = {"off": off, "spec": LLM(EngineConfig(model=model, exact_cpu=exact_cpu, speculative=mode),
                                       loaded=off.loaded)}
    tok = load_tokenizer(resolve_model(model))
    load0, start = os.getloadavg()[0], time.time()
    results = {}
    for name, messages in WORKLOADS.items():
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if not isinstance(prompt, list):
            prompt = list(prompt["input_ids"])
        results[name] = _workload(engines, list(prompt), max_tokens, repeats)
    return {
        "model": os.path.basename(model), "device": str(off.core.runner.device), "cpu_model": cpu_model(),
        "cpu_threads": __import__("torch").get_num_threads(), "exact_cpu": exact_cpu, "mode": mode.value,
        "max_tokens": max_tokens, "repeats": repeats, "workloads": results,
        "goals": {"edit": 2.0, "tool_call": 1.3, "prose": 0.97},
        "load_average_before_after": [load0, os.getloadavg()[0]], "seconds": round(time.time() - start, 1),
    }
