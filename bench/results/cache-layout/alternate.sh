#!/usr/bin/env bash
# Alternating runs of `agentbox bench warm` and `agentbox bench replay --tiny` on two checkouts (each with its
# own .venv from ./install.sh --dev), so machine drift falls on both alike:
#   bench/results/cache-layout/alternate.sh BASE_CHECKOUT NEW_CHECKOUT ROUNDS OUT_DIR
set -euo pipefail
base=$(cd "$1" && pwd); new=$(cd "$2" && pwd); rounds=$3; out=$(mkdir -p "$4" && cd "$4" && pwd)
replay=(bench replay --tiny --policies session --sessions 8 --turns 8 --turn-spread 0 --scale 0.1 --wait 0.5
        --num-pages 400 --serve-arg=--disk-cache-gb=0)
for i in $(seq 1 "$rounds"); do
  for side in base new; do
    dir=$base; [ "$side" = new ] && dir=$new
    (cd "$dir" && .venv/bin/agentbox bench warm --no-prefill --json-out "$out/warm-$side-$i.json" > /dev/null)
    (cd "$dir" && .venv/bin/agentbox "${replay[@]}" --out "$out/replay-$side-$i" > /dev/null)
    echo "round $i $side done"
  done
done
