"""On a CUDA device: the tiny random hybrids (Qwen3.5 dense, Qwen3.5 MoE, Qwen3-Next) in bf16 against
transformers in fp32, loaded by our loader like a download. Skipped without CUDA; scripts/gpu_check.sh runs it
with `pytest -m gpu`, then its `hybrid` block (agentbox/bench/gpu_hybrid.py) at Qwen3.6-35B-A3B's shape. On
any machine: that shape's recurrent state per sequence, as our layers hold it, is what the profile counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hybrid_models import configs, hf_logits, save_hybrid

from agentbox.bench.gpu_hybrid import qwen3_6_35b_a3b_config
from agentbox.hub.profiles import find_profile
from agentbox.layers.recurrent_state import StateCache
from agentbox.models.registry import model_class

PROMPT = [(i * 29 + 3) % 256 for i in range(40)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", list(configs()))
def test_hybrid_bf16_logits_on_gpu(kind: str, tmp_path: Path) -> None:
    from agentbox.config import EngineConfig
    from agentbox.engine.llm import LLM

    hf = save_hybrid(configs()[kind], tmp_path)
    expected = hf_logits(hf, PROMPT)[-1]
    llm = LLM(EngineConfig(model=str(tmp_path), device="cuda", dtype="bfloat16", num_pages=16))
    got = llm.logits(PROMPT).cpu()
    scale = expected.abs().max().item()
    torch.testing.assert_close(got, expected, atol=0.03 * scale, rtol=0.0)
    top2 = expected.topk(2).values
    if top2[0] - top2[1] > 0.03 * scale:  # not a near tie
        assert int(got.argmax()) == int(expected.argmax())


def test_35b_a3b_shape_state_matches_the_profile() -> None:
    config = qwen3_6_35b_a3b_config(layers=4)
    with torch.device("meta"):
        model = model_class(config)(config)
    state = model.cache_layout().state
    assert state is not None
    specs = list(state.specs)
    assert len(specs) == 3  # 3 Gated DeltaNet layers, then the attention layer
    profile = find_profile("Qwen3.6-35B-A3B")
    per_group = StateCache.bytes_per_slot(specs, torch.bfloat16)
    assert per_group * profile.layers // 4 == profile.state_bytes

