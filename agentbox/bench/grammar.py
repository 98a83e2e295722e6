"""`agentbox bench grammar`: grammar compile time (uncached vs cached) and per-token mask overhead."""

from __future__ import annotations

import statistics
import time
from typing import Any

from agentbox.chat.grammar import grammar_spec
from agentbox.engine.exec.bitmask import allocate_bitmask, apply_bitmask
from agentbox.engine.grammar import GrammarCompiler


def sample_tools(n: int) -> list[dict]:
    """A coding-agent-like tool set: zero-argument, strings, enums, arrays, nested objects."""
    shapes: list[dict] = [
        {"type": "object", "properties": {}},
        {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
         "required": ["command"]},
        {"type": "object", "properties": {"mode": {"type": "string", "enum": ["read", "write", "append"]},
                                          "paths": {"type": "array", "items": {"type": "string"}}}},
        {"type": "object", "properties": {"edit": {"type": "object", "properties": {
            "old": {"type": "string"}, "new": {"type": "string"}, "all": {"type": "boolean"}},
            "required": ["old", "new"]}}, "required": ["edit"]},
    ]
    return [{"type": "function", "function": {"name": f"tool_{i}", "parameters": shapes[i % len(shapes)]}}
            for i in range(n)]


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def bench_grammar(tokenizer: Any = None, *, vocab_size: int | None = None, parser: str = "hermes",
                  num_tools: int = 8, tokens: int = 256, seed: int = 0) -> dict[str, Any]:
    """Measure on this CPU; the tokenizer defaults to the embedded SmolLM2's."""
    import torch

    if tokenizer is None:
        from agentbox.hub.embedded import embedded_model_path
        from agentbox.models.loader import load_tokenizer, resolve_model

        path = embedded_model_path()
        if path is None:
            raise RuntimeError("no tokenizer given and the embedded SmolLM2 is not installed")
        tokenizer = load_tokenizer(resolve_model(str(path)))
    vocab = vocab_size or len(tokenizer)
    t0 = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab)
    setup_s = time.perf_counter() - t0
    tools = sample_tools(num_tools)

    compile_ms: dict[str, dict[str, float]] = {}
    for choice in ("required", "auto"):
        t0 = time.perf_counter()
        spec = grammar_spec(tools, choice, None, parser)
        assert spec is not None
        grammar = compiler.compile(spec)
        uncached = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = compiler.compile(spec)
        cached = time.perf_counter() - t0
        assert again is grammar
        compile_ms[choice] = {"uncached_ms": _ms(uncached), "cached_ms": _ms(cached)}

    # Per-token overhead: fill + apply + accept, against the same random sampling without a mask.
    required = grammar_spec(tools, "required", None, parser)
    assert required is not None
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, vocab)
    masked: list[float] = []
    plain: list[float] = []
    state = compiler.state(required)
    for _ in range(tokens):
        logits = torch.randn(1, vocab, generator=gen)
        t0 = time.perf_counter()
        int(torch.argmax(logits[0]))
        plain.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        state.fill_bitmask(bitmask, 0)
        apply_bitmask(logits, bitmask)
        token = int(torch.argmax(logits[0]))
        state.accept(token)
        masked.append(time.perf_counter() - t0 - plain[-1])
        if state.is_terminated():
            state = compiler.state(required)
    masked.sort()
    return {
        "parser": parser,
        "num_tools": num_tools,
        "vocab_size": vocab,
        "tokenizer_info_ms": _ms(setup_s),
        "compile": compile_ms,
        "mask_overhead_ms": {
            "mean": _ms(statistics.fmean(masked)),
            "p50": _ms(masked[len(masked) // 2]),
            "p99": _ms(masked[min(len(masked) - 1, int(len(masked) * 0.99))]),
        },
        "tokens": tokens,
    }
