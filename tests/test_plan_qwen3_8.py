"""Qwen3.8-27B's profile on the described single cards: a variant is chosen on a 24 GB RTX 4090 and a 32 GB
RTX 5090, and the plan counts the MTP head (its bf16 weights and its attention layer's KV) for the variants
agentbox loads it from (the unquantised checkpoint), not for GGUF files or quantised checkpoints."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from agentbox.chat.effort import ReasoningEffort
from agentbox.cli.main import app
from agentbox.hub.plan import PlanConfig, plan
from agentbox.hub.profiles import find_profile
from agentbox.hub.weight_bytes import mtp_weight_bytes, resident_weight_bytes, trunk_weight_bytes
from agentbox.hw.probe import Probe

HW = Path(__file__).parents[1] / "profiles" / "hardware"


def test_profile_reads_the_mtp_head_and_the_effort() -> None:
    prof = find_profile("Qwen3.8-27B")
    assert (prof.mtp_layers, prof.kv_layers_, prof.kv_heads, prof.head_dim) == (1, 16, 4, 256)
    assert prof.reasoning_effort is ReasoningEffort.MEDIUM and prof.tool_parser == "qwen3_coder"
    # fc 2h x h + the attention layer (q with its gate, k, v, o, q/k norms) + the SwiGLU MLP + four norms
    h, inter, q, kv = 5120, 17408, 24 * 256, 4 * 256
    assert prof.mtp_params == 2 * h * h + (h * 2 * q + 2 * h * kv + q * h + 2 * 256) + 3 * h * inter + 4 * h
    # One more attention layer of K and V per token than the 16 of the model itself.
    assert prof.kv_bytes_per_token(2) == 2 * 17 * 4 * 256 * 2
    assert prof.kv_bytes_per_token(2, mtp=False) == 2 * 16 * 4 * 256 * 2
    bf16, fp8, gguf = prof.variant("bf16"), prof.variant("fp8"), prof.variant("ud-q4_k_m")
    assert bf16.carries_mtp and not fp8.carries_mtp and not gguf.carries_mtp
    assert resident_weight_bytes(prof, bf16, "cuda") == trunk_weight_bytes(prof, bf16, "cuda") + 2 * prof.mtp_params
    assert mtp_weight_bytes(prof, bf16, "cpu") == 4 * prof.mtp_params
    for v in (fp8, gguf):
        assert resident_weight_bytes(prof, v, "cuda") == trunk_weight_bytes(prof, v, "cuda")


def test_a_variant_is_chosen_on_one_4090_and_one_5090() -> None:
    prof = find_profile("Qwen3.8-27B")
    chosen = {}
    for hw in ("1x-rtx4090", "1x-rtx5090"):
        p = plan(prof, Probe.load(HW / f"{hw}.json"), PlanConfig())
        assert p.chosen is not None, [c.reasons for c in p.candidates]
        c = p.chosen
        assert c.tp == 1 and c.fits
        # The head's weights are in the plan's weights term, its layer in the KV term, where the files carry it.
        for cand in p.candidates:
            head = cand.variant.carries_mtp
            assert cand.weights_bytes == resident_weight_bytes(prof, cand.variant, "cuda")
            assert (cand.weights_bytes > trunk_weight_bytes(prof, cand.variant, "cuda")) == head
            assert cand.kv_bytes == prof.kv_bytes_per_token(2, mtp=head) * p.context + prof.state_bytes_per_session()
        assert any("MTP head" in n and "counted for bf16:" in n for n in p.notes)
        chosen[hw] = c.variant.name
    # 24 GB takes the 4-bit file (Q6_K's 23 GiB resident does not fit); 32 GB the wider Q6_K.
    assert chosen == {"1x-rtx4090": "ud-q4_k_m", "1x-rtx5090": "q6_k"}


def test_plan_command_names_the_mtp_layer_where_the_chosen_files_carry_it() -> None:
    out = CliRunner().invoke(app, ["plan", "Qwen3.8-27B", "--hardware", str(HW / "1x-rtx4090.json")])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())  # the plan wraps at the terminal's width (80 columns without one)
    assert "KV 64 KiB/token = 2 x 16 attention layers" in text and "Qwen3.8-27B:ud-q4_k_m" in text
    big = CliRunner().invoke(app, ["plan", "Qwen3.8-27B", "--hardware", str(HW / "1x-h100.json")])
    assert big.exit_code == 0, big.output
    text = " ".join(big.output.split())
    assert "KV 68 KiB/token = 2 x (16 attention layers + 1 MTP)" in text and "Qwen3.8-27B:bf16" in text
