"""The planner puts the routed experts of a MoE model that fits no GPU in host RAM (hub/offload.py): the split
(GiB on each GPU, GiB of experts in RAM), a decode bound from each side's bandwidth, the 8 tok/s floor, and
what is missing when RAM is short."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentbox.hub.offload import fewest_layers, sides
from agentbox.hub.plan import Candidate, Plan, PlanConfig, plan
from agentbox.hub.profiles import find_profile
from agentbox.hub.weight_bytes import expert_resident_bytes, resident_weight_bytes
from agentbox.hw.bandwidth import gpu_bandwidth
from agentbox.hw.hardware import load_hardware
from agentbox.hw.probe import GIB, Probe
from agentbox.layers.quant.formats import NVFP4_BYTES

HW = Path(__file__).parents[1] / "profiles" / "hardware"


def machine(name: str, ram_gib: int | None = None) -> Probe:
    probe = Probe.load(HW / f"{name}.json")
    if ram_gib is not None:
        probe.host = replace(probe.host, ram_total=ram_gib * GIB, ram_free=(ram_gib - 2) * GIB)
    return probe


def run(model: str, hw: str, ram_gib: int | None = None, **cfg: float) -> Plan:
    return plan(find_profile(model), machine(hw, ram_gib), PlanConfig(**cfg))  # type: ignore[arg-type]


def cand(p: Plan, variant: str) -> Candidate:
    return next(c for c in p.candidates if c.variant.name == variant)


def test_gpt_oss_120b_on_one_5090_with_128g_puts_experts_in_ram() -> None:
    p = run("gpt-oss-120b", "1x-rtx5090-128g")
    c = p.chosen
    assert c is not None and c.split is not None and c.tp == 1
    s = c.split
    prof = find_profile("gpt-oss-120b")
    # the GPU keeps the rest and the experts of the MoE layers past the first N; the first N sit in RAM
    full = resident_weight_bytes(prof, c.variant, "cuda")
    experts = expert_resident_bytes(prof, c.variant, "cuda")
    assert experts == round(114_661_785_600 * 4.25 / 8)
    assert c.weights_bytes == full - experts + experts * (36 - s.in_ram) // 36
    assert c.need_per_device <= c.available_bytes and s.host_fits
    # the fewest layers: one layer fewer in RAM does not fit the card
    room = c.available_bytes - c.reserve_bytes - c.kv_bytes
    assert fewest_layers(sides(prof, c.variant, full), 36, room, 1) == s.in_ram
    assert (full - experts + experts * (36 - s.in_ram + 1) // 36) > room
    # the decode bound: RAM bytes / RAM bandwidth + GPU bytes / GPU bandwidth, both from the description
    assert s.ram_bandwidth == 64 * 10**9 and s.gpu_bandwidth == 1792 * 10**9
    assert s.ram_step_bytes == round(s.host_bytes * 4 / 128)
    assert abs(s.tok_s - 1 / (s.ram_step_bytes / 64e9 + s.gpu_step_bytes / 1792e9)) < 1e-9
    # above the floor, but no CPU expert kernel runs MXFP4 yet: the only variant, chosen all the same, saying so
    assert s.tok_s > 8 and not s.host_kernel and c.slow
    assert any(n.startswith("mxfp4 experts in RAM: no CPU expert kernel") for n in c.notes)
    assert any(n.startswith(f"experts of {s.in_ram} of 36 MoE layers in RAM") for n in c.notes)
    assert any(n.startswith("decode <= ") and "above the 8 tok/s floor" in n for n in c.notes)


def test_two_5090s_with_192g_split_fewer_layers_at_tp2() -> None:
    one = run("gpt-oss-120b", "1x-rtx5090-128g").chosen
    two = run("gpt-oss-120b", "2x-rtx5090-192g").chosen
    assert one is not None and two is not None and one.split and two.split
    assert two.tp == 2 and two.split.in_ram < one.split.in_ram and two.split.tok_s > one.split.tok_s


def test_qwen3_coder_next_chooses_the_split_the_cpu_kernels_run() -> None:
    p = run("Qwen3-Coder-Next", "1x-rtx5090-128g")
    c = p.chosen
    # Q4_K_M's experts run on the CPU expert kernels; fp8's and bf16's would run the torch reference (no
    # honest estimate): they rank after it whatever their bits, and say why
    assert c is not None and c.variant.name == "q4_k_m" and c.split is not None and c.split.host_kernel
    assert c.split.tok_s >= 8 and c.split.serve_flag == f"--n-cpu-moe {c.split.in_ram}"
    fp8 = cand(p, "fp8")
    assert fp8.ok and fp8.split is not None and not fp8.split.host_kernel and fp8.slow
    assert any(n.startswith("fp8 experts in RAM: no CPU expert kernel") for n in fp8.notes)


def test_a_better_quant_in_ram_beats_a_worse_one_on_the_gpu_above_the_floor() -> None:
    # Qwen3-Coder-30B-A3B on a 24 GB card: Q4_K_M (4.8 bits) with 2 layers' experts in RAM over NVFP4 (4.5) and
    # AWQ (4.25) that fit the card alone, while its bound is above the floor; past the bound the best GPU-only wins
    p = run("Qwen3-Coder-30B-A3B-Instruct", "1x-rtx4090")
    c = p.chosen
    assert c is not None and c.variant.name == "q4_k_m" and c.split is not None and c.split.in_ram == 2
    assert all(cand(p, name).ok and cand(p, name).split is None for name in ("nvfp4", "awq"))
    high = run("Qwen3-Coder-30B-A3B-Instruct", "1x-rtx4090", min_tok_s=c.split.tok_s + 1)
    assert high.chosen is not None and high.chosen.variant.name == "nvfp4"
    q4 = cand(high, "q4_k_m")
    assert q4.slow and any("below the" in n and "floor" in n for n in q4.notes)


def test_a_gpu_only_variant_beats_a_slow_split_of_more_bits() -> None:
    # Qwen3-Coder-30B-A3B on one 5090: q4/q8 GGUF fit the card; a split bf16 below a high floor ranks after them
    p = run("Qwen3-Coder-30B-A3B-Instruct", "1x-rtx5090-128g", min_tok_s=10_000)
    assert p.chosen is not None and p.chosen.split is None


def missing_ram(c: Candidate, ram_gib: int) -> bool:
    return c.split is not None and any(
        r.startswith("does not fit: the experts in RAM need") and f"{ram_gib}.0 GiB in all" in r and "missing)" in r
        for r in c.reasons)


def test_32g_of_ram_says_what_is_missing() -> None:
    p = run("gpt-oss-120b", "1x-rtx5090-128g", ram_gib=32)
    assert p.chosen is None and missing_ram(cand(p, "mxfp4"), 32)
    # Qwen3-Coder-Next: Q4_K_M's 22 layers of experts (25 GiB) still fit 32 GiB; fp8 and bf16 say what they lack
    p = run("Qwen3-Coder-Next", "1x-rtx5090-128g", ram_gib=32)
    assert p.chosen is not None and p.chosen.variant.name == "q4_k_m"
    assert missing_ram(cand(p, "fp8"), 32) and missing_ram(cand(p, "bf16"), 32)
    p = run("Qwen3-Coder-Next", "1x-rtx5090-128g", ram_gib=24)
    assert p.chosen is None and all(missing_ram(c, 24) for c in p.candidates)
    # two cards keep all but 4 of gpt-oss-120b's 36 layers of experts: 8 GiB of RAM is enough, 4 is not
    p = run("gpt-oss-120b", "2x-rtx5090-192g", ram_gib=32)
    assert p.chosen is not None and p.chosen.split is not None
    p = run("gpt-oss-120b", "2x-rtx5090-192g", ram_gib=4)
    assert p.chosen is None and missing_ram(cand(p, "mxfp4"), 4)


def test_deepseek_v4_flash_on_one_5090_with_128g_names_the_missing_piece() -> None:
    p = run("DeepSeek-V4-Flash", "1x-rtx5090-128g")
    # Q4_K_M's experts need ~167 GiB of RAM in the CPU kernels' form, Q2_K_XL's types are not known from its name
    # (planned at bf16): both say so (the Q2_K / Q3_K variants that run: tests/test_plan_deepseek_v4.py)
    assert p.chosen is not None and p.chosen.variant.name.startswith(("q2_k", "q3_k"))
    q4 = cand(p, "q4_k_m")
    assert q4.split is not None and q4.split.host_need > 128 * GIB
    q2 = cand(p, "q2_k_xl")
    assert any("no expert kernel keeps its experts' types quantised" in n for n in q2.notes)


def test_plan_command_shows_the_split_and_the_flag() -> None:
    from agentbox.cli.main import app

    runner = CliRunner()
    out = runner.invoke(app, ["plan", "gpt-oss-120b", "--hardware", str(HW / "1x-rtx5090-128g.json")])
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())  # the plan wraps at the terminal's width (80 columns without one)
    assert "MoE layers in RAM" in text and "tok/s floor" in text
    assert "with --n-cpu-moe" in text and "routed experts in host RAM" in text
    js = runner.invoke(app, ["plan", "gpt-oss-120b", "--hardware", "2x-rtx5090-192g", "--json"])
    data = json.loads(js.output)
    chosen = next(c for c in data["candidates"] if c["variant"] == data["chosen"])
    assert chosen["split"]["host_fits"] and chosen["split"]["serve_flag"].startswith("--n-cpu-moe")


def test_bandwidth_comes_from_the_description_or_the_name() -> None:
    probe = load_hardware("1x-rtx5090")  # a description without bandwidths (the -128g one has them)
    assert probe.host.ram_bandwidth is None and gpu_bandwidth(probe.gpus[0]) == 1792 * 10**9
    p = plan(find_profile("gpt-oss-120b"), probe)
    c = p.chosen
    assert c is not None and c.split is not None and c.split.ram_bandwidth_assumed
    assert any("GB/s RAM (assumed)" in n for n in c.notes)
    assert load_hardware("1x-rtx5090-128g").host.ram_bandwidth == 64 * 10**9


def test_serve_gets_the_plans_experts_in_ram(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The chain `serve` runs hands the engine the plan's N (and says it on the plan line); the flags override it."""
    from rich.console import Console
    from test_hub_chain import _seed

    from agentbox.hub.chain import resolve_default
    from agentbox.hub.pull import MARKER, variant_dir
    from agentbox.hub.verify import VerdictStore

    monkeypatch.setenv("AGENTBOX_HOME", str(tmp_path / "home"))
    profile = find_profile("gpt-oss-120b")
    variant = profile.variant("mxfp4")
    d = variant_dir(profile, variant)
    d.mkdir(parents=True)
    (d / MARKER).write_text("{}")  # "downloaded": the chain takes it without the hub
    probe = machine("1x-rtx5090-128g")
    store = VerdictStore(tmp_path / "verdicts.json")
    _seed(store.path, profile.name, "mxfp4", probe, ok=True)  # the canary's verdict, remembered
    res = resolve_default(probe=probe, offline=True, store=store, console=Console(quiet=True), profiles=[profile])
    chosen = plan(profile, probe).chosen
    assert chosen is not None and chosen.split is not None
    assert res.variant == "mxfp4" and res.n_cpu_moe == chosen.split.in_ram > 0
    assert any(s.startswith(f"plan gpt-oss-120b:mxfp4 tp=1 --n-cpu-moe {res.n_cpu_moe}: ") for s in res.steps)


