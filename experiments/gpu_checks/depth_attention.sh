#!/usr/bin/env bash
# GPU check of the Pallas depth-attention kernels (issue 26), on one H100 or H200, from the repository root of the
# device copy:  bash experiments/gpu_checks/depth_attention.sh
# 1. pytest -m gpu: the compiled kernel tests (tests/pallas_kernels/depth_attention) and the model's
#    Pallas-vs-XLA depth mixes (unrolled and scanned); then every test of tests/k3jax/ops/test_residuals.py
#    compiled for the GPU (the kept-buffers scan). Log: $OUT_DIR/depth_attention_gpu_tests_<h100|h200>.log.
# 2. (BENCH=1) experiments.bench_depth_attention: the whole stack's depth mixes, xla vs pallas, at K3-small
#    and 1b (SWEEP=1: and the op alone under a few Tuning values): $OUT_DIR/depth_attention_<h100|h200>.{json,md}.
# 3. (TRAIN_SHAPE set, e.g. k3_small) experiments.bench_train --shape=$TRAIN_SHAPE --rows=$TRAIN_ROWS
#    ($TRAIN_ARGS appended): $OUT_DIR/train_step_$TRAIN_SHAPE.{json,md}.
# Env: PY (python3), OUT_DIR ($OUT if set, else experiments/results: set it, or the run overwrites the
# committed pages), TESTS (1), BENCH (1), SWEEP (0), TRAIN_SHAPE (unset),
# TRAIN_ROWS (k3_default,jla), TRAIN_ARGS (""), WORKERS (4). Wheels in .whl/ (experiments/gpu_wheels.txt)
# are installed first when present. Exit status: the first failing step's.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
OUT_DIR=${OUT_DIR:-${OUT:-experiments/results}}
TESTS=${TESTS:-1}
BENCH=${BENCH:-1}
WORKERS=${WORKERS:-4}
mkdir -p "$OUT_DIR"
if compgen -G ".whl/*.whl" > /dev/null; then $PY -m pip install -q --no-deps .whl/*.whl; fi
XDIST=()
if $PY -c "import xdist" 2>/dev/null; then XDIST=(-n "$WORKERS"); fi
rc=0
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[0-9]00' | tr 'H' 'h')
LOG="$OUT_DIR/depth_attention_gpu_tests_${CARD:-gpu}.log"
if [ "$TESTS" = 1 ]; then
{
  echo "# $(date -u +%FT%TZ) $PY -m pytest -q ${XDIST[*]} -m gpu tests/pallas_kernels/depth_attention tests/k3jax/models/test_scan_layers.py"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  $PY -c "import sys, jax, jaxlib; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo '(no git)')"
  $PY -m pytest -q "${XDIST[@]}" -m gpu tests/pallas_kernels/depth_attention tests/k3jax/models/test_scan_layers.py \
    -rs --durations=10 -p no:cacheprovider
  first=$?
  echo "# $PY -m pytest -q tests/k3jax/ops/test_residuals.py (every test, on the GPU backend)"
  $PY -m pytest -q "${XDIST[@]}" tests/k3jax/ops/test_residuals.py -rs --durations=5 -p no:cacheprovider
  second=$?
  exit $(( first != 0 ? first : second ))
} 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
fi
if [ "$BENCH" = 1 ]; then
  SWEEP_FLAG=()
  if [ "${SWEEP:-0}" = 1 ]; then SWEEP_FLAG=(--sweep); fi
  $PY -m experiments.bench_depth_attention "${SWEEP_FLAG[@]}" --out "$OUT_DIR/depth_attention_${CARD:-gpu}" 2>&1 | tail -40
  brc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$brc
fi
if [ -n "${TRAIN_SHAPE:-}" ]; then
  # shellcheck disable=SC2086
  $PY -m experiments.bench_train --shape="$TRAIN_SHAPE" --rows="${TRAIN_ROWS:-k3_default,jla}" ${TRAIN_ARGS:-} \
    --out "$OUT_DIR/train_step_$TRAIN_SHAPE" 2>&1 | tail -30
  brc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$brc
fi
exit "$rc"
