"""Constrained decoding through the engine: a tiny random-weight model (SmolLM2's real tokenizer and
vocabulary, random weights) answers 200 `tool_choice=required` requests with varied schemas, and every
output parses to schema-valid arguments."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from agentbox.chat.tool_parsers import get_tool_parser
from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import GrammarSpec, SamplingParams
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
    prompts, params = [], []
    for i in range(200):
        k = rng.randint(1, len(TOOLS))
        tools = rng.sample(TOOLS, k)
        prompts.append(smollm2_tokenizer.encode(f"request {i}: call a tool"))
        params.append(SamplingParams(max_tokens=384, temperature=1.0, seed=i, grammar=GrammarSpec(
            tools=tools, tool_choice="required", parser="hermes", parallel_tool_calls=False)))
    outs = llm.generate(prompts, params)
    for out, sp in zip(outs, params, strict=True):
        assert out.finish_reason == "stop", (out.finish_reason, smollm2_tokenizer.decode(out.token_ids))
        text = smollm2_tokenizer.decode(out.token_ids, skip_special_tokens=True)
        parsed = get_tool_parser("hermes", sp.grammar.tools).parse(text)
        assert len(parsed.tool_calls) == 1, text
        call = parsed.tool_calls[0]
        try:
            args = json.loads(call.arguments)
        except ValueError as e:
            raise AssertionError(repr(text)) from e
        check(args, SCHEMAS[call.name])
    llm.core.check_integrity()
