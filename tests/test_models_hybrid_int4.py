"""A hybrid checkpoint in AWQ (AutoAWQ GEMM) and GPTQ (v1, act-order) int4, as the community quantisations of
Qwen3.5 / Qwen3.6 lay them out: the delta net's in_proj_qkv, in_proj_z and out_proj, the gated attention and
the MLP quantised in groups of 128; in_proj_b / in_proj_a (one row per value head) and the vision tower left in
fp16 and named in modules_to_not_convert. Loaded by our loader, against transformers running the dequantised
twin (exact CPU kernels: the twin's weights are the codes times their scales)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from hybrid_models import TEXT, VISION, hf_logits, save_hybrid
from quant_checkpoints import int4_quant_config, quantise_int4_state
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5Config

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.layers.quant import QuantMethod
from agentbox.models.loader import load_model

# every quantised input 128 wide (one group): hidden 128, attention o_proj 4 x 64, delta-net values 4 x 32
SHAPE = dict(TEXT, hidden_size=128, intermediate_size=256, head_dim=64, linear_key_head_dim=64,
             linear_value_head_dim=32)
KEEP = ("in_proj_b", "in_proj_a", "visual")
QUANTISED = ("_proj.weight", "in_proj_qkv.weight", "in_proj_z.weight")
PROMPT = [(i * 29 + 3) % 256 for i in range(40)]


@pytest.mark.usefixtures("exact_cpu_kernels")
def test_int4_hybrids_match_their_dequantised_twins(tmp_path: Path) -> None:
    config_in = Qwen3_5Config(text_config=SHAPE, vision_config=dict(VISION, out_hidden_size=128),
                              architectures=["Qwen3_5ForConditionalGeneration"])
    save_hybrid(config_in, tmp_path / "fp32")
    state = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    for method, act_order in (("awq", False), ("gptq", True)):
        path, twin_dir = tmp_path / method, tmp_path / f"{method}-twin"
        kept = {n: t.half() for n, t in state.items() if any(k in n for k in KEEP)}
        out, twin = quantise_int4_state({n: t for n, t in state.items() if n not in kept}, method, sym=False,
                                        act_order=act_order, group=128, suffixes=QUANTISED)
        for d, tensors, extra in ((path, {**out, **kept}, int4_quant_config(method, False, act_order, 128)),
                                  (twin_dir, {**twin, **{n: t.float() for n, t in kept.items()}}, None)):
            d.mkdir()
            save_file(tensors, str(d / "model.safetensors"))
            qc = {"quantization_config": {**extra, "modules_to_not_convert": list(KEEP)}} if extra else {}
            (d / "config.json").write_text(json.dumps({**config, **qc}))
        ours = load_model(str(path), torch.float32, "cpu")
        layer = ours.model.language_model.layers[0].linear_attn
        assert layer.in_proj_qkv.quant_method.kind is QuantMethod(method)
        assert layer.out_proj.quant_method.kind is QuantMethod(method)
        assert getattr(layer.in_proj_b.quant_method, "kind", None) is not QuantMethod(method)
        hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(twin_dir, dtype=torch.float32).eval()
        llm = LLM(EngineConfig(model=str(path), num_pages=16, attention="torch"), loaded=ours)
        torch.testing.assert_close(llm.logits(PROMPT), hf_logits(hf, PROMPT)[-1], atol=2e-4, rtol=2e-4,
                                   msg=method)
