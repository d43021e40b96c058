#!/usr/bin/env bash
# The balancing table with one process per method on one GPU (issue 27), then one merged table.
# From the repository root of the device copy:
#   OUT_DIR=$OUT NAME=moe_balance_k3_small_e16k2 bash experiments/gpu_checks/moe_balance_parallel.sh
# Each process runs its method's seeds (experiments/moe_balance.py, --time_budget_s=BUDGET: runs that
# would end past it are skipped and listed), with 1/P of the GPU's memory (P = the number of methods);
# they share the GPU, so the table's tokens/s compares nothing. Later calls add seeds or methods with
# --merge --merge_later_wins over the committed files (moe_balance.py's docstring).
# Env: PY (python3), OUT_DIR ($OUT, else /tmp/moe_balance_parallel), NAME (stem of the merged files),
# CONFIG (experiments/configs/moe_balance_k3_small_gpu.py), E (16), K (2), STEPS (1000), SEEDS (0,1,2),
# METHODS (QB exact and histogram, loss-free 1e-3 and 1e-2, Switch aux, none, the seed article's threshold),
# BUDGET (460 s), EXTRA (more flags for every process). Exit status: the merge's.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
OUT_DIR=${OUT_DIR:-${OUT:-/tmp/moe_balance_parallel}}
NAME=${NAME:-moe_balance_parallel}
CONFIG=${CONFIG:-experiments/configs/moe_balance_k3_small_gpu.py}
E=${E:-16}; K=${K:-2}; STEPS=${STEPS:-1000}; SEEDS=${SEEDS:-0,1,2}; BUDGET=${BUDGET:-460}
METHODS=${METHODS:-quantile_exact,quantile_histogram,loss_free,loss_free_1e-2,aux_loss,none,quantile_threshold}
IFS=, read -ra LIST <<< "$METHODS"
FRACTION=$($PY -c "print(f'{0.92 / ${#LIST[@]}:.3f}')")
mkdir -p "$OUT_DIR/runs"
FILES=()
for m in "${LIST[@]}"; do
  XLA_PYTHON_CLIENT_MEM_FRACTION=$FRACTION $PY -m experiments.moe_balance --config="$CONFIG" --num_experts="$E" \
    --top_k="$K" --steps="$STEPS" --seeds="$SEEDS" --methods="$m" --time_budget_s="$BUDGET" ${EXTRA:-} \
    --out="$OUT_DIR/runs" --name="${NAME}_$m" --workdir_root="/tmp/${NAME}_work/$m" --compilation_cache_dir= \
    > "$OUT_DIR/runs/${NAME}_$m.log" 2>&1 &
  FILES+=("$OUT_DIR/runs/${NAME}_$m.json")
done
wait
for m in "${LIST[@]}"; do echo "== $m"; tail -4 "$OUT_DIR/runs/${NAME}_$m.log"; done
EXIST=()
for f in "${FILES[@]}"; do [ -f "$f" ] && EXIST+=("$f"); done
if [ "${#EXIST[@]}" -lt 2 ]; then echo "fewer than 2 result files: ${EXIST[*]}"; exit 1; fi
$PY -m experiments.moe_balance --merge="$(IFS=,; echo "${EXIST[*]}")" --out="$OUT_DIR" --name="$NAME"
