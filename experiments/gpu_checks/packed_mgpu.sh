#!/usr/bin/env bash
# Compiled GPU check of packed documents (segment_ids) in the Mosaic GPU intra kernels (issue 25), on
# one Hopper GPU (H100 or H200), from the repository root of the device copy:
#   bash experiments/gpu_checks/packed_mgpu.sh
# 1. pytest -m gpu: every compiled stage test (TestStagesGPU: intra_fwd and solve_bwd with and without
#    packed documents against the compiled Triton stages, the state passes) and the op tests of
#    TestMosaicGPU with documents against the fp32 recurrence (segment ids through the split, at the
#    tile / chunk edges, each document alone, every loss scale, unbounded gates with documents).
#    Log: $OUT_DIR/kda_packed_mgpu_gpu_tests_<h100|h200>.log.
# 2. (BENCH=1, the default) experiments.gpu_checks.packed_mgpu_bench: fwd + bwd ms of the Mosaic GPU
#    plan with documents, dense and all-Triton at 32x2048x6x128 (K3-small) and 8x4096x16x128:
#    $OUT_DIR/kda_packed_ab_<h100|h200>.{json,md} (its 2026-12-03 H200 run: in git at 4435444; the
#    table with the peers: bench_kda --docs_per_row, results/kda_packed.md).
# Env: PY (python3), OUT_DIR ($OUT if set, else experiments/results), BENCH (1), WORKERS (4: pytest-xdist
# workers when installed), SELECT (the -k expression; FULL=1: every gpu test of tests/pallas_kernels).
# Wheels in .whl/ (experiments/gpu_wheels.txt) are installed first when present. Exit status: pytest's,
# else the benchmark's.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
OUT_DIR=${OUT_DIR:-${OUT:-experiments/results}}
BENCH=${BENCH:-1}
WORKERS=${WORKERS:-4}
SELECT=${SELECT:-"TestStagesGPU or (TestMosaicGPU and (segment or unbounded_gates_match_recurrent))"}
mkdir -p "$OUT_DIR"
if compgen -G ".whl/*.whl" > /dev/null; then $PY -m pip install -q --no-deps .whl/*.whl; fi
XDIST=()
if $PY -c "import xdist" 2>/dev/null; then XDIST=(-n "$WORKERS"); fi
if [ "${FULL:-0}" = 1 ]; then
  TESTS=(-m gpu tests/pallas_kernels)
else
  TESTS=(-m gpu tests/pallas_kernels/kda/test_stages.py tests/pallas_kernels/kda/test_api.py -k "$SELECT")
fi
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o 'H[0-9]00' | tr H h)
LOG="$OUT_DIR/kda_packed_mgpu_gpu_tests_${GPU:-gpu}.log"     # named by the card (h100 / h200)
{
  echo "# $(date -u +%FT%TZ) $PY -m pytest -q ${XDIST[*]} ${TESTS[*]} -rs --durations=25"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null
  $PY -c "import sys, jax, jaxlib; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__)"
  echo "commit $(git rev-parse HEAD 2>/dev/null || echo '(no git)')"
  $PY -m pytest -q "${XDIST[@]}" "${TESTS[@]}" -rs --durations=25 -p no:cacheprovider
} 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
if [ "$BENCH" = 1 ]; then
  $PY -m experiments.gpu_checks.packed_mgpu_bench --out "$OUT_DIR/kda_packed_ab_${GPU:-gpu}" 2>&1 | tee "$OUT_DIR/kda_packed_ab_${GPU:-gpu}.log"
  brc=${PIPESTATUS[0]}
  [ "$rc" = 0 ] && rc=$brc
fi
exit "$rc"
