"""Where a rendered chat prompt's history ends (chat/generation_prompt.py): on SmolLM2's ChatML template and on a
GLM-style one whose generation prompt the next turn does not repeat. What the engine does with it:
test_hybrid_snapshots.py; end to end over HTTP: test_glm5_next_sessions_http.py."""

from __future__ import annotations

import copy

from glm_template import SPECIAL, TEMPLATE

from agentbox.chat.generation_prompt import generation_suffix, history_end
from agentbox.chat.render import render_prompt

MSGS = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "List the files."}]


def _end(tok, messages: list[dict]) -> tuple[int, list[int], list[int]]:  # noqa: ANN001
    text = render_prompt(tok, messages)
    ids = tok.encode(text, add_special_tokens=False)
    plain = tok.encode(render_prompt(tok, messages, add_generation_prompt=False), add_special_tokens=False)
    return history_end(tok, text, ids, generation_suffix(tok, None, None, "hermes")), ids, plain


def test_chatml_history_ends_before_the_assistant_header(smollm2_tokenizer) -> None:  # noqa: ANN001
    tok = smollm2_tokenizer
    assert generation_suffix(tok, None, None, "hermes") == "<|im_start|>assistant\n"
    end, ids, plain = _end(tok, MSGS)
    assert 0 < end < len(ids) and ids[:end] == plain  # the tokens of the render without the generation prompt


def test_glm_history_ends_before_the_opened_think(smollm2_tokenizer) -> None:  # noqa: ANN001
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [*SPECIAL, "[gMASK]", "<sop>", "<think>", "</think>"]})
    tok.chat_template = TEMPLATE
    assert generation_suffix(tok, None, None, "hermes") == "<|assistant|><think>"
    end, ids, plain = _end(tok, MSGS)
    assert end == len(ids) - 2 and ids[:end] == plain
    # the next turn: the answer in place of the generation prompt; it shares the history's tokens, not the tail's
    turn2 = [*MSGS, {"role": "assistant", "content": "main.py"}, {"role": "user", "content": "Read it."}]
    ids2 = tok.encode(render_prompt(tok, turn2), add_special_tokens=False)
    shared = next(i for i, (a, b) in enumerate(zip(ids, ids2, strict=False)) if a != b)
    assert end <= shared < len(ids)


def test_no_claim_where_the_text_does_not_end_in_the_generation_prompt(smollm2_tokenizer) -> None:  # noqa: ANN001
    tok = smollm2_tokenizer
    suffix = generation_suffix(tok, None, None, "hermes")
    text = render_prompt(tok, MSGS, add_generation_prompt=False)  # a completion-style prompt: no generation prompt
    assert history_end(tok, text, tok.encode(text, add_special_tokens=False), suffix) == 0
    assert history_end(tok, "x" + (suffix or ""), [1], suffix) == 0  # the ids are all tail: nothing before it
