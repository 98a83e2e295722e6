"""Routed experts in host RAM (`serve --cpu-moe` / `--n-cpu-moe N`, layers/experts/placement.py): the loader
decides per MoE layer, the layer runs its experts on the host, and the model computes what it computes
without the flags (parity: the same logits, the same greedy tokens) for a tiny Qwen3-MoE GGUF (quantised
experts on the CPU kernels), gpt-oss (bf16 and MXFP4 experts, biases), GLM-4.7-Flash (grouped routing, shared
expert) and DeepSeek-V4 (hash-routed and scored MoE layers). /v1/stats's `experts` reports where they live
and the host experts' time per step from the clock around their compute. On a GPU: tests/test_cpu_moe_gpu.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepseek_v4_models import save_deepseek_v4
from glm_models import save_glm, tiny_config
from moe_harness import PROMPT, hf_logits, paged_logits, save_random
from test_gguf_moe import _experts, twin, write_qwen3moe
from test_models_gpt_oss import CONFIG as GPT_OSS
from test_models_gpt_oss import write_mxfp4

from agentbox.config import EngineConfig
from agentbox.engine.llm import LLM
from agentbox.engine.sampling import SamplingParams
from agentbox.engine.stats import to_json
from agentbox.kernels import cpu_gemv
from agentbox.layers.experts import FusedMoE
from agentbox.layers.experts.cpu import CpuExperts
from agentbox.layers.experts.placement import ALL_LAYERS, ExpertHome, ExpertPlacement
from agentbox.models.loader import host_expert_bytes, load_model


def homes(loaded) -> list[ExpertHome]:  # noqa: ANN001 - LoadedModel
    return [m.home for m in loaded.model.modules() if isinstance(m, FusedMoE)]


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("cpu-moe") / "tiny.gguf"
    return path, twin(write_qwen3moe(path))


def test_the_loader_places_the_first_n_layers_on_the_host(qwen3moe) -> None:  # noqa: ANN001
    path, _ = qwen3moe
    none = load_model(str(path), torch.float32, "cpu", ExpertPlacement.of(False, 0))
    two = load_model(str(path), torch.float32, "cpu", ExpertPlacement.of(False, 2))
    every = load_model(str(path), torch.float32, "cpu", ExpertPlacement.of(True, 0))
    assert homes(none) == [ExpertHome.DEVICE] * 5 and host_expert_bytes(none.model) == 0
    assert homes(two) == [ExpertHome.HOST] * 2 + [ExpertHome.DEVICE] * 3
    assert homes(every) == [ExpertHome.HOST] * 5 and every.placement is not None
    assert every.placement.host_layers == ALL_LAYERS and every.placement.num_host == 5
    # what lives on the host is the experts' whole weight (router and attention stay with the model)
    assert host_expert_bytes(every.model) == sum(p.numel() * p.element_size() for m in _experts(every)
                                                 for p in m.parameters())
    assert 0 < host_expert_bytes(two.model) < host_expert_bytes(every.model)
    if cpu_gemv.available():  # quantised experts on the host run the CPU kernels
        assert all(isinstance(m.method, CpuExperts) for m in _experts(every))
    with pytest.raises(ValueError, match="n_cpu_moe"):
        ExpertPlacement.of(False, -1)


def test_qwen3moe_gguf_with_cpu_moe_equals_without(qwen3moe) -> None:  # noqa: ANN001
    path, _ = qwen3moe
    plain = paged_logits(load_model(str(path), torch.float32, "cpu"))
    for placement in (ExpertPlacement.of(True, 0), ExpertPlacement.of(False, 3)):
        loaded = load_model(str(path), torch.float32, "cpu", placement)
        torch.testing.assert_close(paged_logits(loaded), plain, atol=1e-5, rtol=1e-5)
        assert placement.clock.calls > 0 and placement.clock.seconds > 0  # the host layers ran, timed


def test_host_experts_of_a_bf16_model_keep_float32_scales(qwen3moe) -> None:  # noqa: ANN001
    """A bf16 model (what a GPU runs) with its experts on the host: the hidden state crosses in bf16, the host
    experts compute in float32 with the file's scales unrounded, the output comes back in bf16."""
    path, hf = qwen3moe
    loaded = load_model(str(path), torch.bfloat16, "cpu", ExpertPlacement.of(True, 0))
    layers = _experts(loaded)
    assert all(m.host_dtype is torch.float32 for m in layers)
    if cpu_gemv.available():
        assert all(isinstance(m.method, CpuExperts) for m in layers)
    x = torch.randn(3, layers[0].hidden_size, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.rand(3, 2)
    out = layers[0].forward_routed(x, weights, ids)
    assert out.dtype is torch.bfloat16 and out.shape == x.shape
    # The host computes in float32 with the file's scales: a float32 model's host experts on the same input, rounded
    # to bf16 once on the way back.
    fp32 = _experts(load_model(str(path), torch.float32, "cpu", ExpertPlacement.of(True, 0)))[0]
    assert torch.equal(out, fp32.forward_routed(x.float(), weights, ids).to(torch.bfloat16))
    expected = hf_logits(hf)
    got = paged_logits(loaded).float()
    # bf16 attention and dense layers against the fp32 twin: close at most positions (torch's bf16 products differ
    # by ISA: one position of this random model is off by 11 % of the largest logit on an AVX2 EPYC), the same
    # argmax wherever it is decided.
    scale = expected.abs().max()
    assert ((got - expected).abs().amax(-1) / scale).median() < 0.05
    top2 = expected.topk(2, dim=-1).values
    decided = top2[..., 0] - top2[..., 1] > 0.03 * scale
    assert decided.sum() >= 4 and torch.equal(got.argmax(-1)[decided], expected.argmax(-1)[decided])


def test_engine_greedy_tokens_and_stats_with_cpu_moe(qwen3moe) -> None:  # noqa: ANN001
    path, _ = qwen3moe
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    base = EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch")
    with LLM(base) as plain:
        want = plain.generate([PROMPT], params)[0].token_ids
        off = to_json(plain.core.stats())["experts"]
    assert off["moe_layers"] == 5 and off["host_layers"] == 0 and off["host_bytes"] == 0
    with LLM(EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch", cpu_moe=True)) as llm:
        assert llm.generate([PROMPT], params)[0].token_ids == want
        stats = to_json(llm.core.stats())["experts"]
    assert stats["moe_layers"] == 5 and stats["host_layers"] == 5 and stats["device"] == "cpu"
    assert stats["host_bytes"] == host_expert_bytes(llm.loaded.model) > 0
    assert stats["steps"] >= 8 and stats["cpu_expert_ms_per_step"] > 0 and stats["last_cpu_expert_ms"] > 0
    assert 0 < stats["cpu_expert_share"] <= 1 and stats["last_cpu_expert_ms"] <= stats["last_step_ms"]
    if cpu_gemv.available():
        assert stats["host_method"] == "CpuExperts"


def _parity(path: Path, expected: torch.Tensor, atol: float) -> None:
    plain = paged_logits(load_model(str(path), torch.float32, "cpu"))
    placement = ExpertPlacement.of(True, 0)
    host = load_model(str(path), torch.float32, "cpu", placement)
    assert homes(host) and all(h is ExpertHome.HOST for h in homes(host))
    got = paged_logits(host)
    torch.testing.assert_close(got, plain, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, expected, atol=atol, rtol=atol)
    assert placement.clock.calls > 0


def test_gpt_oss_bf16_and_mxfp4_experts_with_cpu_moe(tmp_path: Path) -> None:
    hf = save_random(GPT_OSS, tmp_path / "bf16")
    _parity(tmp_path / "bf16", hf_logits(hf), 2e-4)
    mx = write_mxfp4(tmp_path / "mxfp4")
    _parity(tmp_path / "mxfp4", hf_logits(mx), 2e-4)


def test_glm_4_7_flash_with_cpu_moe(tmp_path: Path) -> None:
    hf = save_glm(tiny_config(), tmp_path)
    _parity(tmp_path, hf_logits(hf), 2e-4)


def test_deepseek_v4_with_cpu_moe(tmp_path: Path) -> None:
    save_deepseek_v4(tmp_path)
    plain = paged_logits(load_model(str(tmp_path), torch.float32, "cpu"), page_size=8)
    placement = ExpertPlacement.of(True, 0)
    host = load_model(str(tmp_path), torch.float32, "cpu", placement)
    assert len(homes(host)) == 4 and all(h is ExpertHome.HOST for h in homes(host))
    torch.testing.assert_close(paged_logits(host, page_size=8), plain, atol=1e-5, rtol=1e-5)
    assert placement.clock.calls > 0


def test_top_shows_where_the_experts_live_and_their_time(qwen3moe) -> None:  # noqa: ANN001
    """`agentbox top` renders /v1/stats' `experts` (the engine's own stats, as the server serves them)."""
    from rich.console import Console

    from agentbox.tui.panels import experts_line, machine_panel

    path, _ = qwen3moe
    config = EngineConfig(model=str(path), num_pages=64, page_size=4, attention="torch", n_cpu_moe=2)
    with LLM(config) as llm:
        llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        stats = to_json(llm.core.stats())
    line = experts_line(stats["experts"])
    assert line is not None
    text = line.plain
    assert text.startswith("experts of 2 of 5 MoE layers in host RAM (") and "the rest on the CPU" in text
    assert "CPU experts " in text and " ms a step, " in text and "% of it (last " in text
    console = Console(width=100, record=True)
    console.print(machine_panel({"stats": stats, "local": None}))
    assert "experts of 2 of 5 MoE layers in host RAM" in console.export_text()
    assert experts_line({"moe_layers": 0}) is None  # a dense model: no line
    assert experts_line({"moe_layers": 4, "device": "cuda"}).plain == "experts of all 4 MoE layers on the GPU"  # type: ignore[union-attr]


def test_the_gpu_blocks_code_runs_on_cpu(qwen3moe) -> None:  # noqa: ANN001
    """agentbox/bench/gpu_cpu_moe.py, which scripts/gpu_check.sh runs on a GPU, dry-run here: both sides are the
    CPU, so the tokens and logits are identical and the decode block reports the host experts' share."""
    from agentbox.bench.gpu_cpu_moe import decode, parity

    got = parity("cpu", torch.float32, new_tokens=6)
    assert got["identical_tokens"] and got["max_abs_diff"] == 0.0 and got["host_layers"] == got["moe_layers"] == 3
    assert got["cuda_graphs"] == {"device": False, "host": False}
    path, _ = qwen3moe
    d = decode(str(path), "cpu", prompt_len=16, new_tokens=4)
    host, base = d["cpu_moe"], d["experts_on_device"]
    assert host["host_layers"] == 5 and base["host_layers"] == 0 and host["decode_tok_s"] > 0
    assert 0 < host["decode_step_cpu_share"] <= 1 and host["cpu_expert_ms_per_step"] > 0
