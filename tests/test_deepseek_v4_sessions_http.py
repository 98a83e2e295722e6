"""DeepSeek-V4 sessions over HTTP, the way agents talk: a tiny random DeepSeek-V4 (HCA entries of 128 tokens, as
the release, so an entry spans 8 pages of 16) behind a real server with DeepSeek-V4's chat template. 4 conversations
at once, 8 turns each, the whole history sent every turn; the four system prompts are about 1k, 2.4k, 3.8k and 5.2k
tokens, so prompts run from 1k to 6k tokens, and every turn ends where the answer and a tool result of its own
length put it (not on 4- or 128-token boundaries). Run twice: with snapshots off (`--state-snapshots 0`: a later
turn resumes nothing, as a stateful model must when no snapshot describes its state, so every answer there is a
cold run), then with snapshots on: each later turn's cached share, and every answer against the cold run's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from deepseek_v4_models import CSA, HCA, randomize, tiny_config
from http_sessions import cold_and_warm, report

pytestmark = pytest.mark.slow
TEMPLATE = (Path(__file__).parent / "fixtures" / "deepseek_v4_chat_template.jinja").read_text()
SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"]


def save_model(d: Path, smollm2_tokenizer) -> Path:  # noqa: ANN001
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = TEMPLATE
    config = tiny_config(vocab_size=len(tok), compress_rates={CSA: 4, HCA: 128}, max_position_embeddings=16384,
                         eos_token_id=tok.convert_tokens_to_ids("<｜end▁of▁sentence｜>"))
    randomize(transformers.DeepseekV4ForCausalLM(config).float().eval()).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_deepseek_v4_sessions_over_http(tmp_path: Path, smollm2_tokenizer) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = save_model(tmp_path / "deepseek-v4-tiny", smollm2_tokenizer)
    on, off, unlike, lengths = report(cold_and_warm(model, tmp_path, base=40, step=53))  # ~1k to 5.2k of system
    assert min(lengths) >= 1000 and max(lengths) >= 5500
    assert sum(n % 4 != 0 for n in lengths) >= len(lengths) // 2  # turns end off the 4- (and so 128-) token grid
    assert unlike == 0
    assert min(on) >= 0.9
    assert max(off) == 0.0
