#!/usr/bin/env bash
# GPU check, for a machine with torch, triton, transformers, safetensors and numpy, a CUDA device, and no
# network: runs from a copy of this working tree (nothing pip-installed; the engine imports
# without the HTTP stack). Under 8 minutes.
#   1. pytest -m gpu tests/test_gpu.py: our logits against transformers in bf16 (torch and triton backends),
#      the Triton kernels in bf16 against their torch twins, CUDA-graph replay == eager logits, engine greedy
#      batched == alone, graphs == eager; then tests/kernels' kernel tests, compiled for the GPU.
#   2. blocks, each printing one JSON object that lands in the report under the block's name:
#      gpu_decode (agentbox/bench/gpu_decode.py): decode tok/s at batch 1 and 32 on a random-weight model of
#      Qwen3-8B's shape for each attention backend with CUDA graphs off and on, transformers' generate in the
#      same run, and the share of the memory-bandwidth ceiling reached at batch 1.
#      Other checks append their own `block NAME SECONDS COMMAND...` line (see "blocks" below).
# A small pure-Python package the tree needs and the machine lacks (gguf, pytest and its helpers; psutil,
# abi3 x86_64; fla-core and einops: flash-linear-attention's Gated DeltaNet kernels, the `gpu` extra's, checked
# by tests/test_gpu_fla.py) is unpacked from scripts/wheels/ into a temporary folder, never into the machine's Python.
# Usage: scripts/gpu_check.sh            (PYTHON=... to pick the interpreter; the JSON report also lands
#        in $OUT/gpu_check.json when OUT is set)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
extra="$(mktemp -d)"
trap 'rm -rf "$extra"' EXIT
# A copy of the tree, run from there so `python -m` finds it.
tree="$extra/tree"
mkdir -p "$tree"
cp -r "$repo/agentbox" "$repo/tests" "$repo/pyproject.toml" "$tree/"
cd "$tree"
export PYTHONPATH="$tree:$extra${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONDONTWRITEBYTECODE=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

run() {
    echo "+ $*" >&2
    "$@"
}

run "$PY" -c 'import sys, torch, transformers, safetensors, numpy
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"{torch.cuda.get_device_name(0)}")'

# module to import : wheel file prefix in scripts/wheels
for pair in gguf:gguf psutil:psutil pytest:pytest pluggy:pluggy iniconfig:iniconfig einops:einops fla:fla_core; do
    mod="${pair%%:*}"
    whl_prefix="${pair##*:}"
    if ! "$PY" -c "import $mod" 2>/dev/null; then
        whl="$(ls "$repo"/scripts/wheels/"$whl_prefix"-*.whl 2>/dev/null | head -n 1 || true)"
        if [[ -z "$whl" ]]; then
            echo "error: python module '$mod' is missing and scripts/wheels has no wheel for it" >&2
            exit 1
        fi
        run "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$whl" "$extra"
    fi
