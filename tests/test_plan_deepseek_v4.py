"""The planner counts DeepSeek-V4's cache as the engine lays it out: the profile's paged groups (compressed entries
and indexer keys per 4 tokens, HCA entries per 128 kept a slot per page) give the bytes a token that the engine's
pool allocates for a model of the profile's shape (transformers' DeepseekV4Config defaults, built on the meta
device), and its state bytes are the rings the engine allocates per sequence. The release (FP8 with FP4 experts)
is planned with its experts at MXFP4's 4.25 bits on either side of a split and FP8 for the rest."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DeepseekV4Config

from agentbox.config import GPU_PAGE_SIZE
from agentbox.hub.engine_support import engine_rejection
from agentbox.hub.plan import PlanConfig, plan
from agentbox.hub.profiles import find_profile
from agentbox.hub.weight_bytes import expert_resident_bytes, resident_weight_bytes
from agentbox.hw.probe import Probe
from agentbox.layers.backends.base import KVCache
from agentbox.layers.recurrent_state import StateCache
from agentbox.models.deepseek_v4 import DeepseekV4ForCausalLM

HW = Path(__file__).parents[1] / "profiles" / "hardware"


def test_profile_counts_what_the_engine_allocates() -> None:
    profile = find_profile("DeepSeek-V4-Flash")
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(DeepseekV4Config(architectures=["DeepseekV4ForCausalLM"]))
    layout = model.cache_layout()
    page = GPU_PAGE_SIZE
    per_page = KVCache.bytes_per_page(layout.kv_specs, page, torch.bfloat16, layout.tokens_per_entry)
    assert profile.kv_bytes_per_token(2) == per_page / page == 7872
    assert layout.state is not None
    assert profile.state_bytes == StateCache.bytes_per_slot(list(layout.state.specs), torch.bfloat16)
    assert profile.layers == len(model.layers) and profile.kv_replicated
    # the profile counts transformers' parameters: the routers' tables and biases are buffers there
    params = sum(p.numel() for n, p in model.named_parameters() if not n.endswith(("tid2eid", "gate.bias")))
    assert params == profile.params


def test_plan_shows_the_compressed_kv_arithmetic() -> None:
    profile = find_profile("DeepSeek-V4-Flash")
    p = plan(profile, Probe.load(HW / "1x-rtx5090.json"), PlanConfig(context=65536, sessions=2))
    for c in p.candidates:  # every rank keeps all of it: the KV term is per device whatever the tp
        assert c.kv_bytes == (7872 * 65536 + 4 * profile.state_bytes) * 2 and c.kv_replicated


def test_plan_on_1x_rtx_5090_with_128_gib_ram_choosing_experts_in_host_ram() -> None:
    """Issue 44: Q2_K / Q3_K experts stay quantised in host RAM on the CPU kernel (2.75 / 3.625 bits a weight), so a
    llama.cpp Q3_K_S or Q2_K file fits 128 GiB with the rest on one 5090, above the 8 tok/s floor. Q3_K_S (more
    bits) is chosen; Q2_K runs too; Q3_K_M's Q4_K downs (6 bits in the 4-bit kernel's form) miss RAM."""
    from typer.testing import CliRunner

    from agentbox.cli.main import app
    from agentbox.hub.weight_bytes import expert_resident_bytes
    from agentbox.hw.probe import GIB

    profile = find_profile("DeepSeek-V4-Flash")
    p = plan(profile, Probe.load(HW / "1x-rtx5090-128g.json"))
    c = p.chosen
    assert c is not None and c.variant.name == "q3_k_s" and c.tp == 1
    s = c.split
    assert s is not None and s.host_kernel and s.host_fits and c.gpu_fits and s.tok_s > 8 and not c.slow
    # the GPU dequantises Q2_K / Q3_K: the other 7.3B parameters and its layers of experts at bf16
    assert c.weights_bytes == (profile.params - profile.expert_params) * 2 + s.gpu_experts_bytes
    assert s.gpu_experts_bytes == profile.expert_params * 2 * (43 - s.in_ram) // 43
    by_name = {x.variant.name: x for x in p.candidates}
    bits = {"q3_k_s": 3.625, "q2_k": 2 / 3 * 2.75 + 1 / 3 * 3.625}  # the kernel form's bits a weight, by mix
    for name, per in bits.items():
        x = by_name[name]
        assert x.ok and x.split is not None and x.split.host_kernel
        cpu = expert_resident_bytes(profile, x.variant, "cpu")
        assert cpu == round(profile.expert_params * per / 8)
        assert x.split.host_bytes == cpu * x.split.in_ram // profile.moe_layers
        assert x.split.host_need <= 128 * GIB
    q3m = by_name["q3_k_m"]
    assert q3m.split is not None and not q3m.split.host_fits
    runner = CliRunner()
    out = runner.invoke(app, ["plan", "DeepSeek-V4-Flash", "--hardware", str(HW / "1x-rtx5090-128g.json")])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())  # the plan wraps at the terminal's width
    assert f"q3_k_s {c.variant.size / GIB:.1f} GiB tp 1" in text and "chosen" in text
    assert f"experts of {s.in_ram} of 43 MoE layers in RAM: {s.host_bytes / GIB:.1f} + 2.0 reserve" in text
    assert f"decode <= {s.tok_s:.1f} tok/s" in text and "above the 8 tok/s floor" in text
    assert "Q3_K experts stay quantised in host RAM only (the CPU kernel" in text


def test_the_release_is_planned_with_mxfp4_experts_and_fp8_elsewhere() -> None:
    profile = find_profile("DeepSeek-V4-Flash")
    v = next(v for v in profile.variants if v.name == "fp8")
    assert v.format == "fp8" and v.expert_format == "mxfp4" and engine_rejection(profile, v) is None
    experts = expert_resident_bytes(profile, v, "cuda")
    assert experts == profile.expert_params * 17 // 32 == expert_resident_bytes(profile, v, "cpu")  # 4.25 bits
    others = profile.params - profile.expert_params
    assert others < v.size - experts < 2 * others  # FP8 linears, bf16 tables (and the MTP layer the file carries)
    assert resident_weight_bytes(profile, v, "cuda") == v.size  # kept as stored on a GPU
    assert resident_weight_bytes(profile, v, "cpu") == experts + others * 4  # the rest dequantised to fp32 on a CPU
    p = plan(profile, Probe.load(HW / "2x-rtx5090-192g.json"), PlanConfig(context=32768, sessions=1))
    fp8 = next(c for c in p.candidates if c.variant.name == "fp8")
    assert fp8.ok and fp8.split is not None and fp8.split.host_bytes == fp8.split.in_ram * experts // profile.layers
    assert any(n.startswith("mxfp4 experts in RAM: no CPU expert kernel") for n in fp8.notes)


def test_the_issues_command_on_1x_rtx5090_json() -> None:
    """`agentbox plan DeepSeek-V4-Flash --hardware profiles/hardware/1x-rtx5090.json` (its description carries the
    128 GiB of RAM the issue plans for) chooses a variant with the experts in host RAM."""
    c = plan(find_profile("DeepSeek-V4-Flash"), Probe.load(HW / "1x-rtx5090.json")).chosen
    assert c is not None and c.split is not None and c.split.in_ram > 0 and c.split.host_kernel
