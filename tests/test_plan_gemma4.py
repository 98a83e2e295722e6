"""The planner counts Gemma 4's memory by layer kind: KV per token for the global layers only (4 KV heads x 512
for the 31B) and the sliding layers' rings (1,024 positions + a page of slack) per session: the live ring and
one snapshot, what the runner allocates per running request. GGUF gemma4 files load (models/gguf_gemma4.py): on
a 4090 the 26B-A4B's UD-Q4_K_XL is chosen (its experts stay quantised), and the 31B's at
32k tokens with its running ring on the card and its snapshot in host memory; a 5090 runs it."""

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
