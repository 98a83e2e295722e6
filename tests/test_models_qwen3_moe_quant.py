"""Qwen3-MoE from quantised safetensors releases: a tiny random Qwen3MoeForCausalLM quantised by the test
into the FP8 block-128 (Qwen3-*-FP8), AWQ (AutoAWQ GEMM) and GPTQ v1 (sym, act-order) layouts, per-expert
tensors named as released, loaded by our loader; logits and greedy tokens match transformers running the
dequantised twin, the experts stay quantised in memory, and tp 2 over gloo matches too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_harness import DECODE, PROMPT, engine_greedy_matches, hf_logits, paged_logits, save_random, tp_logits
from quant_checkpoints import quantise_saved
from safetensors import safe_open
from test_models_qwen3_moe import TINY_MOE
from transformers import Qwen3MoeConfig

from agentbox.layers.experts import FusedMoE
from agentbox.layers.experts.awq import AwqExperts
from agentbox.layers.experts.fp8 import Fp8BlockExperts
from agentbox.layers.experts.gptq import GptqExperts
from agentbox.layers.quant import int4, resident_weight_bytes
from agentbox.models.loader import load_model

# The dense linears of these checkpoints are quantised too: the exact CPU path (see exact_cpu_kernels).
pytestmark = pytest.mark.usefixtures("exact_cpu_kernels")

# Every quantised dim whole blocks of 128 (FP8) and groups of 128 (int4), also per rank at tp 2.
CONFIG = Qwen3MoeConfig(
    **{**TINY_MOE, "hidden_size": 256, "head_dim": 128, "intermediate_size": 512, "moe_intermediate_size": 256,
       "num_hidden_layers": 2, "num_experts": 4},
    norm_topk_prob=True, mlp_only_layers=[1],
)
FORMATS = {
    "fp8": (dict(fmt="fp8"), Fp8BlockExperts),
    "awq": (dict(fmt="awq"), AwqExperts),
    "gptq-sym": (dict(fmt="gptq", sym=True), GptqExperts),
    "gptq-act-order": (dict(fmt="gptq", act_order=True), GptqExperts),
}


def write(path: Path, case: str) -> torch.nn.Module:
    save_random(CONFIG, path)
    return quantise_saved(path, **FORMATS[case][0])  # type: ignore[arg-type]


@pytest.fixture(scope="module", params=list(FORMATS))
def quantised(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("moe") / request.param
    twin = write(path, request.param)
    with int4.cpu_kernel(int4.Int4Kernel.DENSE):  # module-scoped: outside the exact_cpu_kernels fixture
        return request.param, path, twin, load_model(str(path), torch.float32, "cpu")


def test_logits_and_greedy_tokens_match_the_dequantised_twin(quantised) -> None:  # noqa: ANN001
    case, path, twin, ours = quantised
    experts = [m for m in ours.model.modules() if isinstance(m, FusedMoE)]
    assert len(experts) == 1 and isinstance(experts[0].method, FORMATS[case][1])
    torch.testing.assert_close(paged_logits(ours), hf_logits(twin), atol=1e-4, rtol=1e-4)
    engine_greedy_matches(path, twin, ours)


def test_experts_stay_quantised_in_memory(quantised) -> None:  # noqa: ANN001
    case, path, _, ours = quantised
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        file_bytes = sum(
            f.get_tensor(n).untyped_storage().nbytes() for n in f.keys() if ".mlp.experts." in n
        )
    moe = next(m for m in ours.model.modules() if isinstance(m, FusedMoE))
    got = resident_weight_bytes(moe)
    print(f"{case}: experts resident {got} B, file {file_bytes} B ({got / file_bytes:.3f}x)")
    assert abs(got - file_bytes) <= 0.1 * file_bytes, (case, got, file_bytes)
    if case == "fp8":
        assert moe.w13_weight.dtype is torch.float8_e4m3fn
    else:
        assert moe.w13_qweight.dtype is torch.int32 and moe.int4_group == 128


@pytest.mark.slow
def test_tensor_parallel_2_matches_the_dequantised_twin(tmp_path: Path) -> None:
    cases = ["fp8", "awq", "gptq-sym"]  # act-order is refused at tp 2 when a down shard splits groups
    expected = [hf_logits(write(tmp_path / c, c)) for c in cases]
    for case, want, ranks in zip(cases, expected, tp_logits([tmp_path / c for c in cases]), strict=True):
        for got in ranks:
            assert got.shape[0] == len(PROMPT) + len(DECODE)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=lambda m, c=case: f"{c}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", list(FORMATS))
def test_quantised_experts_on_cuda_in_bf16_match_the_fp32_twin(case: str, tmp_path: Path) -> None:
    """On CUDA the experts run the fused Triton kernels where this build has them (not act-order), else
    the torch reference; either way bf16 logits match transformers' fp32 run of the dequantised twin."""
    from model_harness import PagedRunner
    from test_gpu import _assert_close_bf16

    twin = write(tmp_path / case, case)
    ours = load_model(str(tmp_path / case), torch.bfloat16, "cuda")
    with torch.no_grad():
        expected = twin(torch.tensor([PROMPT])).logits[0]
    _assert_close_bf16(PagedRunner(ours, device="cuda").step({0: PROMPT})[0].cpu(), expected)
