"""Tiny random Gemma 4 (dense, image-text) served in-process with `--attention triton` (the interpreter on CPU):
16-wide sliding layers with an 8-token window and 32-wide global layers at scale 1 through the prefix-extend
kernel (a ragged batch longer than the window) and the paged decode kernel; greedy equals transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gemma4_models import configs, save_gemma4
from hybrid_models import hf_greedy

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.models.loader import load_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[(i * 37 + 11) % 256 for i in range(11)], [9, 8, 7, 6, 5]]


@pytest.mark.slow
def test_gemma4_triton_greedy_matches_transformers(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    hf = save_gemma4(configs()["dense"], tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, DEVICE)
    config = EngineConfig(model=str(tmp_path), device=DEVICE, dtype="float32", attention="triton", num_pages=32,
                          page_size=4, cache_policy="none")
    llm = LLM(config, loaded=loaded)
    assert llm.core.runner.backend.name == "triton"
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(hf, p, 4) for p in PROMPTS]
