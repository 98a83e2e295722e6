"""GLM-5.3-Flash through the engine at tensor parallel 2 (two gloo ranks on CPU): attention and KDA heads, the
experts and the MLPs split; the latents, the indexer and the hyper-connections are replicated, so each rank keeps
the whole paged cache and its own heads' KDA state. Greedy tokens of prompts past index_topk x index_kpool,
prefilled in chunks beside decodes, equal transformers' causal computation (and so tp 1's); a session's later turn
resumes from its snapshot on both ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from glm5_next_models import save_glm5_next
from hf_reference import hf_causal_greedy, tp2_greedy_and_turns

PROMPTS = [[(5 * i + 11 * j) % 250 + 1 for j in range(n)] for i, n in enumerate([3, 29, 45, 70])]


@pytest.mark.slow
def test_tp2_greedy_equals_transformers_and_resumes_sessions(tmp_path: Path) -> None:
    hf = save_glm5_next(tmp_path)
    tp2_greedy_and_turns(tmp_path, PROMPTS, lambda p, n: hf_causal_greedy(hf, p, n), max_tokens=8, batched=48, first_id=1)
