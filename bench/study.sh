#!/usr/bin/env bash
# The effectiveness study in the paper's regime (docs/EVALUATION.md, issue #21), end to end:
# `study` world (campaigns of one creative share content, not targeting) -> grace train
# with a code-mode tokenizer (a SID holds a creative's ads) -> build-index -> grace eval
# with the paper's beams, both scorings, fixed-generation cut-offs, the JSON and the PNGs.
# Usage:
#   bench/study.sh OUT_DIR [DEVICE] [EPOCHS]          e.g. bench/study.sh /tmp/study cuda 1
# Knobs (env): ADS (1,000,000), USERS (50,000), EVAL_USERS (5,000), PROFILE (demo model),
# BEAMS ("1 512 1024 1024", the paper's), WORK (/tmp/grace-study: the world, model and
# index, kept between runs), FP8 (1: then also decode FP8_USERS (2,000) users with CD only and
# CD+GTM in FP8 beside the model in FP8_BASE (bfloat16, the served dtype; float32), `grace
# eval --fp8 --dtype`, docs/FP8.md), SET (knobs of the
# `study` profile to override, "KNOB=VALUE ...", e.g. SET="fresh_share=0.3": `grace synth
# --set`), STOP_AFTER (synth, train, index or eval: end there, to split the run over device
# calls: STOP_AFTER=index in the first, the rest in the second), PYTHON.
# Writes OUT_DIR/train.json, OUT_DIR/eval_study.json (OUT_DIR/eval_fp8.json),
# OUT_DIR/plots/*.png and OUT_DIR/study.log (all it printed, appended run after run).
# Each step starts with a "study: grace STEP at TIME" line on stderr; a finished step is
# skipped on a rerun and `grace train` resumes its last state, so the run may span several
# device calls (docs/EVALUATION.md). A CPU smoke run: ADS=20000 USERS=2000
# EVAL_USERS=200 PROFILE=tiny BEAMS="1 16 64 64" bench/study.sh /tmp/study-smoke cpu 0.5
set -euo pipefail
out=${1:?output directory}; device=${2:-cpu}; epochs=${3:-1}
py=${PYTHON:-python3}
work=${WORK:-/tmp/grace-study}
ads=${ADS:-1000000}; users=${USERS:-50000}; eval_users=${EVAL_USERS:-5000}
profile=${PROFILE:-demo}; read -r -a beams <<< "${BEAMS:-1 512 1024 1024}"
read -r -a knobs <<< "${SET:-}"; set_args=()
for k in "${knobs[@]}"; do set_args+=(--set "$k"); done
stop_after=${STOP_AFTER:-}
case "$stop_after" in ""|synth|train|index|eval) ;;
    *) echo "study.sh: STOP_AFTER must be synth, train, index or eval, not '$stop_after'" >&2
       exit 2 ;;
esac
mkdir -p "$out" "$work"
# everything the run prints also goes to OUT_DIR/study.log, so a call cut at its time limit
# keeps what its steps said
exec > >(tee -a "$out/study.log") 2> >(tee -a "$out/study.log" >&2)
grace() { echo "study: grace $1 at $(date -u +%H:%M:%S)" >&2; "$py" -m cli "$@"; }
stop() { [ "$stop_after" != "$1" ] || { echo "study: stopped after $1 (STOP_AFTER)" >&2; exit 0; }; }
[ -f "$work/world/world.json" ] || grace synth --profile study --seed 0 --ads "$ads" \
    --users "$users" --out "$work/world" --no-jsonl --no-progress "${set_args[@]}"
stop synth
[ -f "$work/model/config.json" ] || grace train --world "$work/world" --out "$work/model" \
    --profile "$profile" --last-token code --device "$device" --epochs "$epochs" \
    --batch-size 256 --lr 1e-3 --eval-users 1000 --no-progress | tee "$out/train.json"
stop train
[ -f "$work/index/CURRENT" ] || grace build-index --catalog "$work/world/catalog.parquet" \
    --tokenizer "$work/model/tokenizer" --out "$work/index" --no-progress
stop index
[ -f "$out/eval_study.json" ] || grace eval --world "$work/world" --index "$work/index" \
    --model "$work/model" --users "$eval_users" --beams "${beams[@]}" --k 10 100 1000 \
    --scoring masked unmasked --fixed 1000 5000 --kway static+dynamic --device "$device" \
    --out "$out/eval_study.json" --plots "$out/plots" --no-progress
stop eval
[ "${FP8:-0}" != 1 ] || [ -f "$out/eval_fp8.json" ] || grace eval --world "$work/world" \
    --index "$work/index" --model "$work/model" --users "${FP8_USERS:-2000}" \
    --beams "${beams[@]}" --k 10 100 1000 --scoring masked --kway "" --fp8 --device "$device" \
    --dtype "${FP8_BASE:-bfloat16}" --out "$out/eval_fp8.json" --no-progress
