"""The planner and NVFP4: counted at 4.5 bits a weight, no longer rejected, and the path each GPU takes named
with its cost: the FP4 tensor cores on sm_120 (RTX 5090) where flashinfer imports, else and on sm_89 (RTX 4090) the
Triton W4A16 kernel."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from typer.testing import CliRunner

from agentbox.cli.main import app
from agentbox.hub.engine_support import engine_rejection
from agentbox.hub.plan import PlanConfig, plan
from agentbox.hub.profiles import find_profile
from agentbox.hub.weight_bytes import resident_weight_bytes
from agentbox.hw.probe import Probe
from agentbox.layers.quant.formats import METHODS, NVFP4_BYTES, QuantMethod, has_fp4_tensor_cores

HW = Path(__file__).parents[1] / "profiles" / "hardware"


def test_nvfp4_is_four_and_a_half_bits_and_blackwell_has_the_cores() -> None:
    assert NVFP4_BYTES * 8 == 4.5
    info = METHODS[QuantMethod.NVFP4]
    assert info.stays_quantised and info.file_bytes_per_weight == info.resident_bytes_per_weight == NVFP4_BYTES
    assert has_fp4_tensor_cores((12, 0)) and has_fp4_tensor_cores((10, 0))
    assert not any(has_fp4_tensor_cores(c) for c in ((8, 9), (9, 0), (8, 0), None))


def test_qwen3_8_27b_nvfp4_runs_on_a_5090_on_fp4_tensor_cores() -> None:
    prof = find_profile("Qwen3.8-27B")
    nv = prof.variant("nvfp4")
    assert engine_rejection(prof, nv) is None
    p = plan(prof, Probe.load(HW / "1x-rtx5090.json"), PlanConfig())
    cand = next(c for c in p.candidates if c.variant.name == "nvfp4")
    assert cand.ok and cand.tp == 1 and cand.weights_bytes == resident_weight_bytes(prof, nv, "cuda") == nv.size
    # the described 5090 has no flashinfer (as `agentbox doctor` would say): the W4A16 kernel, named as such
    assert any(n.startswith("nvfp4 on sm_120 (FP4 tensor cores): the Triton W4A16 path here") and
               "because flashinfer is not installed" in n for n in cand.notes)
    with_fi = Probe.load(HW / "1x-rtx5090.json")
    with_fi.software = replace(with_fi.software, flashinfer_version="0.3.0", flashinfer_ok=True)
    fi = next(c for c in plan(prof, with_fi, PlanConfig()).candidates if c.variant.name == "nvfp4")
    assert any(n.startswith("nvfp4 on sm_120 (FP4 tensor cores): W4A4 through flashinfer's FP4 GEMM") for n in fi.notes)


def test_on_a_4090_the_plan_names_the_w4a16_path_and_its_cost() -> None:
    out = CliRunner().invoke(app, ["plan", "Qwen3.8-27B", "--hardware", str(HW / "1x-rtx4090.json")], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    text = " ".join(out.output.split())
    assert " ok nvfp4 " in f" {text}"
    gib = f"{find_profile('Qwen3.8-27B').variant('nvfp4').size / 2**30:.1f} GiB"
    assert ("nvfp4 on sm_89 (no FP4 tensor cores): the Triton W4A16 path" in text
            and f"weights stay 4.5 bits: {gib} resident, {gib} read per decode step" in text)
    assert "no nvfp4 kernels yet" not in text



def test_an_nvfp4_moe_on_a_4090_runs_its_experts_through_the_fused_kernel() -> None:
    """Qwen3-Coder-30B-A3B on a 4090, GPU only: the NVFP4 experts have the fused (weight-only) kernel, so the 4.5-bit
    release ranks by its bits, above the 4-bit AWQ one, and the plan says which path the linears take. (With
    experts in host RAM allowed, Q4_K_M with 2 layers' experts in RAM ranks above both: tests/test_plan_offload.py.)"""
    p = plan(find_profile("Qwen3-Coder-30B-A3B-Instruct"), Probe.load(HW / "1x-rtx4090.json"),
             PlanConfig(experts_in_ram=False))
    assert p.chosen is not None and p.chosen.variant.name == "nvfp4"
    assert any(n.startswith("nvfp4 MoE experts: our fused Triton kernel is verified only under") for n in p.chosen.notes)
    assert any(n.startswith("nvfp4 on sm_89 (no FP4 tensor cores): the Triton W4A16 path") for n in p.chosen.notes)
