#!/usr/bin/env bash
# Issue 27 part 2: the depth sweep (experiments/depth_residuals.py) at GPU scale, in device calls of at most
# BUDGET seconds. From the repository root of the device copy:
#   OUT_DIR=$OUT bash experiments/gpu_checks/depth_gpu.sh          # repeat until it prints "sweep complete"
# Every finished (variant, seed) writes result_*.json in WORKDIR; a call copies them to $OUT_DIR/results. Carry
# them into the next call (copy them to WORKDIR here, carry WORKDIR): --reuse skips them, a killed run restarts.
# When every run exists, the call runs the timing pass (each variant alone, TIMING steps) and writes the table.
# Env: PY (python3), OUT_DIR ($OUT), NAME (depth_gpu_L32), WORKDIR (runs/depth_gpu), DEPTHS (32), STEPS (300),
# SEEDS (0,1,2), PARALLEL (5; 6 on an H200), BUDGET (540 s), TIMING (40), EXTRA (more flags).
# Measured (2026-12-05, H100): an unrolled 32-layer run takes 350-440 s, of which its 300 steps are 26-44 s and
# the train step's compile 131-156 s. --scan_layers compiles once per period but ran every worker out of memory
# at 5 per card (20.7 GiB prenorm, 30.1 block_attnres, 65 full_attnres: the scan saves its carry per sublayer;
# unrolled prenorm needs 11.1), so it is not passed. article_block (2 seeds, 4 runs per card) took 160 s each.
# full_attnres unrolled did not log step 10 in 540 s at 2 runs per card; it ran scanned with remat full (one source
# buffer saved per layer): EXTRA="--variants=full_attnres --token_multipliers= --scan_layers --remat=full"
# SEEDS=0,1,2 PARALLEL=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 (2026-12-06, H100: 39.6 GiB with the checkpointed
# scan of then, so one run per card; ~276 s a run, two calls for three seeds; main's scan_source_buffer needs less,
# not measured on a GPU: results/scan_buffer_memory_cpu.md).
# 24 layers (2026-12-06, H100, results/depth_gpu_h100.md): DEPTHS=24 NAME=depth_gpu_L24 WORKDIR=runs/depth_gpu_L24
# EXTRA="--scan_layers --remat=full" PARALLEL=4: every variant but full_attnres (its 49-source mixes run on XLA,
# the kernels take 32), 24-101 s a run at 4 per card (3.2-4.0 GiB device peak; the article's unrolled 8.4), 15
# runs in two calls (~390 s), then the timing pass. Return results as one tarball of $OUT_DIR without the run
# folders (a device call brings back few files). full_attnres at 24 layers (2026-12-06): NAME=depth_gpu_L24_full
# EXTRA="--variants=full_attnres --token_multipliers= --scan_layers --remat=full" PARALLEL=3: 3 runs of 245 s
# at 3 per card (6.4 GiB device peak) and its timing pass in one call (320 s), then
# depth_residuals --merge=results/depth_gpu_L24_h100.json,<its json>.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
OUT_DIR=${OUT_DIR:-${OUT:-/tmp/depth_gpu}}
NAME=${NAME:-depth_gpu_L32}; WORKDIR=${WORKDIR:-runs/depth_gpu}; DEPTHS=${DEPTHS:-32}; STEPS=${STEPS:-300}
SEEDS=${SEEDS:-0,1,2}; PARALLEL=${PARALLEL:-5}; BUDGET=${BUDGET:-540}; TIMING=${TIMING:-40}
SETTINGS=(--depths="$DEPTHS" --d_model=512 --num_heads=8 --head_dim=64 --d_ff=1536 --seq_len=1024 --batch_size=16
          --steps="$STEPS" --learning_rate=1e-3 --warmup_steps=40 --eval_every=100 --eval_batches=4 --dtype=bfloat16
          --seeds="$SEEDS" --token_multipliers=1.25,1.5 --workdir="$WORKDIR"
          --compilation_cache_dir=/tmp/depth_gpu_cache
          ${EXTRA:-})
START=$(date +%s)
mkdir -p "$OUT_DIR/results"
timeout -k 10 "$BUDGET" $PY -m experiments.depth_residuals "${SETTINGS[@]}" --parallel="$PARALLEL" --split_seeds \
  --timing_steps=0 --out="$OUT_DIR/sweep_only" > "$OUT_DIR/sweep.log" 2>&1
RC=$?
cp "$WORKDIR"/result_*.json "$OUT_DIR/results/" 2>/dev/null
grep -E "seed=|reusing|Error|error" "$OUT_DIR/sweep.log" | tail -40
echo "sweep rc=$RC after $(( $(date +%s) - START )) s; $(ls "$OUT_DIR"/results | wc -l) result files"
if [ "$RC" -eq 0 ]; then
  echo "sweep complete"
  LEFT=$(( BUDGET - $(date +%s) + START ))
  timeout -k 10 "$(( LEFT > 60 ? LEFT : 60 ))" $PY -m experiments.depth_residuals "${SETTINGS[@]}" --parallel=1 \
    --split_seeds --timing_steps="$TIMING" --out="$OUT_DIR/$NAME" > "$OUT_DIR/final.log" 2>&1
  echo "final rc=$?"; tail -12 "$OUT_DIR/final.log"
fi
