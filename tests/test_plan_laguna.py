"""The planner counts Laguna XS.2's memory as the engine lays it out: KV per token for the 10 global layers only
(8 KV heads x 128), and per session the 30 sliding layers' rings (512 positions + a page of slack), the bytes the
engine allocates for a model of the profile's shape (XS.2's per-layer heads and layer pattern on transformers'
LagunaConfig, built on the meta device); its parameter counts are that model's. On a 4090 the Q4_K_M GGUF (the
laguna GGUF family, models/gguf_laguna.py) is chosen at 16k tokens and the longest context that fits is named at
32k; a 5090 runs it at 32k."""

from __future__ import annotations

import torch
from transformers import LagunaConfig

from agentbox.config import GPU_PAGE_SIZE
from agentbox.hub.plan import PlanConfig, plan
from agentbox.hub.profiles import find_profile
from agentbox.hw.hardware import load_hardware
from agentbox.layers.backends.base import KVCache
from agentbox.layers.recurrent_state import StateCache
from agentbox.layers.window_kv import page_slack
from agentbox.models.laguna import LagunaForCausalLM

GLOBAL, SLIDING = "full_attention", "sliding_attention"


def xs2_config() -> LagunaConfig:
    """XS.2 as llama.cpp's Laguna reads it: a global layer (48 heads) every 4, the others sliding (64 heads)."""
    return LagunaConfig(
        num_attention_heads_per_layer=[48 if i % 4 == 0 else 64 for i in range(40)],
        layer_types=[GLOBAL if i % 4 == 0 else SLIDING for i in range(40)], architectures=["LagunaForCausalLM"],
    )


def test_profile_counts_what_the_engine_allocates() -> None:
    profile = find_profile("laguna-xs2")
    with torch.device("meta"):
        model = LagunaForCausalLM(xs2_config())
    layout = model.cache_layout()
    page = GPU_PAGE_SIZE
    per_page = KVCache.bytes_per_page(layout.kv_specs, page, torch.bfloat16, layout.tokens_per_entry)
    assert profile.kv_bytes_per_token(2) == per_page / page == 2 * 10 * 8 * 128 * 2
    assert layout.state is not None
    rings = page_slack(list(layout.state.specs), page)  # what the runner allocates: the window and a page
    assert rings is not None and profile.state_bytes == StateCache.bytes_per_slot(rings, torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert (profile.params, profile.expert_params) == (params, experts)
    assert profile.active_params == params - experts + experts * 8 // 256
    assert profile.layers == len(model.model.layers)


def test_plan_picks_the_gguf_on_one_card() -> None:
    prof = find_profile("laguna-xs2")
    at16k = plan(prof, load_hardware("1x-rtx4090"), PlanConfig(context=16384))
    assert at16k.chosen is not None and at16k.chosen.variant.name == "q4_k_m"
    assert at16k.chosen.kv_bytes == 40960 * 16384 + 2 * prof.state_bytes
    gpu_only = plan(prof, load_hardware("1x-rtx4090"), PlanConfig(context=32768, experts_in_ram=False))
    q4 = next(c for c in gpu_only.candidates if c.variant.name == "q4_k_m")
    assert gpu_only.chosen is None and not q4.ok
    assert "fits at tp=1 up to 19,456 tokens of context (--context 19456)" in q4.notes
    # at 32k it runs with some layers' experts in host RAM (hub/offload.py), Laguna's experts being FusedMoE's
    at32k = plan(prof, load_hardware("1x-rtx4090"), PlanConfig(context=32768)).chosen
    assert at32k is not None and at32k.variant.name == "q4_k_m" and at32k.split is not None and at32k.split.in_ram > 0
    five = plan(prof, load_hardware("1x-rtx5090"), PlanConfig(context=32768)).chosen
    assert five is not None and five.variant.name == "q4_k_m"
