"""The planner counts Gemma 4's KV per layer kind (sliding 16 x 256, global 4 x 512 for the 31B) and says what
freeing the sliding layers' pages past their window would save; GGUF gemma4 variants are named as not loadable."""

from __future__ import annotations

from agentbox.hub.plan import PlanConfig, plan
from agentbox.hub.profiles import find_profile
from agentbox.hw.hardware import load_hardware


def test_gemma4_kv_per_layer_kind() -> None:
    prof = find_profile("gemma-4-31b")
    by_kind = prof.kv_bytes_per_token_by_kind(2)
    assert by_kind == {"sliding": 2 * 50 * 16 * 256 * 2, "global": 2 * 10 * 4 * 512 * 2}
    assert prof.kv_bytes_per_token(2) == sum(by_kind.values())
    assert prof.sliding_window_saving(32768, 2) == by_kind["sliding"] * (32768 - 1024)
    assert prof.sliding_window_saving(512, 2) == 0
    d = plan(prof, load_hardware("1x-rtx4090"), PlanConfig(context=32768)).to_dict()
    assert d["kv_bytes_per_token_by_kind"] == by_kind
    assert any("1024-token window would save" in n for n in d["notes"])
    gguf = [c for c in d["candidates"] if c["format"] == "gguf"]
    assert gguf and all(any("GGUF gemma4" in r for r in c["reasons"]) for c in gguf)
