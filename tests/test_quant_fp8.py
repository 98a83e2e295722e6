"""FP8 block-128 (Qwen3-*-FP8 layout) quantised by the test, loaded by our loader, against transformers
running the dequantised twin; TP shards refused off block boundaries."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_harness import PagedRunner
from quant_checkpoints import PROMPT, write_fp8

from agentbox.layers.linear import ColumnParallelLinear
from agentbox.layers.quant import QuantConfig, QuantMethod, quant_context
from agentbox.layers.quant.fp8 import FP8BlockLinearMethod
from agentbox.layers.weight_loading import load_weight
from agentbox.models.loader import load_model
from agentbox.parallel.state import set_tp_state


def test_fp8_checkpoint_matches_the_dequantised_twin(tmp_path: Path) -> None:
    hf = write_fp8(tmp_path)
    ours = load_model(str(tmp_path), torch.float32, "cpu")
    qkv = ours.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, FP8BlockLinearMethod) and qkv.quant_method.kind is QuantMethod.FP8_BLOCK
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(PagedRunner(ours).step({0: PROMPT})[0], expected, atol=1e-4, rtol=1e-4)
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert PagedRunner(ours).greedy(0, PROMPT, 8) == ref[0, len(PROMPT) :].tolist()


def test_fp8_shard_off_a_block_boundary_is_refused() -> None:
    config = QuantConfig(QuantMethod.FP8_BLOCK, 8, block_size=(128, 128))
    set_tp_state(1, 2)
    try:
        with quant_context(config):
            layer = ColumnParallelLinear(128, 192)  # 96 rows per rank: rank 1 starts inside a block
        with pytest.raises(ValueError, match="128-element boundary"):
            load_weight(layer.weight_scale_inv, torch.ones(2, 1))
    finally:
        set_tp_state(0, 1)
