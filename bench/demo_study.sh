#!/usr/bin/env bash
# The demo-profile effectiveness study behind docs/EVALUATION.md, end to end:
# world -> train (tokenizer + model) -> index -> grace eval. Usage:
#   bench/demo_study.sh OUT_DIR [DEVICE] [EPOCHS]      e.g. bench/demo_study.sh /tmp/study cuda 2
# Writes OUT_DIR/train.json (held-out metrics) and OUT_DIR/eval_demo.json.
set -euo pipefail
out=${1:?output directory}; device=${2:-cpu}; epochs=${3:-2}
py=${PYTHON:-python3}
work=${WORK:-/tmp/grace-demo-study}
mkdir -p "$out" "$work"
grace() { "$py" -m cli "$@"; }
[ -f "$work/world/world.json" ] || grace synth --profile demo --seed 0 --out "$work/world" --no-progress
grace train --world "$work/world" --out "$work/model" --profile demo --device "$device" \
  --epochs "$epochs" --batch-size 256 --lr 1e-3 --eval-users 1000 --no-progress | tee "$out/train.json"
grace build-index --catalog "$work/world/catalog.parquet" --tokenizer "$work/model/tokenizer" \
  --out "$work/index" --no-progress
grace eval --world "$work/world" --index "$work/index" --model "$work/model" --users 1000 \
  --device "$device" --out "$out/eval_demo.json" --no-progress
