"""The planner counts DeepSeek-V4's cache as the engine lays it out: the profile's paged groups (compressed entries
and indexer keys per 4 tokens, HCA entries per 128 kept a slot per page) give the bytes a token that the engine's
pool allocates for a model of the profile's shape (transformers' DeepseekV4Config defaults, built on the meta
device), and its state bytes are the rings the engine allocates per sequence."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import DeepseekV4Config

from agentbox.config import EngineConfig
from agentbox.hub.plan import PlanConfig, plan
from agentbox.hub.profiles import find_profile
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
    page = EngineConfig.page_size
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
