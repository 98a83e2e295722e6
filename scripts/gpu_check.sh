#!/usr/bin/env bash
# GPU check, for a machine with torch, triton, transformers, safetensors and numpy, a CUDA device, and no
# network: runs from this working tree (nothing pip-installed from the network; agentbox imports from the
# tree through PYTHONPATH, and the engine imports without the HTTP stack).
#   1. pytest -m gpu tests/test_gpu.py: our logits against transformers in bf16, engine greedy batched == alone
#   2. python -m agentbox.bench.throughput --gpu: JSON with the bf16 logits check on a tiny random Qwen3 and
#      decode tokens/s at batch 1 and 32 on a random-weight model of Qwen3-8B's shape, built in place.
# A small pure-Python package the tree needs and the machine lacks (gguf, pytest and its helpers; psutil,
# abi3 x86_64) is unpacked from scripts/wheels/ into a temporary folder, never into the machine's Python.
# Usage: scripts/gpu_check.sh            (PYTHON=... to pick the interpreter; the JSON also lands in
#        $OUT/gpu_check.json when OUT is set)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
PY="${PYTHON:-python3}"
extra="$(mktemp -d)"
trap 'rm -rf "$extra"' EXIT
export PYTHONPATH="$repo:$extra${PYTHONPATH:+:$PYTHONPATH}"
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
for pair in gguf:gguf psutil:psutil pytest:pytest pluggy:pluggy iniconfig:iniconfig; do
    mod="${pair%%:*}"
    whl_prefix="${pair##*:}"
    if ! "$PY" -c "import $mod" 2>/dev/null; then
        whl="$(ls scripts/wheels/"$whl_prefix"-*.whl 2>/dev/null | head -n 1 || true)"
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
                "$(ls scripts/wheels/"${pair##*:}"-*.whl | head -n 1)" "$extra"
        fi
    done
fi
run "$PY" -c 'import agentbox.engine.llm, agentbox.bench.throughput; print("engine imports without the HTTP stack")'

run timeout 300 "$PY" -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu.py

json="$extra/gpu_check.json"
run timeout 400 "$PY" -m agentbox.bench.throughput --gpu >"$json"
cat "$json"
if [[ -n "${OUT:-}" ]]; then
    cp "$json" "$OUT/gpu_check.json"
fi
# ---- tensor parallel (tp engineer): tp 2 over NCCL against tp 1; needs two GPUs ----
ngpu="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
if [[ "$ngpu" -ge 2 ]]; then
    run timeout 400 "$PY" -m agentbox.bench.tp_check >"$extra/tp_check.json"
    cat "$extra/tp_check.json"
    if [[ -n "${OUT:-}" ]]; then
        cp "$extra/tp_check.json" "$OUT/tp_check.json"
    fi
else
    echo "gpu_check: tp 2 check skipped: $ngpu GPU visible, tensor parallel needs two (CPU tests cover tp 2 over gloo)" >&2
fi

# MoE (issue 14): bf16 logits of tiny Qwen3-MoE and gpt-oss against transformers, the fused-MoE kernel
# against its torch twin at Qwen3-30B-A3B's expert shape, decode tok/s at batch 1 and 16 of a random
# 4-layer model of that shape. Needs agentbox.kernels importable (the wheel's layout). About a minute.
moe_json="$extra/gpu_moe.json"
run timeout 240 "$PY" -m agentbox.bench.gpu_moe >"$moe_json"
cat "$moe_json"
if [[ -n "${OUT:-}" ]]; then
    cp "$moe_json" "$OUT/gpu_moe.json"
fi
echo "gpu_check: all passed" >&2
