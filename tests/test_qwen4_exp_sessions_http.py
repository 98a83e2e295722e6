"""Qwen3.8-Flash-Next sessions over HTTP, the way agents talk: a tiny random Qwen3.8-Flash-Next (delta-net state,
QSA K/V and indexer keys, the PLE rings of the last token ids and conv inputs; tests/qwen4_exp_models.py) behind a
real server with SmolLM2's ChatML template (its `<|im_end|>` is the end of text, so the n-gram context resets at
every turn's end). 4 conversations at once, 8 turns each, the whole history sent every turn; the four system
prompts are about 1k, 1.5k, 2k and 2.5k tokens, and every turn ends where the answer and a tool result of its own
length put it (not on 4-token block boundaries). Run twice: with snapshots off (`--state-snapshots 0`: a later
turn resumes nothing, so every answer there is a cold run), then with snapshots on: each later turn's cached
share, and every answer against the cold run's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from http_sessions import cold_and_warm, report
from qwen4_exp_models import randomize, tiny_config

pytestmark = pytest.mark.slow


def save_model(d: Path, tokenizer) -> Path:  # noqa: ANN001
    config = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=16384,
                         eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"))
    torch.manual_seed(0)
    randomize(transformers.Qwen4ExpForConditionalGeneration(config).float().eval()).save_pretrained(d)
    tokenizer.save_pretrained(d)
    return d


def test_qwen4_exp_sessions_over_http(tmp_path: Path, smollm2_tokenizer) -> None:  # noqa: ANN001
    model = save_model(tmp_path / "qwen4-exp-tiny", smollm2_tokenizer)
    on, off, unlike, lengths = report(cold_and_warm(model, tmp_path, base=50, step=25, pool_tokens=14400))  # ~1k to 2.5k
    assert min(lengths) >= 1000 and max(lengths) >= 2500
    assert sum(n % 4 != 0 for n in lengths) >= len(lengths) // 2  # turns end off the 4-token block grid
    assert unlike == 0
    assert min(on) >= 0.9
    assert max(off) == 0.0
