"""The chat path every API dialect shares: a dialect-neutral conversation (OpenAI-style messages + tools)
in, prompt token ids out; generated text in, content / reasoning / tool-call deltas out.

The dialect routes (OpenAI chat, Anthropic messages, OpenAI responses) only translate shapes; which
template renders the prompt, which parser reads tool calls and how reasoning is split is decided here,
once, from the model's own chat template, so the three dialects can never disagree about a model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from agentbox.chat.effort import ReasoningEffort
from agentbox.chat.generation_prompt import history_end, unrepeated_tail
from agentbox.chat.grammar import forced_name, grammar_spec
from agentbox.chat.harmony import is_harmony_template
from agentbox.chat.incremental import incremental_for
from agentbox.chat.incremental_render import renderer_for
from agentbox.chat.reasoning import get_reasoning_splitter, prompt_opens_reasoning
from agentbox.chat.render import normalize_tools
from agentbox.chat.template import template_text
from agentbox.chat.tool_parsers import ALIASES, PARSERS, Delta, ToolCall, detect_tool_parser, get_tool_parser
from agentbox.chat.tool_prompt import template_renders_tools
from agentbox.engine.grammar_spec import GrammarSpec, ReasoningMode
from agentbox.engine.sampling import InvalidParam, SamplingParams
from agentbox.server.errors import APIError
from agentbox.server.state import ServerState

DEFAULT_TOOL_PARSER = "hermes"  # what a model with no trained call syntax is steered to by the grammar
log = logging.getLogger("agentbox.server")
_warned_fallback: set[str] = set()  # models already warned about (once per model, not per request)


@dataclass
class Conversation:
    """One request, whatever its dialect, in the shape the chat templates read."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # auto | none | required | {"type": "function", ...}
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    structured_tool_calls: bool = True  # auto + tools: a structural tag keeps every call schema-valid
    enable_thinking: bool | None = None  # None: the template's default
    reasoning_effort: ReasoningEffort | None = None  # None: the profile's default, else the template's (gpt-oss: medium)
    # Where the request carries each tool's schema and the response format's, for errors that name them
    tool_params: list[str] | None = None  # one per tool; None: OpenAI chat's tools[i].function.parameters
    format_param: str = "response_format.json_schema.schema"


@dataclass
class FinalOutput:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


class DistinctCalls:
    """Holds each tool call's deltas until the call is complete and drops a call equal (same name, same
    arguments) to an earlier one of the turn: under tool_choice=required a weak model repeats its call
    until the grammar's cap, and an agent would run each copy."""

    def __init__(self) -> None:
        self.pending: list[Delta] = []
        self.seen: set[tuple[str, str]] = set()
        self.next_index = 0

    def feed(self, deltas: list[Delta]) -> list[Delta]:
        out: list[Delta] = []
        for d in deltas:
            tc = d.tool_call
            if tc is None:
                out.append(d)
                continue
            if self.pending and self.pending[0].tool_call.index != tc.index:  # type: ignore[union-attr]
                out += self.finish()
            self.pending.append(d)
        return out

    def finish(self) -> list[Delta]:
        pending, self.pending = self.pending, []
        if not pending:
            return []
        calls = [d.tool_call for d in pending if d.tool_call is not None]
        name = next((c.name for c in calls if c.name), "")
        args = "".join(c.arguments for c in calls)
        try:
            key = (name, json.dumps(json.loads(args or "{}"), sort_keys=True))
        except ValueError:
            key = (name, args)
        if key in self.seen:
            return []
        self.seen.add(key)
        index, self.next_index = self.next_index, self.next_index + 1
        return [replace(d, tool_call=replace(c, index=index)) for d, c in zip(pending, calls, strict=True)]


