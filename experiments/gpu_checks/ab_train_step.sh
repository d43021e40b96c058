#!/usr/bin/env bash
# bench_train rows of the working tree and of the tree with each lever patch, side by side in one device
# call (issue 26: every lever measured against main in the same call). The device's copy of the repo has
# stale git metadata, so make the patches here and let them travel as untracked files:
#   mkdir -p scratch && git diff main...lever/x > scratch/x.patch
#   PATCHES="scratch/x.patch scratch/y.patch" OUT_DIR=$OUT bash experiments/gpu_checks/ab_train_step.sh
# Variants in order: "main" (the tree as it is), then each patch applied alone (patch -p1) and reverted.
# Per variant: $OUT_DIR/ab_<name>.{json,md} (bench_train's files), then one summary line per variant
# (ms/step median, tokens/s, compile s, peak GiB). A variant is skipped, with a line saying so, when
# fewer than ROW_S seconds of BUDGET_S are left (a 1b row takes ~140 s: ~100 s of it compiling).
# Env: SHAPE (1b), ROWS (like_for_like), STEPS (12), WARMUP (3), BUDGET_S (570), ROW_S (150), PY (python3),
# MEM_FRACTION (0.95: the 1b rows need more than JAX's default 0.75). Wheels in .whl/ are installed first.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
OUT_DIR=${OUT_DIR:-${OUT:-/tmp/ab_train_step}}
BUDGET_S=${BUDGET_S:-570}
ROW_S=${ROW_S:-150}
mkdir -p "$OUT_DIR"
if compgen -G ".whl/*.whl" > /dev/null; then $PY -m pip install -q --no-deps .whl/*.whl; fi
echo "# $(date -u +%FT%TZ) tree $(git rev-parse HEAD 2>/dev/null || echo '(no git)') (stale on the device: name the commit yourself)"
names=(main)
for p in ${PATCHES:-}; do names+=("$p"); done
rc=0
for p in "${names[@]}"; do
  name=$(basename "$p" .patch)
  if (( SECONDS + ROW_S > BUDGET_S )); then echo "skipped $name: ${SECONDS} s of ${BUDGET_S} s used"; continue; fi
  if [ "$p" != main ]; then  # dry run first: a patch that fails half-way would leave the tree changed
    { patch -s -p1 --dry-run < "$p" > /dev/null && patch -s -p1 < "$p"; } || { echo "patch $p does not apply"; rc=1; continue; }
  fi
  XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM_FRACTION:-0.95} $PY -m experiments.bench_train --shape="${SHAPE:-1b}" \
    --rows="${ROWS:-like_for_like}" --steps="${STEPS:-12}" --warmup="${WARMUP:-3}" --out="$OUT_DIR/ab_$name" 2>&1 | tail -2
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  if [ "$p" != main ]; then patch -s -R -p1 < "$p"; fi
done
$PY - "$OUT_DIR" "${names[@]}" <<'EOF'
import json, os, sys
out, names = sys.argv[1], sys.argv[2:]
for p in names:
    name = os.path.basename(p).removesuffix(".patch")
    path = os.path.join(out, f"ab_{name}.json")
    if not os.path.exists(path):
        print(f"{name}: no result")
        continue
    fmt = lambda v: "n/a" if v is None else f"{v:,.1f}"  # noqa: E731
    for r in json.load(open(path))["rows"]:
        print(f"{name} {r['row']}: {fmt(r.get('step_ms_median'))} ms/step, {fmt(r.get('tokens_per_s'))} tokens/s, "
              f"compile {fmt(r.get('compile_s'))} s, peak {fmt(r.get('peak_memory_gib'))} GiB")
EOF
exit "$rc"
