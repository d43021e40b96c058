#!/usr/bin/env bash
# One train step op by op, k3jax and jla's trainer at the same shape, in one device call (issue 26):
#   OUT_DIR=$OUT bash experiments/gpu_checks/profile_pair.sh
# 1. experiments.profile_step on $K3_CONFIG (default: the 1b shape's like_for_like row, the row with no
#    Block AttnRes or QB, so the gap to jla is the rest of the step) on bench_train's synthetic documents of
#    $DOC_LEN tokens (1000, jla's synthetic_doc_length): $OUT_DIR/profile_$NAME.{json,md}.
# 2. jla's CLI on $JLA_CONFIG with its profiler window (train.profile_start_step, profile_steps=2) and XLA's
#    HLO dump, then profile_step --from_trace on that trace: $OUT_DIR/profile_${NAME}_jla.{json,md}.
# Traces and HLO dumps stay in $WORK (too big to bring back). Env: PY (python3), OUT_DIR ($OUT, else
# experiments/results), NAME (1b_like_for_like_h200), K3_CONFIG, JLA_CONFIG, WORK (/tmp/profile_pair),
# K3_MEM_FRACTION (0.95: the 1b rows need more than JAX's default 0.75), DOC_LEN (1000; 0: the config's corpus). Wheels in .whl/ are installed first.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
OUT_DIR=${OUT_DIR:-${OUT:-experiments/results}}
NAME=${NAME:-1b_like_for_like_h200}
K3_CONFIG=${K3_CONFIG:-experiments/configs/k3_1b_gpu.py:like_for_like}
JLA_CONFIG=${JLA_CONFIG:-experiments/configs/jla_1b_shape.toml}
WORK=${WORK:-/tmp/profile_pair}
mkdir -p "$OUT_DIR" "$WORK"
if compgen -G ".whl/*.whl" > /dev/null; then $PY -m pip install -q --no-deps .whl/*.whl; fi
echo "# $(date -u +%FT%TZ) commit $(git rev-parse HEAD 2>/dev/null || echo '(no git)')"
rc=0
XLA_PYTHON_CLIENT_MEM_FRACTION=${K3_MEM_FRACTION:-0.95} $PY -m experiments.profile_step --config="$K3_CONFIG" \
  --out="$OUT_DIR/profile_$NAME" --trace_dir="$WORK/k3jax_trace" --warmup=1 --timed=3 --steps=2 \
  --doc_len="${DOC_LEN:-1000}" 2>&1 | tail -25
rc=${PIPESTATUS[0]}
rm -rf "$WORK/jla_run" "$WORK/jla_hlo"
XLA_FLAGS="--xla_dump_to=$WORK/jla_hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*" \
  $PY -m jla.cli train --config "$JLA_CONFIG" --set train.max_steps=8 --set train.profile_start_step=5 \
  --set train.profile_steps=2 --set "train.output_dir=\"$WORK/jla_run\"" 2>&1 | grep -v "^WARNING" | tail -8
jrc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$jrc
$PY -m experiments.profile_step --from_trace="$WORK/jla_run/profile" --hlo_dir="$WORK/jla_hlo" --trace_steps=2 \
  --out="$OUT_DIR/profile_${NAME}_jla" 2>&1 | head -40
prc=${PIPESTATUS[0]}; [ "$rc" = 0 ] && rc=$prc
exit "$rc"
