"""The planner counts Gemma 4's memory by layer kind: KV per token for the global layers only (4 KV heads x 512
for the 31B) and the sliding layers' rings (1,024 positions + a page of slack) per session: the live ring and
one snapshot, what the runner allocates per running request. GGUF gemma4 files load (models/gguf_gemma4.py): on
a 4090 the 26B-A4B's UD-Q4_K_XL is chosen (its experts stay quantised); the 31B's needs more than the card at
32k tokens (its weights' GPU form is 19.2 GiB), fits at 16k with its snapshot in host memory; a 5090 runs it."""

from __future__ import annotations

from agentbox.hub.plan import PlanConfig, plan
from agentbox.hub.profiles import find_profile
from agentbox.hw.hardware import load_hardware


def test_gemma4_kv_per_layer_kind() -> None:
    prof = find_profile("gemma-4-31b")
    global_per_token = 2 * 10 * 4 * 512 * 2
    ring = 2 * 50 * (1024 + 16) * 16 * 256 * 2  # every sliding layer's K and V ring of one sequence, bf16
    assert prof.kv_bytes_per_token(2) == global_per_token and prof.state_bytes == ring
    d = plan(prof, load_hardware("1x-rtx4090"), PlanConfig(context=32768)).to_dict()
    assert d["kv_bytes_per_token"] == global_per_token and d["state_bytes_per_session"] == 2 * ring
    bf16 = next(c for c in d["candidates"] if c["variant"] == "bf16")
    assert bf16["kv_bytes"] == global_per_token * 32768 + 2 * ring
    q4 = next(c for c in d["candidates"] if c["variant"] == "ud-q4_k_xl")
    assert [r for r in q4["reasons"] if not r.startswith("does not fit")] == [] and not q4["fits"]
    assert "fits at tp=1 up to 19,456 tokens of context (--context 19456)" in q4["notes"]  # snapshot in host RAM
    # At 16k the card holds the running session's ring but not its snapshot: that goes to host memory.
    at16k = plan(prof, load_hardware("1x-rtx4090"), PlanConfig(context=16384)).chosen
    assert at16k is not None and at16k.variant.name == "ud-q4_k_xl"
    assert at16k.kv_bytes == global_per_token * 16384 + ring
    assert any(n.startswith("state snapshots in host memory") for n in at16k.notes)
    assert plan(prof, load_hardware("1x-rtx5090"), PlanConfig(context=32768)).chosen.variant.name == "ud-q4_k_xl"
    moe = plan(find_profile("gemma-4-26b-a4b"), load_hardware("1x-rtx4090"), PlanConfig(context=32768))
    assert moe.chosen is not None and moe.chosen.variant.name == "ud-q4_k_xl"
