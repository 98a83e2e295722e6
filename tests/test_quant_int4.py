"""AWQ (AutoAWQ GEMM), GPTQ (sym / asym, act-order) and compressed-tensors W4A16 (pack-quantized) int4
checkpoints quantised by the test, loaded by our loader, against transformers running the dequantised twin."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_harness import PagedRunner
from quant_checkpoints import PROMPT, write_int4

from agentbox.layers.quant import QuantMethod, resident_weight_bytes
from agentbox.layers.quant.int4 import Int4Kernel
from agentbox.models.loader import load_model

CASES = {
    "awq": dict(method="awq"),
    "gptq-sym": dict(method="gptq", sym=True),
    "gptq-asym": dict(method="gptq", sym=False),
    "gptq-act-order": dict(method="gptq", sym=False, act_order=True),
    "w4a16-sym": dict(method="compressed-tensors", sym=True),
    "w4a16-asym-act-order": dict(method="compressed-tensors", sym=False, act_order=True),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.usefixtures("exact_cpu_kernels")
def test_int4_checkpoint_matches_the_dequantised_twin(case: str, tmp_path: Path) -> None:
    hf = write_int4(tmp_path, **CASES[case])  # type: ignore[arg-type]
    ours = load_model(str(tmp_path), torch.float32, "cpu")
    qkv = ours.model.model.layers[0].self_attn.qkv_proj
    assert qkv.quant_method.kind is QuantMethod(CASES[case]["method"])
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(PagedRunner(ours).step({0: PROMPT})[0], expected, atol=1e-4, rtol=1e-4)
    ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert PagedRunner(ours).greedy(0, PROMPT, 8) == ref[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("case", ["awq", "gptq-act-order", "w4a16-asym-act-order"])
def test_int4_cpu_kernel_keeps_weights_4bit(case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentbox.layers.quant import int4

    hf = write_int4(tmp_path, **CASES[case])  # type: ignore[arg-type]
    monkeypatch.setattr(int4, "default_cpu_kernel", lambda: Int4Kernel.INT4_CPU)
    ours = load_model(str(tmp_path), torch.float32, "cpu")
    layers = [m for m in ours.model.modules() if getattr(m, "int4_kernel", None) is Int4Kernel.INT4_CPU]
    assert len(layers) == 8  # qkv, o, gate_up, down in each of 2 layers
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0]
    got = PagedRunner(ours).step({0: PROMPT})[0]
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)  # bf16 activations and scales
    # the file's quantised bytes: 4-bit codes + fp16 scale + 4-bit zero per group of 128 (g_idx, 4 B per input row, is left out)
    params = sum(p.numel() for n, p in hf.named_parameters() if n.endswith("_proj.weight"))
    file_bytes = params // 2 + params // 128 * (2 + 0.5)
    got_bytes = sum(resident_weight_bytes(m) for m in layers) - sum(
        m.bias.numel() * 4 for m in layers if m.bias is not None
    )
    assert abs(got_bytes - file_bytes) <= 0.1 * file_bytes, (got_bytes, file_bytes)


@pytest.mark.usefixtures("exact_cpu_kernels")
def test_the_engine_serves_a_gptq_checkpoint(tmp_path: Path) -> None:
    from agentbox.config import EngineConfig
    from agentbox.engine.llm import LLM

    hf = write_int4(tmp_path, "gptq", sym=True)
    # an fp32 pool: transformers' logits to 1e-4 (the default fp16 CPU pool rounds keys and values: ~1e-3)
    llm = LLM(EngineConfig(model=str(tmp_path), device="cpu", num_pages=16, kv_dtype="float32"))
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(llm.logits(PROMPT), expected, atol=1e-4, rtol=1e-4)


def test_compressed_tensors_schemes_other_than_w4a16_are_refused_by_field() -> None:
    from quant_checkpoints import compressed_tensors_config
    from transformers import Qwen2Config

    from agentbox.layers.quant import QuantConfig

    def refused(change: dict[str, object], match: str) -> None:
        qc = compressed_tensors_config(128, True, False)
        group = qc["config_groups"]["group_0"]  # type: ignore[index]
        for key, value in change.items():
            if key.startswith("weights."):
                group["weights"][key.removeprefix("weights.")] = value
            elif key in ("targets", "input_activations"):
                group[key] = value
            else:
                qc[key] = value
        if "format" in change:
            group["format"] = change["format"]
        with pytest.raises(ValueError, match=match):
            QuantConfig.of(Qwen2Config(quantization_config=qc))

    got = QuantConfig.of(Qwen2Config(quantization_config=compressed_tensors_config(64, False, True)))
    assert (got.method, got.group_size, got.sym, got.desc_act) == (QuantMethod.COMPRESSED_TENSORS, 64, False, True)
    refused({"format": "float-quantized"}, r"config_groups.group_0.format 'float-quantized'")
    refused({"weights.num_bits": 8}, r"group_0.weights: 8-bit int is not supported")
    refused({"weights.strategy": "channel"}, r"weights.strategy 'channel'")
    refused({"input_activations": {"num_bits": 8}}, r"input_activations")
    refused({"targets": ["re:.*q_proj"]}, r"targets")
    refused({"ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}, r"ignore: only lm_head")
    refused({"sparsity_config": {"format": "sparse-24-bitmask"}}, r"sparsity_config.format")
