"""GLM-5.3-Flash sessions over HTTP, the way agents talk: a tiny random GLM-5.3-Flash (KDA state, latents and
pooled indexer keys; tests/glm5_next_models.py) behind a real server with a GLM-4.7-style chat template
(tests/glm_template.py: GLM-5.3-Flash's own template is not available offline). 4 conversations at once, 8 turns
each, the whole history sent every turn; the four system prompts are about 1k, 1.5k, 2k and 2.5k tokens (prompts
of 1.3k to 3.9k), and every turn ends where the answer and a tool result of its own length put it (not on 4-token
pool boundaries). Run twice: with snapshots off (`--state-snapshots 0`: a later turn resumes nothing, as a
stateful model must when no snapshot describes its state, so every answer there is a cold run), then with
snapshots on: each later turn's cached share, and every answer against the cold run's."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import transformers
from glm5_next_models import randomize, tiny_config
from glm_template import SPECIAL, TEMPLATE
from http_sessions import cold_and_warm, report

from agentbox.config import CPU_PAGE_SIZE

pytestmark = pytest.mark.slow
EOS = "<|user|>"  # GLM ends a turn by starting the next one


def save_model(d: Path, smollm2_tokenizer) -> Path:  # noqa: ANN001
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [*SPECIAL, "[gMASK]", "<sop>", "<think>", "</think>"]})
    tok.chat_template = TEMPLATE
    config = tiny_config(vocab_size=len(tok), max_position_embeddings=16384,
                         eos_token_id=tok.convert_tokens_to_ids(EOS))
    randomize(transformers.Glm5NextForConditionalGeneration(config).float().eval()).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_glm5_next_sessions_over_http(tmp_path: Path, smollm2_tokenizer) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = save_model(tmp_path / "glm5-next-tiny", smollm2_tokenizer)
    results = cold_and_warm(model, tmp_path, base=50, step=25, pool_tokens=14400)  # ~1k to 2.5k
    on, off, unlike, lengths = report(results)
    assert min(lengths) >= 1000 and max(lengths) >= 2500
    assert sum(n % 4 != 0 for n in lengths) >= len(lengths) // 2  # turns end off the 4-token pool grid
    assert unlike == 0
    assert min(on) >= 0.9
    # The prompt ends in the generation prompt <|assistant|><think>; the next turn has <|assistant|> then the answer.
    # The prompt snapshot stands at the last page boundary before that tail (chat/generation_prompt.py), so every
    # later turn resumes within its 2 tokens and a page of the previous prompt; at the prompt's own last boundary
    # it stood past the divergence on a quarter of the turns, which resumed a whole turn earlier.
    assert min(results["on"][3]) >= -(2 + CPU_PAGE_SIZE - 1)
    assert max(off) == 0.0
