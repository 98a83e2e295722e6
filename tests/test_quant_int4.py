"""AWQ (AutoAWQ GEMM) and GPTQ (sym / asym, act-order) int4 checkpoints quantised by the test, loaded by our
loader, against transformers running the dequantised twin."""

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


@pytest.mark.parametrize("case", ["awq", "gptq-act-order"])
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
    llm = LLM(EngineConfig(model=str(tmp_path), device="cpu", num_pages=16))
    with torch.no_grad():
        expected = hf(torch.tensor([PROMPT])).logits[0, -1]
    torch.testing.assert_close(llm.logits(PROMPT), expected, atol=1e-4, rtol=1e-4)
