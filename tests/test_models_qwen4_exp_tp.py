"""Qwen3.8-Flash-Next through the engine at tensor parallel 2 (two gloo ranks on CPU): attention and delta-net
heads, the experts and the shared expert split; the QSA indexer, the PLE layers (each rank maps the same n-gram
table file: one copy in the page cache) and the gated residuals are replicated, so each rank keeps its heads' K and
V, every indexer key, its heads' delta-net state and the whole PLE rings. Greedy tokens of prompts past the QSA
budget, prefilled in chunks beside decodes, equal transformers' causal computation (and so tp 1's); a session's
later turns resume from their snapshots on both ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_reference import hf_causal_greedy, tp2_greedy_and_turns
from qwen4_exp_models import EOS, save_qwen4_exp

PROMPTS = [[(5 * i + 11 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([3, 21, 30, 44])]
PROMPTS[3][12] = EOS


@pytest.mark.slow
def test_tp2_greedy_equals_transformers_and_resumes_sessions(tmp_path: Path) -> None:
    hf = save_qwen4_exp(tmp_path)
    tp2_greedy_and_turns(tmp_path, PROMPTS, lambda p, n: hf_causal_greedy(hf, p, n), max_tokens=6, batched=24, first_id=3)
