"""DeepSeek-V4 through the engine at tensor parallel 2 (two gloo ranks on CPU): the query heads, the sinks and wo_a's
groups split, wo_b and the experts reduce; the K=V head, the compressors and the indexer are replicated, so each rank
keeps the whole cache and rings. Greedy tokens of prompts prefilled in chunks beside decodes equal transformers'
(and so tp 1's); a session's later turn resumes from its snapshot on both ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from deepseek_v4_models import hf_greedy, save_deepseek_v4
from hf_reference import tp2_greedy_and_turns

PROMPTS = [[(5 * i + 11 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([3, 29, 70, 101])]


@pytest.mark.slow
def test_tp2_greedy_equals_transformers_and_resumes_sessions(tmp_path: Path) -> None:
    hf = save_deepseek_v4(tmp_path)
    tp2_greedy_and_turns(tmp_path, PROMPTS, lambda p, n: hf_greedy(hf, p, n), max_tokens=8, batched=48, first_id=1)
