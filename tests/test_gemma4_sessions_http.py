"""Gemma 4 12B sessions over HTTP, the way agents talk (tests/http_sessions.py): the tiny random unified checkpoint
(`gemma4_unified`, tests/gemma4_models.py: sliding layers of an 8-token window between global K=V layers, tiny
audio and vision embedders the loader skips) behind a real server with our template of Gemma 4's chat format
(tests/data/). 4 conversations at once, 8 turns each; every prompt is hundreds of windows long, so each later turn
resumes the sliding layers' rings from a snapshot and the global layers' pages from the radix cache. Snapshots off
(every answer a cold run), then on: each later turn's cached share, and every answer against the cold run's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from gemma4_models import WINDOW, save_gemma4, unified_config
from http_sessions import cold_and_warm, report

pytestmark = pytest.mark.slow
TEMPLATE = (Path(__file__).parent / "data" / "gemma4_format_chat_template.jinja").read_text()
SPECIAL = ["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", '<|"|>', "<|tool>",
           "<tool|>", "<|tool_response>", "<tool_response|>"]


def save_model(d: Path, smollm2_tokenizer) -> Path:  # noqa: ANN001
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = TEMPLATE
    config = unified_config(vocab_size=len(tok), max_position_embeddings=16384,
                            eos_token_id=tok.convert_tokens_to_ids("<turn|>"))
    save_gemma4(config, d)
    tok.save_pretrained(d)
    return d


def test_gemma4_unified_sessions_over_http(tmp_path: Path, smollm2_tokenizer) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    on, off, unlike, lengths = report(cold_and_warm(save_model(tmp_path / "gemma4-12b-tiny", smollm2_tokenizer),
                                                    tmp_path))
    assert min(lengths) >= 100 * WINDOW
    assert unlike == 0
    assert min(on) >= 0.9
    assert max(off) == 0.0
