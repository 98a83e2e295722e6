#!/usr/bin/env bash
# two SmolLM2 backends behind `agentbox fleet` (16 sessions) vs one backend (8 sessions)
set -u
cd /work/wt-fleet
PY=.venv/bin/python
M=$($PY -c "from agentbox.hub.embedded import embedded_model_path as e; print(e())")
OUT=bench/results/fleet
for i in 1 2; do
  AGENTBOX_HOME=$OUT/h$i $PY -m agentbox.cli serve --model $M --port 1850$i --num-pages 200 --max-model-len 4096 --host-cache-gb 2 || exit 1
done
AGENTBOX_HOME=$OUT/r $PY -m agentbox.cli fleet http://127.0.0.1:18501 http://127.0.0.1:18502 --port 18510 --log $OUT/router.log > $OUT/fleet.out 2>&1 &
FP=$!
sleep 20; cat $OUT/fleet.out
COMMON="--synthetic --turns 4 --turn-spread 0 --scale 0.1 --result-scale 2 --max-context 3000 --wait 0.5 --flatten-tools"
date; $PY -m agentbox.cli bench replay $COMMON --sessions 8 --url http://127.0.0.1:18501 --out $OUT/one-8 > $OUT/one-8.log 2>&1; date
# fresh caches for the fleet run: restart backend 1
AGENTBOX_HOME=$OUT/h1 $PY -m agentbox.cli stop; AGENTBOX_HOME=$OUT/h1 $PY -m agentbox.cli serve --model $M --port 18501 --num-pages 200 --max-model-len 4096 --host-cache-gb 2
sleep 12
date; $PY -m agentbox.cli bench replay $COMMON --sessions 16 --url http://127.0.0.1:18510 --out $OUT/fleet-16 > $OUT/fleet-16.log 2>&1; date
for i in 1 2; do curl -s http://127.0.0.1:1850$i/v1/stats > $OUT/stats-b$i.json; done
kill $FP
for i in 1 2; do AGENTBOX_HOME=$OUT/h$i $PY -m agentbox.cli stop; done
echo done
