"""Laguna sessions over HTTP, the way agents talk (tests/http_sessions.py): a tiny random Laguna (XS.2's pattern: a
global layer, then three sliding layers of a 64-token window) behind a real server with XS.2's own chat template (the
one llama.cpp vendors). 4 conversations at once, 8 turns each; every prompt is many windows long, so each later turn
resumes the sliding layers' rings from a snapshot and the global layer's pages from the radix cache. Snapshots off
(every answer a cold run), then on: each later turn's cached share, and every answer against the cold run's.

XS.2's template renders an earlier answer otherwise than the model wrote it (`</think>\\n`, the text stripped,
`\\n</assistant>`), so a later turn can reuse at most the previous prompt (and a random model's answer rarely
more); the test prints how far short of it each later turn resumed."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from http_sessions import cold_and_warm, report
from laguna_models import randomize, tiny_config

pytestmark = pytest.mark.slow
TEMPLATE = (Path(__file__).parent / "fixtures" / "laguna_xs2_chat_template.jinja").read_text()
SPECIAL = ["〈|EOS|〉", "<system>", "</system>", "<user>", "</user>", "<assistant>", "</assistant>", "<think>",
           "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
WINDOW = 64


def save_model(d: Path, smollm2_tokenizer) -> Path:  # noqa: ANN001
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = TEMPLATE
    config = tiny_config("head", vocab_size=len(tok), sliding_window=WINDOW, max_position_embeddings=16384,
                         eos_token_id=tok.convert_tokens_to_ids("</assistant>"))
    randomize(transformers.LagunaForCausalLM(config).float().eval()).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_laguna_sessions_over_http(tmp_path: Path, smollm2_tokenizer) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    on, off, unlike, lengths = report(cold_and_warm(save_model(tmp_path / "laguna-tiny", smollm2_tokenizer), tmp_path))
    assert min(lengths) >= 15 * WINDOW
    assert unlike == 0
    assert min(on) >= 0.9
    assert max(off) == 0.0