class OutputProcessor:
    """Text deltas from `generation.generate()` in; content, reasoning and tool-call deltas out.

    Reasoning is split first and the tool parser only ever sees content, so a `<tool_call>` written while
    thinking is reasoning, and no reasoning text can reach tool arguments.
    """

    def __init__(self, reasoning_style: str, starts_inside: bool, tool_parser: str | None,
                 tools: list[dict] | None, distinct_calls: bool = False) -> None:
        self.splitter = get_reasoning_splitter(reasoning_style, starts_inside=starts_inside)
        self.tools = get_tool_parser(tool_parser, tools).stream() if tool_parser else None
        self.distinct = DistinctCalls() if distinct_calls and self.tools is not None else None

    @property
    def has_tool_calls(self) -> bool:
        return self.tools is not None and self.tools.has_tool_calls

    def feed(self, text: str) -> list[Delta]:
        return self._route(self.splitter.feed(text)) if text else []

    def finish(self) -> list[Delta]:
        out = self._route(self.splitter.finish())
        if self.tools is not None:
            out += self.tools.finish() if self.distinct is None else self.distinct.feed(self.tools.finish())
        if self.distinct is not None:
            out += self.distinct.finish()
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """`tool_calls` when the turn called tools, unless it was cut off (then `length` says so)."""
        if self.has_tool_calls and engine_reason != "length":
            return "tool_calls"
        return engine_reason

    def _route(self, deltas: list[Delta]) -> list[Delta]:
        out: list[Delta] = []
        for d in deltas:
            if d.content is not None and self.tools is not None:
                calls = self.tools.feed(d.content)
                out += calls if self.distinct is None else self.distinct.feed(calls)
            else:
                out.append(d)
        return out


def fold(deltas: list[Delta]) -> FinalOutput:
    """The non-streaming message: every delta folded back together."""
    out = FinalOutput()
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        out.content += d.content or ""
        out.reasoning += d.reasoning or ""
        if (tc := d.tool_call) is not None:
            call = calls.setdefault(tc.index, ToolCall(id="", name="", arguments=""))
            call.id = tc.id or call.id
            call.name = tc.name or call.name
            call.arguments += tc.arguments
    out.tool_calls = [calls[i] for i in sorted(calls)]
    return out


@dataclass
class PreparedChat:
    """A rendered request: what to send the engine and how to read what comes back."""

    conv: Conversation
    prompt_text: str
    prompt_ids: Sequence[int]  # an int32 array from the incremental tokenizer: it crosses to the engine as is
    tools: list[dict] | None  # normalised to {"type": "function", "function": {...}}
    tool_parser: str | None  # None: tool calls are not parsed (no tools, or tool_choice none)
    reasoning_style: str  # qwen3 | harmony | none
    starts_inside: bool  # the prompt ends inside an open <think>
    history_end: int = 0  # the prompt's tokens the next turn will repeat (chat/generation_prompt.py), or 0

    def output(self) -> OutputProcessor:
        c = self.conv
        distinct = c.tool_choice in ("required", "any") and c.parallel_tool_calls
        return OutputProcessor(self.reasoning_style, self.starts_inside, self.tool_parser, self.tools, distinct)

    def grammar(self) -> GrammarSpec | None:
        """What the engine constrains decoding to, or None for free output."""
        c = self.conv
        choice = c.tool_choice if c.tool_choice is not None else "auto"
        tools = self.tools if self.tool_parser else None
        if tools and choice == "auto" and not c.structured_tool_calls:
            tools = None  # the client switched the structural tag off: free text, parsed after the fact
        rf = c.response_format if (c.response_format or {}).get("type") in ("json_object", "json_schema") else None
        if not tools and rf is None:
            return None
        if self.starts_inside:
            reasoning = ReasoningMode.INSIDE
        elif self.reasoning_style != "none" and c.enable_thinking is not False:
            reasoning = ReasoningMode.OPTIONAL
        else:
            reasoning = ReasoningMode.NONE
        try:
            return grammar_spec(tools, choice if tools else None, rf, self.tool_parser if tools else None,
                                reasoning, c.parallel_tool_calls)
        except ValueError as e:
            raise APIError(400, str(e), param="tool_choice") from e

    def schema_param(self, spec: GrammarSpec, index: int) -> str:
        """The request's path of spec's schema `index` (a tool's, or FORMAT: the response format's)."""
        if index < 0:
            return self.conv.format_param
        name = spec.tools[index].name
        tools = self.tools or []
        i = next((i for i, t in enumerate(tools) if t["function"]["name"] == name), index)
        params = self.conv.tool_params
        return params[i] if params is not None and i < len(params) else f"tools[{i}].function.parameters"


async def grammar_of(state: ServerState, chat: PreparedChat) -> GrammarSpec | None:
    """The grammar the request decodes under, once the gate (server/grammar_gate.py) has judged it: a schema
    past its limits or budget is a 400 naming it, before anything reaches the engine."""
    spec = chat.grammar()
    if spec is not None and state.grammars is not None:
        await state.grammars.admit(spec, lambda i: chat.schema_param(spec, i))
    return spec


def reasoning_style_of(template: str) -> str:
    """harmony channels (gpt-oss), Gemma 4's thought channel, qwen3-style `<think>` blocks when the template knows them; else none."""
    if is_harmony_template(template):
        return "harmony"
    if "<|channel>thought" in template:  # Gemma 4
        return "gemma4"
    return "qwen3" if "<think>" in template else "none"


