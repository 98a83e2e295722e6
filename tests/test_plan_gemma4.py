"""The planner counts Gemma 4's memory by layer kind: KV per token for the global layers only (4 KV heads x 512
for the 31B) and the sliding layers' rings (1,024 positions + a page of slack) per session: the live ring and
one snapshot, what the runner allocates per running request. GGUF gemma4 files load (models/gguf_gemma4.py): on
a 4090 the 26B-A4B's UD-Q4_K_XL is chosen (its experts stay quantised), and the 31B's at
32k tokens with its running ring on the card and its snapshot in host memory; a 5090 runs it. The 12B's profile
(`gemma4_unified`, an estimated shape: profiles/gemma-4-12b.toml) counts what the engine allocates for a model of
that shape, and a 4090 runs its Q8_0 GGUF with room to spare."""

from __future__ import annotations

import torch
from transformers import Gemma4UnifiedConfig

from agentbox.config import GPU_PAGE_SIZE
from agentbox.hub.plan import PlanConfig, plan
from agentbox.hub.profiles import find_profile
from agentbox.hw.hardware import load_hardware
from agentbox.layers.backends.base import KVCache
from agentbox.layers.recurrent_state import StateCache
from agentbox.layers.window_kv import page_slack
from agentbox.models.gemma4 import Gemma4UnifiedForConditionalGeneration

# the 12B's estimated text shape (profiles/gemma-4-12b.toml); the rest is Gemma4UnifiedTextConfig's defaults
GEMMA4_12B = dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                  num_key_value_heads=8, num_global_key_value_heads=2, attention_k_eq_v=True,
                  final_logit_softcapping=30.0)


def test_gemma4_kv_per_layer_kind() -> None:
    prof = find_profile("gemma-4-31b")
    global_per_token = 2 * 10 * 4 * 512 * 2
    ring = 2 * 50 * (1024 + 16) * 16 * 256 * 2  # every sliding layer's K and V ring of one sequence, bf16
    assert prof.kv_bytes_per_token(2) == global_per_token and prof.state_bytes == ring
    d = plan(prof, load_hardware("1x-rtx4090"), PlanConfig(context=32768)).to_dict()
    assert d["kv_bytes_per_token"] == global_per_token and d["state_bytes_per_session"] == 2 * ring
    bf16 = next(c for c in d["candidates"] if c["variant"] == "bf16")
    assert bf16["kv_bytes"] == global_per_token * 32768 + 2 * ring
    # UD-Q4_K_XL: 18.2 GiB in our GPU form (Q4_K at its own scales), 2.5 GiB of global KV, the running ring (its
    # snapshot in host memory) and the 2.0 GiB reserve: 23.4 of the 4090's 23.5 GiB free.
    q4 = next(c for c in d["candidates"] if c["variant"] == "ud-q4_k_xl")
    assert d["chosen"] == "ud-q4_k_xl" and q4["ok"] and q4["kv_bytes"] == global_per_token * 32768 + ring
    assert 18.1 < q4["weights_bytes"] / 2**30 < 18.3
    assert any(n.startswith("state snapshots in host memory") for n in q4["notes"])
    # At 16k the snapshot fits on the card too; at 64k nothing fits, and the longest context that does is named.
    at16k = plan(prof, load_hardware("1x-rtx4090"), PlanConfig(context=16384)).chosen
    assert at16k is not None and at16k.kv_bytes == global_per_token * 16384 + 2 * ring
    at64k = next(c for c in plan(prof, load_hardware("1x-rtx4090"), PlanConfig(context=65536)).candidates
                 if c.variant.name == "ud-q4_k_xl")
    assert not at64k.ok and "fits at tp=1 up to 33,792 tokens of context (--context 33792)" in at64k.notes
    assert plan(prof, load_hardware("1x-rtx5090"), PlanConfig(context=32768)).chosen.variant.name == "ud-q4_k_xl"
    moe = plan(find_profile("gemma-4-26b-a4b"), load_hardware("1x-rtx4090"), PlanConfig(context=32768, experts_in_ram=False))
    assert moe.chosen is not None and moe.chosen.variant.name == "ud-q4_k_xl"
    # with host RAM the bf16 release runs with its experts off the card, ranked after the GGUF that fits: no CPU
    # expert kernel runs bf16 experts yet (tests/test_plan_offload.py)
    ram = plan(find_profile("gemma-4-26b-a4b"), load_hardware("1x-rtx4090"), PlanConfig(context=32768))
    assert ram.chosen is not None and ram.chosen.variant.name == "ud-q4_k_xl"
    bf16 = next(c for c in ram.candidates if c.variant.name == "bf16")
    assert bf16.ok and bf16.split is not None and bf16.slow


def test_gemma4_12b_profile_counts_what_the_engine_allocates() -> None:
    profile = find_profile("gemma-4-12b")
    config = Gemma4UnifiedConfig(text_config=GEMMA4_12B, architectures=[profile.architecture])
    with torch.device("meta"):
        model = Gemma4UnifiedForConditionalGeneration(config)
    layout = model.cache_layout()
    page = GPU_PAGE_SIZE
    per_page = KVCache.bytes_per_page(layout.kv_specs, page, torch.bfloat16, layout.tokens_per_entry)
    assert profile.kv_bytes_per_token(2) == per_page / page == 2 * 8 * 2 * 512 * 2
    assert layout.state is not None
    rings = page_slack(list(layout.state.specs), page)  # what the runner allocates: the window and a page
    assert rings is not None and profile.state_bytes == StateCache.bytes_per_slot(rings, torch.bfloat16)
    assert profile.params == sum(p.numel() for p in model.parameters())
    assert profile.layers == len(model.language_model.layers)


def test_gemma4_12b_plan_on_a_4090() -> None:
    prof = find_profile("gemma-4-12b")
    d = plan(prof, load_hardware("1x-rtx4090"), PlanConfig(context=32768)).to_dict()
    # Q8_0: 11.8 GiB of weights, 1.0 GiB of global KV at 32k, the ring and its snapshot (0.6 GiB) and the reserve
    q8 = next(c for c in d["candidates"] if c["variant"] == "q8_0")
    assert d["chosen"] == "q8_0" and q8["kv_bytes"] == 32768 * 32768 + 2 * prof.state_bytes
    assert 11.7 < q8["weights_bytes"] / 2**30 < 11.9
    bf16 = next(c for c in d["candidates"] if c["variant"] == "bf16")
    assert not bf16["ok"] and "does not fit" in " ".join(bf16["reasons"])
