"""The planner counts GLM-5.3-Flash's cache as the engine lays it out: the profile's paged group (each indexed
layer's latent and each indexer's per-token entries) gives the bytes a token that the engine's pool allocates for a
model of the profile's shape (transformers' Glm5NextConfig defaults, built on the meta device), and its state
bytes are the KDA layers' state the engine allocates per sequence.

What main's planner can do: it counts every routed expert resident on the GPU (experts in host RAM, how users run
this model, is planned on the cpu-moe branch), so on two RTX 5090s no variant fits, and the plan says why with
the cache arithmetic, indexer included."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Glm5NextConfig

from agentbox.config import EngineConfig
from agentbox.hub.plan import PlanConfig, plan
from agentbox.hub.profiles import find_profile
from agentbox.hw.probe import Probe
from agentbox.layers.backends.base import KVCache
from agentbox.layers.recurrent_state import StateCache
from agentbox.models.glm5_next import Glm5NextForConditionalGeneration

HW = Path(__file__).parents[1] / "profiles" / "hardware"


def test_profile_counts_what_the_engine_allocates() -> None:
    profile = find_profile("GLM-5.3-Flash")
    with torch.device("meta"):
        model = Glm5NextForConditionalGeneration(Glm5NextConfig(architectures=["Glm5NextForConditionalGeneration"]))
    layout = model.cache_layout()
    page = EngineConfig.page_size
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
    # every expert counted on the GPUs: 313B parameters fit no variant on 2 x 32 GB (experts in RAM: cpu-moe branch)
    assert not [c for c in p.candidates if c.device == "cuda" and not c.reasons]
