"""The planner on described machines: 2x RTX 5090 (sm_120, 32 GB), 1x RTX 4090 (24 GB), 1x H100 (80 GB), CPU only."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentbox.hub.engine_support import engine_runs
from agentbox.hub.plan import Candidate, Plan, PlanConfig, plan, tp_sizes
from agentbox.hub.profiles import find_profile
from agentbox.hub.weight_bytes import resident_weight_bytes as plan_resident_bytes
from agentbox.hw.probe import Probe
from agentbox.layers.quant.formats import (
    GGUF_MIXES,
    GGUF_TYPE_BYTES,
    INT4_CPU_BYTES,
    INT4_FILE_BYTES,
    INT4_RESIDENT_BYTES,
    gguf_mix,
    gguf_resident_ratio,
)

HW = Path(__file__).parents[1] / "profiles" / "hardware"


def machine(name: str) -> Probe:
    return Probe.load(HW / f"{name}.json")


def run(model: str, hw: str, **cfg: int | bool) -> Plan:
    return plan(find_profile(model), machine(hw), PlanConfig(**cfg))  # type: ignore[arg-type]


def cand(p: Plan, variant: str) -> Candidate:
    return next(c for c in p.candidates if c.variant.name == variant)


def test_qwen3_8b_on_two_5090s_runs_bf16_on_one_card() -> None:
    p = run("Qwen3-8B", "2x-rtx5090")
    assert p.chosen is not None and (p.chosen.variant.name, p.chosen.tp) == ("bf16", 1)
    # the arithmetic: 8.19e9 params x 2 bytes, KV 144 KiB/token x 32768 tokens
    assert p.chosen.weights_bytes == 8_190_735_360 * 2
    assert p.chosen.kv_bytes == 2 * 36 * 8 * 128 * 2 * 32768
    assert p.chosen.need_per_device <= p.chosen.available_bytes
    assert "<= 31.3 GiB free per GPU" in p.chosen.arithmetic
    fp8 = cand(p, "fp8")  # runnable (w8a16), planned at the file's size
    assert fp8.ok and fp8.weights_bytes == fp8.variant.size
    awq = cand(p, "awq")  # runnable, planned at the file's size + its resident form's extra, with the caveat
    assert awq.ok and awq.weights_bytes == awq.variant.size + int(8_190_735_360 * (INT4_RESIDENT_BYTES - INT4_FILE_BYTES))
    assert any("only under Triton's CPU interpreter" in n for n in awq.notes)
    # GGUF stays quantised on GPU: the file's size times its mix's resident / file bytes (the name tells it)
    q8 = cand(p, "q8_0")
    assert q8.ok and q8.weights_bytes == q8.variant.size  # Q8_0's k-bit form is the file's 34 bytes per 32
    q4km = cand(p, "q4_k_m")
    # Q4_K linears keep their own scales (codes + 6-bit scale and min per 32 + fp16 d and dmin per 256)
    ratio = (0.85 * (0.5 + 2 / 32 + 4 / 256) + 0.15 * (6 / 8 + 2 / 16)) / (0.85 * 144 / 256 + 0.15 * 210 / 256)
    assert q4km.weights_bytes == int(q4km.variant.size * ratio) and 1.03 < ratio < 1.04
    assert any("stays quantised (85 % Q4_K + 15 % Q6_K, by the name)" in n for n in q4km.notes)
    assert not any("dequantised at load" in n for n in q4km.notes)
    assert any("leaving 1 GPU(s) free" in n for n in p.notes)


def test_more_sessions_move_qwen3_8b_to_tensor_parallel() -> None:
    p = run("Qwen3-8B", "2x-rtx5090", sessions=4)  # 18 GiB of KV no longer fits next to 15.3 GiB on one card
    assert p.chosen is not None and p.chosen.tp == 2


def test_qwen25_coder_32b_on_two_5090s_runs_q4_k_m_with_its_caveat_and_says_why_not_the_rest() -> None:
    p = run("Qwen2.5-Coder-32B-Instruct", "2x-rtx5090")
    # Q4_K_M (4.8 bits) stays quantised: 19.1 GiB resident (the file's 18.5 + Q6_K's bf16 scales and Q4_K's
    # scales unpacked to bytes) fits one card beside 8 GiB of KV, and is chosen ahead of 4-bit GPTQ.
    assert p.chosen is not None and (p.chosen.variant.name, p.chosen.tp) == ("q4_k_m", 1)
    assert 1.03 < p.chosen.weights_bytes / p.chosen.variant.size < 1.04
    assert any("only under Triton's CPU interpreter" in n for n in p.chosen.notes)
    gptq = cand(p, "gptq-int4")
    assert gptq.ok and gptq.tp == 1
    assert 1 < gptq.weights_bytes / gptq.variant.size < 1.03  # stays 4-bit: resident ~ the file
    bf16 = cand(p, "bf16")
    assert bf16.tp == 2 and bf16.reasons == [bf16.reasons[0]] and bf16.reasons[0].startswith("does not fit")
    awq = cand(p, "awq")
    assert awq.fits  # it would fit, and it is still rejected: this AWQ checkpoint emitted only '!'
    assert sum("only '!'" in r for r in awq.reasons) == 2  # Marlin and classic AWQ kernels
    assert not any(r.startswith("engine:") for r in awq.reasons)  # our engine runs AWQ


def test_qwen3_coder_moe_on_two_5090s_counts_every_expert_and_says_what_fits() -> None:
    p = run("Qwen3-Coder-30B-A3B-Instruct", "2x-rtx5090", experts_in_ram=False)  # the GPUs alone
    bf16 = cand(p, "bf16")
    # all 128 experts resident: 30.5B params x 2 bytes, split over 2 cards; a token reads only 3.3B of them
    assert bf16.tp == 2 and bf16.weights_bytes == 30_532_122_624 * 2
    assert bf16.decode_weight_bytes == 3_300_000_000 * 2
    assert bf16.reasons[0].startswith("does not fit")  # 32.2 GiB per card at 32k tokens: 0.9 GiB short
    assert "fits at tp=2 up to 13,312 tokens of context (--context 13312)" in bf16.notes
    shorter = run("Qwen3-Coder-30B-A3B-Instruct", "2x-rtx5090", context=13312, experts_in_ram=False)
    assert shorter.chosen is not None and (shorter.chosen.variant.name, shorter.chosen.tp) == ("bf16", 2)
    # fp8 experts load (w8a16) and are chosen at tp 2; the known-bad fp8 entry names the w8a8 MoE kernel,
    # which agentbox does not run: a note, with our own kernel's unverified status, not a rejection
    fp8 = cand(p, "fp8")
    assert p.chosen is fp8 and fp8.ok and fp8.tp == 2 and fp8.weights_bytes == fp8.variant.size
    bad = next(n for n in fp8.notes if "garbage on sm_120" in n)
    assert "fp8_w8a8" in bad and "runs fp8 weight-only" in bad and "not verified on this GPU family" in bad
    assert any(n.startswith("fp8 MoE experts: our fused Triton kernel is verified only under") for n in fp8.notes)
    # the 4-bit AWQ release fits one 32 GB card, resident = the file + a bf16 scale and offset per group
    awq = cand(p, "awq")
    assert awq.ok and awq.tp == 1
    assert awq.weights_bytes == awq.variant.size + int(30_532_122_624 * (INT4_RESIDENT_BYTES - INT4_FILE_BYTES))
    # the Q4_K_M GGUF (what most users have): its experts stay 4-bit (gate/up, half the downs) and 6-bit
    # (the other downs), the rest at its file's mix: it fits one 32 GB card and is chosen there over AWQ
    one_card = plan(find_profile("Qwen3-Coder-30B-A3B-Instruct"), replace(machine("2x-rtx5090"), gpus=machine("2x-rtx5090").gpus[:1]),
                    PlanConfig(experts_in_ram=False))
    assert one_card.chosen is not None and (one_card.chosen.variant.name, one_card.chosen.tp) == ("q4_k_m", 1)
    assert any("FlashInfer's CUTLASS" in n for n in cand(p, "nvfp4").notes)
    q4km = cand(p, "q4_k_m")
    assert q4km.ok and q4km.tp == 1 and not q4km.reasons
    assert q4km.variant.size < q4km.weights_bytes < 1.11 * q4km.variant.size
    assert any("MoE: the experts stay quantised" in n for n in q4km.notes)
    # on Hopper the fp8 MoE kernel is not known bad, and bf16 fits on one card
    h100 = run("Qwen3-Coder-30B-A3B-Instruct", "1x-h100")
    assert not any("garbage" in r for r in cand(h100, "fp8").reasons)
    assert h100.chosen is not None and (h100.chosen.variant.name, h100.chosen.tp) == ("bf16", 1)


def test_quantised_moe_experts_stay_quantised_on_cpu() -> None:
    p = run("Qwen3-Coder-30B-A3B-Instruct", "cpu")
    params, experts = 30_532_122_624, 28_991_029_248  # the profile's expert_params: 48 x 128 x 3 x 2048 x 768
    awq = cand(p, "awq")  # 4-bit experts with fp32 scale and offset, the rest (attention, embeddings) fp32
    assert awq.weights_bytes == int(experts * INT4_CPU_BYTES) + (params - experts) * 4
    assert any("the experts stay quantised" in n for n in awq.notes)
    assert cand(p, "bf16").weights_bytes == params * 4
    assert p.chosen is None  # 28.9 GiB against a 16 GB laptop's 13.6 GiB free


def test_gpt_oss_20b_mxfp4_runs_on_a_24gb_card() -> None:
    p = run("gpt-oss-20b", "1x-rtx4090", experts_in_ram=False)  # the GPU alone (with RAM: tests/test_plan_offload.py)
    assert p.chosen is not None and (p.chosen.variant.name, p.chosen.tp) == ("mxfp4", 1)
    assert p.chosen.weights_bytes == 13_761_300_000  # MXFP4 experts stay MXFP4 in memory
    assert cand(p, "bf16").reasons[0].startswith("does not fit")


def test_gpt_oss_20b_on_a_16gb_card_fits_with_a_shorter_context() -> None:
    p = run("gpt-oss-20b", "1x-rtx4080", experts_in_ram=False)
    mx = cand(p, "mxfp4")
    assert p.chosen is None and mx.reasons[0].startswith("does not fit")  # 0.5 GiB short at 32k tokens
    longest = next(n for n in mx.notes if n.startswith("fits at tp=1 up to"))
    context = int(longest.rsplit("--context ", 1)[1].rstrip(")"))
    shorter = run("gpt-oss-20b", "1x-rtx4080", context=context, experts_in_ram=False)
    assert shorter.chosen is not None and shorter.chosen.variant.name == "mxfp4"
    assert run("gpt-oss-20b", "1x-rtx4080", context=context + 1024, experts_in_ram=False).chosen is None


def test_glm_flash_mla_cache_is_sized_exactly_and_a_variant_is_chosen() -> None:
    """MLA keeps one latent (kv_lora_rank) + one rope key per token and layer, on every rank: the planner sizes
    it from the config values and does not divide it by tp."""
    prof = find_profile("GLM-4.7-Flash")
    assert prof.mla and prof.kv_bytes_per_token(2) == 47 * (512 + 64) * 2 == 54_144
    for hw in ("1x-rtx4090", "1x-rtx5090", "2x-rtx5090"):
        p = run("GLM-4.7-Flash", hw)
        assert p.chosen is not None, hw
        assert p.chosen.kv_bytes == 54_144 * p.context * p.sessions
        assert "every rank keeps the whole latent cache" in p.chosen.arithmetic
    bf16 = cand(run("GLM-4.7-Flash", "2x-rtx5090"), "bf16")
    assert bf16.tp == 2 and bf16.need_per_device == bf16.weights_bytes // 2 + bf16.kv_bytes + bf16.reserve_bytes
    assert engine_runs(prof)
    from agentbox.cli.main import app

    result = CliRunner().invoke(app, ["plan", "GLM-4.7-Flash", "--hardware", str(HW / "1x-rtx4090.json"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    chosen = next(c for c in data["candidates"] if c["variant"] == data["chosen"])
    assert data["kv_bytes_per_token"] == 54_144 and chosen["kv_replicated"] is True


def test_gpt_oss_120b_mxfp4_does_not_fit_32gb_cards_alone() -> None:
    p = run("gpt-oss-120b", "2x-rtx5090")
    mx = cand(p, "mxfp4")
    # weights alone overflow two cards' usable memory: the routed experts of a few layers go to host RAM
    assert mx.tp == 2 and mx.split is not None and mx.fits
    assert mx.variant.size / 2 / 1e9 > 32
    assert any(n.startswith("GPU only it needs") for n in mx.notes)


def test_rtx_4090_fits_one_session_not_four() -> None:
    p = run("Qwen3-8B", "1x-rtx4090")
    assert p.chosen is not None and (p.chosen.variant.name, p.chosen.tp) == ("bf16", 1)
    four = run("Qwen3-8B", "1x-rtx4090", sessions=4)
    assert four.chosen is None
    assert cand(four, "bf16").reasons == [
        "does not fit: needs 35.2 GiB per GPU at tp=1, 23.5 GiB free"  # 15.3 + 4 x 4.5 KV + 2.0 reserve (GiB)
    ]
    assert run("Qwen2.5-Coder-32B-Instruct", "1x-rtx4090").chosen is None


def test_h100_runs_the_32b_coder_in_bf16() -> None:
    p = run("Qwen2.5-Coder-32B-Instruct", "1x-h100")
    assert p.chosen is not None and (p.chosen.variant.name, p.chosen.tp) == ("bf16", 1)
    assert run("Qwen3-8B", "1x-h100").chosen.variant.name == "bf16"  # type: ignore[union-attr]


def test_cpu_only_plans_against_ram() -> None:
    p = run("Qwen3-8B", "cpu")
    # the planned context's KV in fp16 (the default CPU pool): Q4_K_M fits the 16 GiB machine, Q8_0 only its RAM in
    # all (in fp32 the KV alone left Q4_K_M at 16.9 GiB: nothing fitted)
    assert p.chosen is not None and p.chosen.variant.name == "q4_k_m" and "chose q4_k_m instead" in p.notes[0]
    bf16 = cand(p, "bf16")
    assert bf16.device == "cpu" and bf16.weights_bytes == 8_190_735_360 * 4  # fp32 on CPU
    assert bf16.reasons[0].startswith("does not fit: needs") and "of RAM" in bf16.reasons[0]
    small = run("SmolLM2-135M-Instruct", "cpu")
    assert small.chosen is not None and small.chosen.variant.name == "bf16"
    assert cand(small, "embedded").ok
    # Quantised files stay quantised on a CPU whose kernels build (cpu_gemv, cpu_bits): GGUF at its mix's
    # CPU bytes (Q8_0 the file's; Q4_K_M's Q4_K in fp32 scales, 1.27x), AWQ at 4 bits plus fp32 scales
    q8, q4km, awq = cand(p, "q8_0"), cand(p, "q4_k_m"), cand(p, "awq")
    assert q8.weights_bytes == int(q8.variant.size * gguf_resident_ratio("q8_0", "cpu")) and q8.weights_bytes < 1.01 * q8.variant.size
    assert q4km.variant.size < q4km.weights_bytes < 1.3 * q4km.variant.size
    assert any("Q4_K_M on CPU: stays quantised" in n for n in q4km.notes)
    assert awq.weights_bytes == awq.variant.size + int(8_190_735_360 * (INT4_CPU_BYTES - INT4_FILE_BYTES))
    # and where they cannot build (no compiler: the probe says so), everything is planned at fp32
    no_cc = machine("cpu")
    no_cc.software.cpu_kernels_ok = False
    dense = plan(find_profile("Qwen3-8B"), no_cc)
    assert {c.variant.name: c.weights_bytes for c in dense.candidates if c.variant.name in ("q8_0", "awq")} == {
        "q8_0": 8_190_735_360 * 4, "awq": 8_190_735_360 * 4}


def test_tp_sizes_divide_kv_heads_and_context_is_clamped() -> None:
    assert tp_sizes(find_profile("SmolLM2-135M-Instruct"), 2) == [1]  # 3 KV heads
    assert tp_sizes(find_profile("Qwen3-8B"), 8) == [1, 2, 4, 8]
    assert tp_sizes(find_profile("Qwen3-Coder-30B-A3B-Instruct"), 8) == [1, 2, 4]  # 4 KV heads
    p = run("SmolLM2-135M-Instruct", "1x-rtx4090", context=100_000)
    assert p.context == 8192 and "past the model's 8192" in p.notes[0]


def test_plan_command_json_and_table(tmp_path: Path) -> None:
    from agentbox.cli.main import app

    runner = CliRunner()
    out = runner.invoke(app, ["plan", "Qwen3-8B", "--hardware", str(HW / "2x-rtx5090.json"), "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["chosen"] == "bf16" and data["context"] == 32768
    assert {c["variant"] for c in data["candidates"]} == {"bf16", "fp8", "awq", "q8_0", "q4_k_m"}
    small = json.loads((HW / "2x-rtx5090.json").read_text())
    small["host"] |= {"ram_total": 4 * 2**30, "ram_free": 3 * 2**30}  # no room for experts in host RAM either
    (tmp_path / "small.json").write_text(json.dumps(small))
    table = runner.invoke(app, ["plan", "gpt-oss-120b", "--hardware", str(tmp_path / "small.json")])
    assert table.exit_code == 2  # nothing runs: a script can tell
    assert "does not fit" in table.output and "no variant runs" in table.output
    bad = runner.invoke(app, ["plan", "no-such-model"])
    assert bad.exit_code == 1 and "known models" in bad.output
    # a typo gets the close matches, as `serve --model` gives them, not every model
    typo = runner.invoke(app, ["plan", "qwen3-8"])
    assert typo.exit_code == 1 and "close matches: Qwen3-8B" in typo.output and "gpt-oss-120b" not in typo.output


@pytest.mark.parametrize("name", ["2x-rtx5090", "1x-rtx4090", "1x-h100", "cpu", "1x-rtx5090-128g", "2x-rtx5090-192g"])
def test_described_machines_load(name: str) -> None:
    p = machine(name)
    assert p.described and p.cpu_only == (name == "cpu")


@pytest.mark.parametrize(("model", "variant", "vocab", "vocab_types"), [
    ("Qwen3-8B", "q8_0", 151936 * 4096, ("q8_0", "q8_0")),
    ("Qwen3-8B", "q4_k_m", 151936 * 4096, ("q4_k", "q6_k")),
    ("Qwen2.5-Coder-32B-Instruct", "q4_k_m", 152064 * 5120, ("q4_k", "q6_k")),
])
def test_the_gguf_mix_a_name_tells_reproduces_the_file_size(
    model: str, variant: str, vocab: int, vocab_types: tuple[str, str]
) -> None:
    """The planner's assumption about a file's types (GGUF_MIXES: Q4_K_M's 15 % Q6_K) priced at the file's
    bytes per weight, plus llama.cpp's token_embd / output types (untied tables of vocab x hidden), gives the
    released file's size."""
    profile = find_profile(model)
    v = profile.variant(variant)
    mix = gguf_mix(v.name, *v.files)
    assert mix == variant
    linears = profile.params - 2 * vocab
    file_bytes = linears * sum(share * GGUF_TYPE_BYTES[t][0] for t, share in GGUF_MIXES[mix])
    file_bytes += sum(vocab * GGUF_TYPE_BYTES[t][0] for t in vocab_types)
    assert abs(file_bytes - v.size) < 0.01 * v.size  # 0.1-0.5 % on these three


def test_gguf_types_come_from_the_variant_or_file_name() -> None:
    assert gguf_mix("embedded", "SmolLM2-135M-Instruct.Q4_1.gguf") == "q4_1"
    assert gguf_mix("q4_k_m", "Qwen3-8B-Q4_K_M.gguf") == "q4_k_m"
    assert gguf_mix("iq4_xs", "Model-IQ4_XS.gguf") is None  # a type the linears do not keep: planned dense
    smol = find_profile("SmolLM2-135M-Instruct")
    unknown = replace(smol.variant("embedded"), name="iq4_xs", files=("m-IQ4_XS.gguf",))
    assert plan_resident_bytes(smol, unknown, "cuda") == smol.params * 2


@pytest.mark.slow
def test_the_gguf_plan_matches_the_real_model_in_its_gpu_form(smollm2_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's Q4_1 file (a Q8_0 vocabulary table) loaded in the GPU form (Triton layouts, bf16 scales,
    installed on CPU tensors): the measured resident bytes are the planned ones."""
    import torch

    from agentbox.layers.quant import bits, int4, resident_weight_bytes
    from agentbox.models.loader import load_model

    monkeypatch.setattr(bits, "default_kernel", lambda device: bits.BitsKernel.TRITON)
    monkeypatch.setattr(int4, "default_cpu_kernel", lambda: int4.Int4Kernel.TRITON)
    measured = resident_weight_bytes(load_model(str(smollm2_path), torch.bfloat16, "cpu").model)
    smol = find_profile("SmolLM2-135M-Instruct")
    planned = plan_resident_bytes(smol, smol.variant("embedded"), "cuda")
    # the plan counts the whole file (tokenizer and metadata too): 98.4 MB, 1.9 % over the 96.5 MB measured
    assert measured < planned < 1.03 * measured
