"""`agentbox bench llamacpp` on the embedded SmolLM2 GGUF: our CPU kernels are timed and report their resident
bytes; llama.cpp's llama-server is compared when one is found, and named as skipped (with how to get it) when not. No timing
assertions: speed is what the benchmark reports."""

from __future__ import annotations

from pathlib import Path

from agentbox.bench import llama_server
from agentbox.bench.llamacpp import compare_llamacpp
from agentbox.kernels import cpu_gemv


def test_llamacpp_report_shape(smollm2_path: Path) -> None:
    report = compare_llamacpp(str(smollm2_path), prompt_len=8, new_tokens=3, threads=1, repeats=1)
    kernels = {"dense", "int4-cpu"} | ({"cpu-simd"} if cpu_gemv.available() else set())
    assert set(report["ours"]) == kernels
    dense = report["ours"]["dense"]
    assert dense["prefill_tok_s"] > 0
    for name in kernels - {"dense"}:
        packed = report["ours"][name]
        assert packed["decode_tok_s"] > 0
        # SmolLM2's 4-bit layers stay packed: well under the fp32 model's bytes
        assert packed["resident_weight_bytes"] < 0.5 * dense["resident_weight_bytes"]
    # both sides' CPU and instruction sets are named: ours the kernel variant this CPU's flags picked
    ours = report["cpu"]["ours"]
    assert ours["cpu_model"] == cpu_gemv.cpu_model() and set(ours["isa_flags"]) <= cpu_gemv.cpu_flags()
    assert ours["kernel_isa"] == (cpu_gemv.isa().value if cpu_gemv.available() else None)
    binary = llama_server.find_binary()
    if binary is None:
        assert "no llama-server" in report["llama.cpp"]["skipped"] and "ratios" not in report
        assert "skipped" in report["cpu"]["llama.cpp"]
    else:  # llama-server found ($AGENTBOX_LLAMA_SERVER, PATH, or built): timed, and its build named
        assert set(report["ratios"]) == {f"{p}_{k}" for p in ("prefill", "decode") for k in kernels}
        assert report["llama.cpp"]["decode_tok_s"] > 0
        assert report["cpu"]["llama.cpp"]["version"] and report["cpu"]["llama.cpp"]["binary"] == str(binary)
