"""Constrained decoding through the engine: a tiny random-weight model (SmolLM2's real tokenizer and
vocabulary, random weights) answers 200 `tool_choice=required` requests with varied schemas, and every
output parses to schema-valid arguments."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from agentbox.chat.grammar import grammar_spec
from agentbox.chat.tool_parsers import get_tool_parser
from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from tests.test_chat_grammar import SCHEMAS, TOOLS, check


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:  # noqa: ANN001
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-random-llama")
    cfg = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      eos_token_id=smollm2_tokenizer.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    smollm2_tokenizer.save_pretrained(d)
    return d


def test_200_required_calls_are_schema_valid(tiny_model_dir: Path, smollm2_tokenizer) -> None:  # noqa: ANN001
    llm = LLM(EngineConfig(model=str(tiny_model_dir), num_pages=2048, max_num_seqs=64, max_num_batched_tokens=4096))
    rng = random.Random(0)
    prompts, params, toolsets = [], [], []
    for i in range(200):
        k = rng.randint(1, len(TOOLS))
        tools = rng.sample(TOOLS, k)
        toolsets.append(tools)
        prompts.append(smollm2_tokenizer.encode(f"request {i}: call a tool"))
        params.append(SamplingParams(max_tokens=384, temperature=1.0, seed=i, grammar=grammar_spec(
            tools, "required", None, "hermes", parallel_tool_calls=False)))
    outs = llm.generate(prompts, params)
    for out, tools in zip(outs, toolsets, strict=True):
        assert out.finish_reason == "stop", (out.finish_reason, smollm2_tokenizer.decode(out.token_ids))
        text = smollm2_tokenizer.decode(out.token_ids, skip_special_tokens=True)
        parsed = get_tool_parser("hermes", tools).parse(text)
        assert len(parsed.tool_calls) == 1, text
        call = parsed.tool_calls[0]
        try:
            args = json.loads(call.arguments)
        except ValueError as e:
            raise AssertionError(repr(text)) from e
        check(args, SCHEMAS[call.name])
    llm.core.check_integrity()


# An unbounded array of strings: the shape a weak model looped inside (`["shell","gument","gument",…]`).
SHELL = {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                          "cwd": {"type": "string"}}, "required": ["command"]}
LOOP_TOOLS = [*TOOLS, {"type": "function", "function": {"name": "shell", "parameters": SHELL}}]
LOOP_SCHEMAS = {**SCHEMAS, "shell": SHELL}


@pytest.fixture(scope="module")
def markov_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer) -> Path:  # noqa: ANN001
    """A looping model: attention and MLP write nothing, so the next token depends only on the current one
    (an order-1 Markov chain); under greedy decoding it must fall into a cycle, inside strings included."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("markov-llama")
    cfg = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      eos_token_id=smollm2_tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.normal_(0, 1.0)
        # A constant dimension in the residual stream that only special tokens' rows read, negatively:
        # the model never ends its turn by itself.
        model.model.embed_tokens.weight[:, 0] = 4.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[smollm2_tokenizer.all_special_ids, 0] = -30.0
    model.save_pretrained(d, safe_serialization=True)
    smollm2_tokenizer.save_pretrained(d)
    return d


def _parse_all(tok, outs, toolsets, reasons: set[str]) -> None:  # noqa: ANN001
    for out, tools in zip(outs, toolsets, strict=True):
        text = tok.decode(out.token_ids, skip_special_tokens=True)
        assert out.finish_reason in reasons, (out.finish_reason, text)
        calls = get_tool_parser("hermes", tools).parse(text).tool_calls
        assert calls, text
        for call in calls:
            try:
                args = json.loads(call.arguments)
            except ValueError as e:
                raise AssertionError(repr(text)) from e
            check(args, LOOP_SCHEMAS[call.name])


def test_calls_under_a_tight_budget_close_schema_valid(tiny_model_dir: Path, smollm2_tokenizer) -> None:  # noqa: ANN001
    """max_tokens far below what the model would write: the grammar closes every call in time (through the
    engine; test_chat_grammar.py runs 200 such calls on the same protocol without a model)."""
    llm = LLM(EngineConfig(model=str(tiny_model_dir), num_pages=2048, max_num_seqs=64, max_num_batched_tokens=4096))
    rng = random.Random(1)
    prompts, params, toolsets = [], [], []
    for i in range(32):
        tools = rng.sample(LOOP_TOOLS, rng.randint(1, len(LOOP_TOOLS)))
        toolsets.append(tools)
        prompts.append(smollm2_tokenizer.encode(f"budget {i}: call a tool"))
        params.append(SamplingParams(max_tokens=rng.randint(48, 80), temperature=1.0, seed=i, grammar=grammar_spec(
            tools, "required", None, "hermes", parallel_tool_calls=i % 2 == 0)))
    outs = llm.generate(prompts, params)
    _parse_all(smollm2_tokenizer, outs, toolsets, {"stop"})
    assert all(len(o.token_ids) <= p.max_tokens for o, p in zip(outs, params, strict=True))
    llm.core.check_integrity()


def test_calls_from_a_looping_model_are_cut_schema_valid(markov_model_dir: Path, smollm2_tokenizer,  # noqa: ANN001
                                                             caplog: pytest.LogCaptureFixture) -> None:
    """Greedy decoding of a model that can only loop: the loop guard trips inside the call and the grammar
    cuts it at a schema-valid point, long before max_tokens."""
    import logging

    llm = LLM(EngineConfig(model=str(markov_model_dir), num_pages=4096, max_num_seqs=64, max_num_batched_tokens=4096,
                           loop_guard_min_tokens=32))
    rng = random.Random(2)
    prompts, params, toolsets = [], [], []
    for i in range(32):
        tools = rng.sample(LOOP_TOOLS, rng.randint(1, len(LOOP_TOOLS)))
        toolsets.append(tools)
        prompts.append(smollm2_tokenizer.encode(f"loop {i}: {rng.random()} call a tool"))
        params.append(SamplingParams(max_tokens=1500, temperature=0.0, grammar=grammar_spec(
            tools, "required", None, "hermes", parallel_tool_calls=False)))
    with caplog.at_level(logging.WARNING, logger="agentbox.engine.core"):
        outs = llm.generate(prompts, params)
    _parse_all(smollm2_tokenizer, outs, toolsets, {"stop"})
    looped = [r for r in caplog.records if "loop guard" in r.getMessage()]
    assert len(looped) >= 2, len(looped)  # the model does loop, and is cut, not run to max_tokens
    assert max(len(o.token_ids) for o in outs) < 1500


def test_a_looping_generation_without_max_tokens_ends_by_the_loop_guard(markov_model_dir: Path,  # noqa: ANN001
                                                                      smollm2_tokenizer) -> None:
    llm = LLM(EngineConfig(model=str(markov_model_dir), num_pages=512, max_model_len=4096))
    sp = SamplingParams(max_tokens=4000, temperature=0.0)  # what the server sends when the client sends none
    out = llm.generate([smollm2_tokenizer.encode("write forever")], [sp])[0]
    assert out.finish_reason == "length" and len(out.token_ids) < 400, len(out.token_ids)
    off = LLM(EngineConfig(model=str(markov_model_dir), num_pages=512, max_model_len=4096, loop_guard=False),
              loaded=llm.loaded)
    sp2 = SamplingParams(max_tokens=600, temperature=0.0)
    assert len(off.generate([smollm2_tokenizer.encode("write forever")], [sp2])[0].token_ids) == 600
