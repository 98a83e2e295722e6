"""The planner counts Nemotron-H's memory as the engine lays it out: KV per token for the 6 attention layers only, and
per session the 23 Mamba-2 layers' conv and SSM state (4 slots), the bytes the engine allocates for a model of the
profile's shape (Nemotron 3 Nano 30B-A3B's hybrid pattern on transformers' NemotronHConfig, built on the meta
device); its parameter counts are that model's. Its experts are un-gated relu^2 MLPs in FusedMoE layers, which every
expert method runs (tests/test_moe_ungated.py): a 4090 and a 5090 run the Q4_K_M GGUF with its experts quantised, the
bf16 release runs on a 4090 with 16 of its 23 MoE layers' experts in host RAM (ranked after the GGUF: no CPU kernel
for bf16 experts), the FP8 release is refused by name (1,856-wide experts are not whole 128-blocks), and one 80 GB
card runs bf16."""

from __future__ import annotations

import torch
from transformers import NemotronHConfig

from agentbox.config import GPU_PAGE_SIZE
from agentbox.hub.plan import PlanConfig, plan
from agentbox.hub.profiles import find_profile
from agentbox.hw.hardware import load_hardware
from agentbox.layers.backends.base import KVCache
from agentbox.layers.recurrent_state import StateCache
from agentbox.models.nemotron_h import NemotronHForCausalLM

PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"  # M Mamba-2, E MoE, * attention


def nano_config() -> NemotronHConfig:
    return NemotronHConfig(
        hybrid_override_pattern=PATTERN, hidden_size=2688, num_attention_heads=32, num_key_value_heads=2, head_dim=128,
        mamba_num_heads=64, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, chunk_size=128,
        n_routed_experts=128, num_experts_per_tok=6, moe_intermediate_size=1856,
        moe_shared_expert_intermediate_size=3712, vocab_size=131072, max_position_embeddings=262144,
        routed_scaling_factor=2.5, architectures=["NemotronHForCausalLM"],
    )


def test_profile_counts_what_the_engine_allocates() -> None:
    profile = find_profile("nemotron-3.5-lightning")
    with torch.device("meta"):
        model = NemotronHForCausalLM(nano_config())
    layout = model.cache_layout()
    page = GPU_PAGE_SIZE
    per_page = KVCache.bytes_per_page(layout.kv_specs, page, torch.bfloat16, layout.tokens_per_entry)
    assert profile.kv_bytes_per_token(2) == per_page / page == 6 * 2 * 2 * 128 * 2
    assert layout.state is not None
    assert profile.state_bytes == StateCache.bytes_per_slot(list(layout.state.specs), torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert (profile.params, profile.expert_params) == (params, experts)
    assert profile.active_params == params - experts + experts * 6 // 128
    assert profile.layers == len(model.backbone.layers)


def test_plan_runs_the_gguf_on_one_consumer_card() -> None:
    prof = find_profile("nemotron-3.5-lightning")
    assert (prof.moe_layers, prof.routed_share) == (23, 6 / 128)
    for hw in ("1x-rtx4090", "1x-rtx5090"):
        p = plan(prof, load_hardware(hw), PlanConfig(context=32768))
        assert p.chosen is not None and p.chosen.variant.name == "q4_k_m" and p.chosen.split is None, hw
        assert p.chosen.kv_bytes == 6144 * 32768 + 4 * prof.state_bytes
        assert 19.6 < p.chosen.weights_bytes / 2**30 < 19.8  # the experts stay quantised
        fp8 = next(c for c in p.candidates if c.variant.name == "fp8")
        assert not fp8.ok and "FP8 block-128" in " ".join(fp8.reasons)
    four = plan(prof, load_hardware("1x-rtx4090"), PlanConfig(context=32768))
    bf16 = next(c for c in four.candidates if c.variant.name == "bf16")
    assert bf16.ok and bf16.slow and bf16.split is not None and bf16.split.in_ram == 16
    gpu_only = plan(prof, load_hardware("1x-rtx4090"), PlanConfig(context=32768, experts_in_ram=False))
    assert "does not fit" in " ".join(next(c for c in gpu_only.candidates if c.variant.name == "bf16").reasons)
    h100 = plan(prof, load_hardware("1x-h100"), PlanConfig(context=32768)).chosen
    assert h100 is not None and h100.variant.name == "bf16"
    assert h100.kv_bytes == 6144 * 32768 + 4 * prof.state_bytes
