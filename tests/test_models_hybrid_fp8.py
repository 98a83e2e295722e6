"""A hybrid checkpoint in FP8 block-128 (the official `-FP8` releases' layout: e4m3 weights + float32
weight_scale_inv per 128x128 block; projections too small for a block left in bf16 and named in
modules_to_not_convert), loaded by our loader, against transformers running the dequantised twin."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from hybrid_models import MOE, VISION, hf_logits, save_hybrid
from quant_checkpoints import FP8_QUANT_CONFIG, quantise_fp8_state
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig, Qwen3_5MoeConfig, Qwen3NextConfig

from agentbox.layers.quant.fp8 import FP8BlockLinearMethod
from agentbox.models.loader import load_model

# Every quantised projection whole 128-blocks: key / value dims 128, attention q 2 x 4 x 64 (with its gate),
# k / v 2 x 64, experts and the dense MLP of 128 / 256. in_proj_ba (2 x 4 value heads) stays bf16.
SHAPE = dict(MOE, hidden_size=128, intermediate_size=256, head_dim=64, linear_key_head_dim=64,
             linear_value_head_dim=32, moe_intermediate_size=128, shared_expert_intermediate_size=128)
PROMPT = [(i * 29 + 3) % 256 for i in range(40)]
# (config, projections left in bf16: the value heads' gate inputs, 2 x 4 or 4 rows, and the vision tower)
CASES: dict[str, tuple[PretrainedConfig, tuple[str, ...]]] = {
    "qwen3_next": (Qwen3NextConfig(**SHAPE, mlp_only_layers=[1], architectures=["Qwen3NextForCausalLM"]),
                   ("in_proj_ba",)),
    "qwen3_5_moe": (Qwen3_5MoeConfig(text_config=SHAPE, vision_config=dict(VISION, out_hidden_size=128),
                                     architectures=["Qwen3_5MoeForConditionalGeneration"]),
                    ("in_proj_b", "in_proj_a", "visual")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_block_hybrid_matches_the_dequantised_twin(case: str, tmp_path: Path) -> None:
    config_in, keep = CASES[case]
    path, twin_dir = tmp_path / "fp8", tmp_path / "twin"
    save_hybrid(config_in, path)
    state = load_file(str(path / "model.safetensors"))
    kept = {n: t.bfloat16() for n, t in state.items() if any(k in n for k in keep)}
    # Qwen3-Next's fused delta-net input projection is a linear layer too: its name ends without "_proj"
    out, twin = quantise_fp8_state({n: t for n, t in state.items() if n not in kept},
                                   suffixes=("_proj.weight", "in_proj_qkvz.weight", "in_proj_qkv.weight", "in_proj_z.weight"))
    config = json.loads((path / "config.json").read_text())
    twin_dir.mkdir()
    save_file({**twin, **{n: t.float() for n, t in kept.items()}}, str(twin_dir / "model.safetensors"))
    (twin_dir / "config.json").write_text(json.dumps(config))
    save_file({**out, **kept}, str(path / "model.safetensors"))
    qc = {**FP8_QUANT_CONFIG, "weight_block_size": [128, 128], "modules_to_not_convert": list(keep)}
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}))
    assert any(t.dtype == torch.float8_e4m3fn for t in out.values())

    ours = load_model(str(path), torch.float32, "cpu")
    layer = ours.model.language_model.layers[0].linear_attn
    fused = case == "qwen3_next"
    assert isinstance((layer.in_proj_qkvz if fused else layer.in_proj_qkv).quant_method, FP8BlockLinearMethod)
    assert not isinstance((layer.in_proj_ba if fused else layer.in_proj_b).quant_method, FP8BlockLinearMethod)
    hf_cls = getattr(transformers, config_in.architectures[0])
    hf = hf_cls.from_pretrained(twin_dir, dtype=torch.float32).eval()
    from agentbox.config import EngineConfig
    from agentbox.engine.llm import LLM

    llm = LLM(EngineConfig(model=str(path), num_pages=16, attention="torch"), loaded=ours)
    torch.testing.assert_close(llm.logits(PROMPT), hf_logits(hf, PROMPT)[-1], atol=2e-4, rtol=2e-4)