def _check_tool_choice(tools: list[dict] | None, choice: Any, param: str) -> None:
    if choice is None or choice in ("auto", "none"):
        return
    if choice in ("required", "any"):
        if not tools:
            raise APIError(400, "tool_choice requires a tool call but no tools were given", param=param)
        return
    name = forced_name(choice)
    if name is None:
        raise APIError(400, f"tool_choice {choice!r:.80} is not auto, none, required or a named function",
                       param=param)
    if name not in {t["function"]["name"] for t in tools or []}:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param=param)


def tool_syntax(profile_parser: str | None, template: str) -> str:
    """The call syntax a model is read in: its profile's parser, else the template's, else hermes."""
    name = ALIASES.get(profile_parser or "", profile_parser or "")
    return name if name in PARSERS else detect_tool_parser(template) or DEFAULT_TOOL_PARSER


def prepare_chat(state: ServerState, conv: Conversation, *, param: str = "messages",
                 tool_choice_param: str = "tool_choice", check_length: bool = True) -> PreparedChat:
    """Render, tokenize and pick the output readers; a bad conversation is a 400 naming `param`."""
    tok = state.tokenizer
    for i, m in enumerate(conv.messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"{param}[{i}] has no 'role'", param=f"{param}[{i}].role")
    try:
        tools = normalize_tools(conv.tools)
    except ValueError as e:
        raise APIError(400, str(e), param="tools") from e
    _check_tool_choice(tools, conv.tool_choice, tool_choice_param)
    template = template_text(tok, tools=bool(tools))
    syntax = tool_syntax(state.tool_parser, template)
    if tools and state.model_name not in _warned_fallback and not template_renders_tools(tok, template):
        _warned_fallback.add(state.model_name)
        log.warning("the chat template of %s has no tools section; tool definitions and the %s call format "
                    "go into the system turn instead (see README, 'Tools for templates without them')",
                    state.model_name, syntax)
    try:
        # Only what this turn appended is rendered when the template allows (chat/incremental_render.py).
        effort = conv.reasoning_effort if conv.reasoning_effort is not None else state.default_effort
        text = renderer_for(tok, state.config.tokenize_cache_texts).render(
            conv.messages, tools, enable_thinking=conv.enable_thinking, reasoning_effort=effort, tool_parser=syntax)
    except ValueError as e:  # unsupported content parts
        raise APIError(400, str(e), param=param) from e
    except Exception as e:  # a template error is the request's fault (roles out of order, etc.)
        raise APIError(400, f"the chat template rejected these messages: {e}", param=param) from e
    style = reasoning_style_of(template)
    parser = syntax if tools and conv.tool_choice != "none" else None
    if check_length:
        try:
            state.check_prompt_chars(text, param)  # before tokenizing: a 5 MB prompt is refused at once
        except APIError as e:
            raise _blame_tools(e, conv, tools, len(text)) from None
    # Only what this turn appended is tokenized: the ids equal full tokenization (chat/incremental.py).
    ids = incremental_for(tok, state.config.tokenize_cache_texts).encode_ids(text)
    if check_length:
        state.check_prompt(len(ids), param)
    end = history_end(ids, unrepeated_tail(tok, conv.enable_thinking, effort, syntax))
    return PreparedChat(conv, text, ids, tools, parser, style,
                        starts_inside=prompt_opens_reasoning(text, style) if style != "none" else False,
                        history_end=end)


def _blame_tools(e: APIError, conv: Conversation, tools: list[dict] | None, chars: int) -> APIError:
    """A prompt too long for the context whose tool definitions make most of it: the error names the largest
    tool's schema (a 100,000-member enum is refused here, for its length, before its grammar is built)."""
    sizes = [len(json.dumps(t, ensure_ascii=False)) for t in tools or []]
    if 2 * sum(sizes) < chars:
        return e
    i = max(range(len(sizes)), key=sizes.__getitem__)
    params = conv.tool_params
    where = params[i] if params is not None and i < len(params) else f"tools[{i}].function.parameters"
    return APIError(e.status, f"{e.message}; the tools' definitions take {sum(sizes):,} characters of it, the largest "
                    f"{where} ({sizes[i]:,})", param=where, code=e.code)


def checked(sp: SamplingParams) -> SamplingParams:
    """Validate sampling values; a bad one is a 400 naming its field."""
    try:
        return sp.validate()
    except InvalidParam as e:
        raise APIError(400, str(e), param=e.field, code="invalid_value") from e
