"""Nemotron-H sessions over HTTP, the way agents talk (tests/http_sessions.py): a tiny random Nemotron-H (Mamba-2,
MoE, attention, Mamba-2, MLP layers) behind a real server with Nemotron 3 Nano's own chat template (the one llama.cpp
vendors). 4 conversations at once, 8 turns each: each later turn resumes the Mamba layers' conv and SSM state from a
turn-end snapshot (the state describes one exact position: without a snapshot nothing resumes) and the attention
layer's pages from the radix cache. Snapshots off (every answer a cold run), then on: each later turn's cached
share, and every answer against the cold run's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from http_sessions import cold_and_warm, report
from nemotron_h_models import randomize, tiny_config

pytestmark = pytest.mark.slow
TEMPLATE = (Path(__file__).parent / "fixtures" / "nemotron3_nano_chat_template.jinja").read_text()
SPECIAL = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]


def save_model(d: Path, smollm2_tokenizer) -> Path:  # noqa: ANN001
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = TEMPLATE
    config = tiny_config(vocab_size=len(tok), max_position_embeddings=16384,
                         eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"))
    randomize(transformers.NemotronHForCausalLM(config).float().eval()).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_nemotron_h_sessions_over_http(tmp_path: Path, smollm2_tokenizer) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    on, off, unlike, _ = report(cold_and_warm(save_model(tmp_path / "nemotron-h-tiny", smollm2_tokenizer), tmp_path))
    assert unlike == 0
    assert min(on) >= 0.9
    assert max(off) == 0.0
