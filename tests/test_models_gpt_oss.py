"""gpt-oss against transformers with the same random weights: attention sinks, alternating sliding-window
(4 tokens, so the 18-token test crosses it) and full layers, biases, clamped SwiGLU experts, yarn rope.
Experts as stored in a bf16 checkpoint and in the published MXFP4 layout (`*_blocks` / `*_scales`), the
latter against transformers' own dequantised load of the same files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from moe_harness import PROMPT, engine_greedy_matches, hf_logits, paged_logits, save_random
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig, Mxfp4Config

from agentbox.layers.experts.mxfp4 import dequant_mxfp4
from agentbox.models.loader import load_model

E, H, INTER = 8, 64, 64
CONFIG = GptOssConfig(
    hidden_size=H,
    intermediate_size=INTER,
    num_hidden_layers=2,  # sliding, full
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    num_local_experts=E,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    sliding_window=4,
    rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 150000.0,
    },
    architectures=["GptOssForCausalLM"],
)


@pytest.fixture(scope="module")
def bf16_layout(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("gpt-oss")
    hf = save_random(CONFIG, path)
    return path, hf, load_model(str(path), torch.float32, "cpu")


def write_mxfp4(path: Path) -> torch.nn.Module:
    """The tiny model with its experts replaced by random MXFP4 blocks and scales, in the layout of the
    openai/gpt-oss checkpoints, and quantization_config set as they set it; transformers loads it back
    dequantised (to fp32 here) as the reference."""
    save_random(CONFIG, path, seed=1)
    weights = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(2)
    for layer in range(CONFIG.num_hidden_layers):
        pre = f"model.layers.{layer}.mlp.experts."
        del weights[pre + "gate_up_proj"], weights[pre + "down_proj"]
        weights[pre + "gate_up_proj_blocks"] = torch.randint(0, 256, (E, 2 * INTER, H // 32, 16), generator=g, dtype=torch.uint8)
        weights[pre + "gate_up_proj_scales"] = torch.randint(119, 126, (E, 2 * INTER, H // 32), generator=g, dtype=torch.uint8)
        weights[pre + "down_proj_blocks"] = torch.randint(0, 256, (E, H, INTER // 32, 16), generator=g, dtype=torch.uint8)
        weights[pre + "down_proj_scales"] = torch.randint(119, 126, (E, H, INTER // 32), generator=g, dtype=torch.uint8)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
    }
    (path / "config.json").write_text(json.dumps(config))
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    hf = write_mxfp4(path)
    return path, hf, load_model(str(path), torch.float32, "cpu")


def test_window_and_sinks_are_wired(bf16_layout) -> None:  # noqa: ANN001
    _, _, ours = bf16_layout
    attns = [layer.self_attn.attn for layer in ours.model.model.layers]
    assert [a.sliding_window for a in attns] == [4, None]
    assert all(a.sinks is not None and a.sinks.shape == (4,) for a in attns)
    assert ours.max_model_len == 256  # the window is real now: no cap at 4 tokens


def test_prefill_and_decode_match_transformers(bf16_layout) -> None:  # noqa: ANN001
    _, hf, ours = bf16_layout
    torch.testing.assert_close(paged_logits(ours), hf_logits(hf), atol=1e-4, rtol=1e-4)


def test_engine_greedy_matches_transformers(bf16_layout) -> None:  # noqa: ANN001
    path, hf, ours = bf16_layout
    engine_greedy_matches(path, hf, ours)


def test_mxfp4_matches_transformers_dequantised_load(mxfp4) -> None:  # noqa: ANN001
    _, hf, ours = mxfp4
    experts = ours.model.model.layers[0].mlp.experts
    assert experts.w13_blocks.dtype == torch.uint8 and not hasattr(experts, "w13_weight")  # resident as stored
    ref_gate_up = hf.model.layers[0].mlp.experts.gate_up_proj[3]  # [H, 2I], gate/up interleaved
    ours_gate = dequant_mxfp4(experts.w13_blocks[3], experts.w13_scales[3], torch.float32)[:INTER]
    torch.testing.assert_close(ours_gate, ref_gate_up[:, 0::2].t(), atol=0, rtol=0)
    torch.testing.assert_close(paged_logits(ours), hf_logits(hf), atol=1e-4, rtol=1e-4)


def test_mixed_batch_with_windows_equals_each_sequence_alone(bf16_layout) -> None:  # noqa: ANN001
    """Padded rows, chunks after a cached prefix and decodes side by side, each past the 4-token window."""
    from model_harness import assert_mixed_batch_equals_alone

    _, _, ours = bf16_layout
    assert_mixed_batch_equals_alone(ours, PROMPT)
