#!/usr/bin/env bash
# The opt-in FP8 step on the lent H200 (docs/FP8.md), in one device call; wheels from
# bench/fetch_gpu_wheels.sh, `. bench/gpu_env.sh` first:
#   1. the FP8 pieces' GPU tests (cuBLASLt's FP8 GEMM, the LayerNorm, bias + GELU and
#      self-attention kernels and the FFN's up GEMM compiled at the paper's widths), the workers' GPU tests
#      (the start gate, SIGUSR1 dumps through MPS) and the stack-dump guard after a cold
#      Triton compile (tests/service/test_stackdump.py);
#   2. the FP8 pieces against the bf16 ops they replace (bench/bench_fp8_gemm.py);
#   3. the decode loop at the paper's shape: the served bf16 row beside the served engine
#      with FP8 on, one run (bench/bench_decoder_loop.py, `graph_fp8`), with their SID
#      overlap on random weights, and both engines' kernel traces (--trace); the FP8 step
#      with the GELU's tanh from exp instead of tanh.approx.f32 (`graph_fp8_exp_tanh`),
#      the up GEMM one program per tile instead of the persistent TMA kernel
#      (`graph_fp8_pointer_up`), the rowwise FFN served before the 1 x 128 one
#      (`graph_fp8_rowwise`) and the up GEMM with its K steps added in fp32
#      (`graph_fp8_promoted`: what cuBLASLt's accumulation would cost it); LOOP_ROWS
#      (comma-separated) runs fewer rows.
#   4. (only when asked: STEPS="ncu") Nsight Compute on the FP8 loop's kernels that are not
#      cuBLASLt GEMMs (bias + GELU, LayerNorm, quantise, self-attention, the Triton up
#      GEMM): DRAM, SM and issue utilisation per kernel and shape (bench/summarize_ncu.py),
#      default configs (GRACE_AUTOTUNE=0: ncu replays every autotuner trial otherwise);
#      NCU_ROWS picks the loop rows (default "graph_fp8 graph_fp8_rowwise"), NCU_TIMEOUT
#      bounds each ncu run (seconds, default 600).
# Usage: [STEPS="tests gemm loop"] bash bench/gpu_fp8.sh OUT
#   -> OUT/gpu_tests.txt, OUT/fp8_gemm_h200.json, OUT/decoder_loop_fp8.json, OUT/ncu_ROW.json
#   STEPS picks the steps (a device call is at most 10 minutes and the three together take
#   about 12: split them over calls; on a fresh machine "gemm" takes over 3 minutes).
set -uo pipefail
OUT=${1:?output directory}
STEPS=${STEPS:-tests gemm loop}
for step in $STEPS; do
    case $step in tests|gemm|loop|ncu) ;; *) echo "gpu_fp8.sh: unknown step '$step' (tests, gemm, loop, ncu)" >&2; exit 2 ;; esac
done
mkdir -p "$OUT"
has() { [[ " $STEPS " == *" $1 "* ]]; }
if has tests; then
python3 -m pytest -q -m gpu tests/kernels/test_fp8.py tests/kernels/test_layer_norm.py \
    tests/kernels/test_fp8_ffn.py tests/kernels/test_self_attention.py \
    tests/bench/test_gelu_fp8_rows.py tests/bench/test_fp8_ffn_baseline.py tests/bench/test_decode_variants.py \
    tests/service/decode/test_step.py \
    tests/service/test_workers.py tests/service/test_stackdump.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -60  # all of it kept
python3 -m pytest -q tests/kernels/test_jit_globals.py 2>&1 | tail -3 | tee -a "$OUT/gpu_tests.txt"
fi
if has gemm; then
python3 bench/bench_fp8_gemm.py --out "$OUT/fp8_gemm_h200.json" 2>&1 | tail -30
fi
if has loop; then
python3 bench/bench_decoder_loop.py --rows "${LOOP_ROWS:-graph_advance,graph_fp8,graph_fp8_pointer_up,graph_fp8_rowwise,graph_fp8_exp_tanh,graph_fp8_promoted}" --no-full \
    --trace --out "$OUT/decoder_loop_fp8.json" 2>&1 | tail -90
fi
if has ncu; then
# one ncu run per row (NCU_ROWS): -c counts launches from the start, warm-up included
for row in ${NCU_ROWS:-graph_fp8 graph_fp8_rowwise}; do
NCU=(ncu --clock-control none -k 'regex:^_(gelu_fp8|layer_norm|quantize|self_attn|fp8_up_gelu|fp8_up_gelu_tma)_kernel'
     -c 300 --section SpeedOfLight --section Occupancy --section LaunchStats
     --section SchedulerStats --section ComputeWorkloadAnalysis --csv --page details
     python3 bench/bench_decoder_loop.py --ads 200000 --rows "$row" --no-full --batches 2)
# ncu itself under the limit: a `timeout` around this script stops the shell, not ncu
GRACE_AUTOTUNE=0 timeout "${NCU_TIMEOUT:-600}" "${NCU[@]}" > "$OUT/ncu_$row.csv" 2> "$OUT/ncu_$row.err"
echo "ncu $row: exit $? (stderr in $OUT/ncu_$row.err)"
python3 bench/summarize_ncu.py "$OUT/ncu_$row.csv" --command "GRACE_AUTOTUNE=0 ${NCU[*]}" \
    --out "$OUT/ncu_$row.json"
done
fi