done
# pytest's extra needs on Python 3.10 (both are in the standard library from 3.11).
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
    for pair in tomli:tomli exceptiongroup:exceptiongroup; do
        mod="${pair%%:*}"
        if ! "$PY" -c "import $mod" 2>/dev/null; then
            run "$PY" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
                "$(ls "$repo"/scripts/wheels/"${pair##*:}"-*.whl | head -n 1)" "$extra"
        fi
    done
fi
run "$PY" -c 'import agentbox.engine.llm, agentbox.bench.gpu_decode, agentbox.bench.gpu_hybrid, agentbox.bench.gpu_spec, agentbox.bench.gpu_deepseek_v4, agentbox.bench.gpu_mtp, agentbox.kernels.paged_decode
print("engine and kernels import without the HTTP stack")'

# Every gpu-marked test of the suite: bf16 logits of the dense, MoE (bf16 / FP8 / AWQ / GPTQ / GGUF / MXFP4
# experts) and quantised models against their fp32 twins, CUDA graphs, the attention backends.
run timeout 120 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/
# The kernel tests against their torch twins, compiled for the GPU this time (on CPU they run interpreted).
run timeout 70 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_kernels_*.py tests/kernels/test_graph_runner.py
# Fused MoE over quantised experts (int4, k-bit, FP8 block, MXFP4), the dense w4a16 / wbits / w8a16 kernels they share a
# decoder with, and FP8 w8a8 (fp8 dots: sm_89+, the H200 has them), all compiled for the GPU.
run timeout 60 "$PY" -m pytest -q -p no:cacheprovider tests/quant_kernels/test_kernels_fused_moe_quant.py \
    tests/quant_kernels/test_kernels_fused_moe_bits.py \
    tests/quant_kernels/test_kernels_w4a16.py::test_w4a16_matches_its_twin \
    tests/quant_kernels/test_kernels_w4a16.py::test_w4k_reads_q4_k_scales_exactly \
    tests/quant_kernels/test_kernels_wbits.py::test_wbits_matches_its_twin \
    tests/quant_kernels/test_kernels_w8a16.py::test_w8a16_matches_its_twin tests/quant_kernels/test_kernels_w8a8.py

# ---- blocks: each prints one JSON object; the report is {name: object}, in the order they ran ----
results="$extra/results"
mkdir -p "$results"
block() {  # block NAME SECONDS COMMAND...
    local name="$1" limit="$2"
    shift 2
    echo "+ [$name] $*" >&2
    timeout "$limit" "$@" >"$results/$(printf '%02d' "$(ls "$results" | wc -l)")-$name.json"
}

block gpu_decode 110 "$PY" -m agentbox.bench.gpu_decode
# MoE (issue 14): bf16 logits of tiny Qwen3-MoE and gpt-oss against transformers, the fused-MoE kernel
# against its twin at Qwen3-30B-A3B's expert shape, decode tok/s at batch 1 and 16 (random 4-layer model).
block gpu_moe 60 "$PY" -m agentbox.bench.gpu_moe
# Quantised experts (issue 14): int4 / FP8 block / MXFP4 fused-MoE kernels against the same kernel on bf16
# experts at Qwen3-30B-A3B's and gpt-oss-20b's expert shapes, 1 and 16 tokens (agentbox/bench/gpu_moe_quant.py).
block moe_quant 45 "$PY" -m agentbox.bench.gpu_moe_quant
# MLA (issue 23): tiny GLM-4.7-Flash bf16 logits against transformers (torch and triton backends), the Triton
# MLA decode kernel against its twin at the real shape, decode tok/s at batch 1 and 8 (random 4-layer model).
block gpu_mla 90 "$PY" -m agentbox.bench.gpu_mla
# Hybrid models (issue 22): a random Qwen3.6-35B-A3B-shaped model with 4 of its 40 layers (3 Gated DeltaNet +
# 1 gated attention), bf16 logits against transformers' torch path (fp32 and bf16), decode tok/s at batch 1
# and 8 (agentbox/bench/gpu_hybrid.py; the tiny hybrids' bf16 logits are in `pytest -m gpu` above). It writes
# and reads back about 9 GB of bf16 weights (a dry run at a small shape on CPU ran the same code path).
block hybrid 200 "$PY" -m agentbox.bench.gpu_hybrid
# Speculative decoding (issue 25): greedy with drafts == without in bf16 with CUDA graphs (also in `pytest -m
# gpu`: tests/test_gpu_spec.py), and a verify of k = 4, 8, 16 drafts against a decode step (graph replay and
# eager) on Qwen3-8B's shape with 8 of its 36 layers (agentbox/bench/gpu_spec.py; a CPU dry run ran the same code).
block gpu_spec 90 "$PY" -m agentbox.bench.gpu_spec
# DeepSeek-V4 (issue 43): a random DeepSeek-V4-Flash-shaped model with 4 of its 43 layers (HCA, CSA, HCA, CSA; 16
# routed experts instead of 256), bf16 logits of a 64- and a 600-token prompt against transformers' torch path
# (fp32 and bf16), decode tok/s at batch 1 (agentbox/bench/gpu_deepseek_v4.py; tests/test_bench_gpu_deepseek_v4.py
# runs the same code at a tiny shape on CPU). About 8 GB of bf16 weights written and read back.
block deepseek_v4 150 "$PY" -m agentbox.bench.gpu_deepseek_v4
# Experts in host RAM (issue 44): tiny Qwen3-MoE with --cpu-moe == experts on the GPU (greedy tokens in fp32,
# logits in fp32 and bf16; also `pytest -m gpu`: tests/test_cpu_moe_gpu.py), then a Qwen3-30B-A3B-shaped random
# Q8_0 GGUF (bench/qwen3_30b_a3b_gguf.py, 2 of its 48 layers, ~1.9 GB written) with --cpu-moe: decode tok/s at batch 1
# and the CPU experts' share of a step (the engine's clock), the experts on the GPU as the baseline in the same run
# (agentbox/bench/gpu_cpu_moe.py; tests/test_cpu_moe.py runs the same code on CPU).
block cpu_moe 150 "$PY" -m agentbox.bench.gpu_cpu_moe
# MTP drafts (issue 45): a random Qwen3.8-27B-shaped model with 4 of its 64 layers, its MTP head trained for 300
# steps on its own greedy continuations, decode tok/s at batch 1 with `--speculative off` and `mtp`, drafts
# accepted a step, tokens the same (agentbox/bench/gpu_mtp.py; tests/test_bench_gpu_mtp.py runs the same code at
# the tiny shape on CPU). About 8 GB of bf16 weights written and read back, 10 GB of fp32 vocab tables to train.
block mtp 150 "$PY" -m agentbox.bench.gpu_mtp
# NVFP4 (issue 48): the Triton W4A16 kernel against dequantise-then-matmul at Qwen3-8B's gate_up shape and an odd K,
# 1 and 32 tokens in bf16, with time and tok/s of the layer next to bf16 F.linear; on sm_100 / sm_120 with flashinfer
# also the FP4 GEMM (W4A4) against both; the fused NVFP4 MoE kernel against its twin at Qwen3-30B-A3B's expert
# shape, 1 and 16 tokens (agentbox/bench/gpu_nvfp4.py; tests/quant_kernels/test_kernels_nvfp4.py runs
# it tiny on CPU). The gpu tests of that file (bf16 W4A16, FP4 GEMM) run in `pytest -m gpu` above.
block nvfp4 90 "$PY" -m agentbox.bench.gpu_nvfp4
# Tensor parallel (issue 11): tp 2 over NCCL against tp 1; needs two GPUs (CPU tests cover tp 2 over gloo).
ngpu="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [[ "$ngpu" -ge 2 ]]; then
    block tp_check 120 "$PY" -m agentbox.bench.tp_check
else
    echo "gpu_check: tp 2 check skipped: $ngpu GPU visible, tensor parallel needs two" >&2
fi
# Other blocks go here, one line each. Time limits so far: 120 + 70 + 60 + 110 + 60 + 45 + 90 + 200 + 90 + 150 + 150 + 150 + 90 = 1385 s
# on one GPU (+ 120 s tp on two), expected well under (most of it Triton compiling on a cold cache); keep it under 8
# minutes.

json="$extra/gpu_check.json"
"$PY" - "$results" >"$json" <<'PYEOF'
import json, pathlib, sys
parts = sorted(pathlib.Path(sys.argv[1]).glob("*.json"))
print(json.dumps({p.stem.split("-", 1)[1]: json.loads(p.read_text()) for p in parts}, indent=2))
PYEOF
cat "$json"
if [[ -n "${OUT:-}" ]]; then
    cp "$json" "$OUT/gpu_check.json"
fi
# ---- tensor parallel (tp engineer): tp 2 over NCCL against tp 1; needs two GPUs ----
echo "gpu_check: all passed" >&2
