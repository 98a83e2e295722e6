"""The planner counts GLM-5.3-Flash's cache as the engine lays it out: the profile's paged group (each indexed
layer's latent and each indexer's per-token entries) gives the bytes a token that the engine's pool allocates for a
model of the profile's shape (transformers' Glm5NextConfig defaults, built on the meta device), and its state
bytes are the KDA layers' state the engine allocates per sequence.

Users run this model with its routed experts in host RAM. Only NVFP4's run there on a CPU kernel
(kernels/cpu_nvfp4.c; bf16's and FP8's would be dequantised per step, and need 569 / 272 GiB of RAM): on two RTX
5090s with 192 GiB the plan chooses the (estimated) NVFP4 variant with 40 of 42 MoE layers' experts in RAM at 32k,
and shows the arithmetic, the indexer's cache included; with 128 GiB nothing fits, and the plan says why."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Glm5NextConfig

from agentbox.config import GPU_PAGE_SIZE
from agentbox.hub.plan import PlanConfig, plan
from agentbox.hub.profiles import find_profile
from agentbox.hw.probe import Probe
from agentbox.layers.backends.base import KVCache
from agentbox.layers.quant.formats import NVFP4_BYTES
from agentbox.layers.recurrent_state import StateCache
from agentbox.models.glm5_next import Glm5NextForConditionalGeneration

HW = Path(__file__).parents[1] / "profiles" / "hardware"


def test_profile_counts_what_the_engine_allocates() -> None:
    profile = find_profile("GLM-5.3-Flash")
    with torch.device("meta"):
        model = Glm5NextForConditionalGeneration(Glm5NextConfig(architectures=["Glm5NextForConditionalGeneration"]))
    layout = model.cache_layout()
    page = GPU_PAGE_SIZE
    per_page = KVCache.bytes_per_page(layout.kv_specs, page, torch.bfloat16, layout.tokens_per_entry)
    # 11 latents of 512 and 11 indexer entries of 2 x 128, bf16
    assert profile.kv_bytes_per_token(2) == per_page / page == 11 * (512 + 256) * 2
    assert layout.state is not None and len(layout.state.specs) == 34
    assert profile.state_bytes == StateCache.bytes_per_slot(list(layout.state.specs), torch.bfloat16)
    assert profile.layers == len(model.language_model.layers) and profile.kv_replicated
    assert sum(p.numel() for p in model.parameters()) == profile.params
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and "shared" not in n)
    assert experts == profile.expert_params


def test_plan_shows_the_kv_arithmetic_with_the_indexer() -> None:
    profile = find_profile("GLM-5.3-Flash")
    p = plan(profile, Probe.load(HW / "2x-rtx5090.json"), PlanConfig(context=32768, sessions=2))
    assert p.candidates
    for c in p.candidates:  # every rank keeps all of it: the KV term is per device whatever the tp
        assert c.kv_bytes == (16896 * 32768 + 4 * profile.state_bytes) * 2 and c.kv_replicated
    # 128 GiB of RAM: NVFP4's experts (159 GiB) do not fit it, the others are larger still
    assert not [c for c in p.candidates if c.device == "cuda" and not c.reasons]
    nvfp4 = next(c for c in p.candidates if c.variant.name == "nvfp4")
    assert any(r.startswith("does not fit: the experts in RAM need") for r in nvfp4.reasons)


def test_two_5090s_with_192g_run_nvfp4_with_the_experts_in_ram_at_32k() -> None:
    profile = find_profile("GLM-5.3-Flash")
    p = plan(profile, Probe.load(HW / "2x-rtx5090-192g.json"), PlanConfig(context=32768))
    c = p.chosen
    assert c is not None and c.variant.name == "nvfp4" and c.split is not None and c.ok
    s = c.split
    # the CPU kernel runs NVFP4's experts: a bandwidth bound, above the floor
    assert s.host_kernel and not c.slow and s.tok_s > 8 and s.moe_layers == 42
    experts = round(profile.expert_params * NVFP4_BYTES)  # 4.5 bits in RAM as on the GPU
    assert s.host_bytes == experts * s.in_ram // 42 and s.host_fits
    assert s.ram_step_bytes == round(s.host_bytes * profile.routed_share)
    assert abs(profile.routed_share - 8 / 288) < 1e-3
    # the GPU keeps the rest (bf16 in the estimate) and the experts of the layers left, the cache beside them
    assert c.weights_bytes == profile.variant("nvfp4").size - experts + experts * (42 - s.in_ram) // 42
    assert c.kv_bytes == 11 * (512 + 256) * 2 * 32768 + 4 * profile.state_bytes
    assert c.need_per_device <= c.available_bytes
    # one layer fewer in RAM does not fit the card
    assert c.weights_bytes + experts // 42 + c.kv_bytes + c.reserve_bytes > c.available_bytes
    # bf16's and fp8's experts have no CPU kernel and more bytes than the RAM
    for name in ("bf16", "fp8"):
        other = next(x for x in p.candidates if x.variant.name == name)
        assert other.split is not None and not other.split.host_kernel and not other.split.host_fits


def test_the_plan_command_shows_the_split_and_the_indexers_cache() -> None:
    from typer.testing import CliRunner

    from agentbox.cli.main import app

    out = CliRunner().invoke(app, ["plan", "GLM-5.3-Flash", "--hardware", str(HW / "2x-rtx5090-192g.json"),
                                   "--context", "32768"])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())  # undo the 80-column wraps
    assert "KV 16 KiB/token = (11 layers x 512 / 1 tokens + 11 layers x 256 / 1 tokens) x 2 bytes" in text
    assert "experts of 40 of 42 MoE layers in RAM: 151.9 + 2.0 reserve = 153.9 GiB <= 192.0 GiB of RAM" in text
    assert "decode <= 10.6 tok/s: 4.53 GB experts / 54 GB/s RAM" in text and "above the 8 tok/s floor" in text
    assert "plan: GLM-5.3-Flash:nvfp4 at tp=1 with --n-cpu-moe 40" in text