def test_serve_refuses_a_negative_n_cpu_moe() -> None:
    from agentbox.cli.main import app

    out = CliRunner().invoke(app, ["serve", "--model", "x.gguf", "--n-cpu-moe", "-1"])
    assert out.exit_code != 0 and "--n-cpu-moe must be 0 or more" in out.output


def test_nvfp4_experts_in_ram_count_as_kernel_run_at_4_5_bits() -> None:
    """NVFP4's experts run on the CPU kernel in RAM (kernels/cpu_nvfp4.c) at the bytes they hold on the GPU, so an
    NVFP4 split is ranked by its bound like a Q4_K_M one; MXFP4's and FP8's still are not."""
    prof = find_profile("Qwen3-Coder-30B-A3B-Instruct")
    nvfp4 = prof.variant("nvfp4")
    s = sides(prof, nvfp4, resident_weight_bytes(prof, nvfp4, "cuda"))
    assert s.host_kernel and s.experts_cpu == s.experts_gpu == round(prof.expert_params * NVFP4_BYTES)
    c = cand(run("Qwen3-Coder-30B-A3B-Instruct", "1x-rtx4080"), "nvfp4")  # 16 GB: a split
    assert c.ok and c.split is not None and c.split.host_kernel and c.split.preferred
    assert not any("no CPU expert kernel" in n for n in c.notes)
    mx = find_profile("gpt-oss-120b")
    assert not sides(mx, mx.variant("mxfp4"), resident_weight_bytes(mx, mx.variant("mxfp4"), "cuda")).host_kernel
