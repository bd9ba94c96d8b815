#!/usr/bin/env bash
# The CUDA path of kvstrata checked on one GPU, in one go, into one JSON report.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default: $OUT, else ./gpu_check_out)
#
# 1. finds a Python whose torch sees CUDA ($PYTHON, .venv/bin/python, python3),
#    uses kvstrata from this checkout (PYTHONPATH=src, nothing built) and installs
#    what is missing of its dependencies (pip; fails fast without network: then
#    they must be there already, or in a wheelhouse named by $PIP_FIND_LINKS);
# 2. runs the gpu-marked tests (tests/test_cuda_gpu.py, tests/test_transfer.py):
#    exact tokens vs DynamicCache in fp32 at every placement, bf16 within tolerance,
#    device KV peak = resident budget + staging and flat from 4k to 64k, kernels vs
#    references, no host synchronisation in the staging path -> OUT_DIR/gpu_tests.xml;
# 3. runs `kvstrata bench gpu` (pinned vs pageable GB/s vs the link model, decode
#    tok/s at 8k / 32k / 64k with 100 / 25 / 10 % resident, raw and int4 over the
#    link, step time vs the PCIe bound, peak memory), which folds the test results
#    in -> OUT_DIR/gpu_check.json, and prints a summary.
#
# Sized to finish in under 8 minutes on one H100/H200-class GPU: the tests get at
# most 240 s, the benchmark the rest of a 450 s budget (what it could not start in
# time is listed under "skipped" in the report). Exit status: 0 when every test
# passed and every benchmark section ran, 1 otherwise, 2 when there is no CUDA.
#
# GPU_CHECK_CPU_DRY_RUN=1 runs the same flow on a machine without CUDA (the tests
# skip, the benchmark runs at toy sizes on the CPU): a check of this script itself.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT_DIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT_DIR"
TOTAL_S=${GPU_CHECK_BUDGET_S:-450}
TESTS_S=${GPU_CHECK_TESTS_S:-240}
START=$(date +%s)
log() { echo "gpu_check: $*" >&2; }
DRY=${GPU_CHECK_CPU_DRY_RUN:-0}
CUDA_CHECK='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
[ "$DRY" = 1 ] && CUDA_CHECK='import torch'

# -- 1. Python, torch with CUDA, dependencies ----------------------------------------------------
PY=""
for candidate in "${PYTHON:-}" .venv/bin/python python3 python; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c "$CUDA_CHECK" >/dev/null 2>&1; then
        PY=$candidate
        break
    fi
done
if [ -z "$PY" ]; then
    log "FAILED: no Python with a CUDA-enabled torch that sees a GPU (tried \$PYTHON," \
        ".venv/bin/python, python3, python). Set PYTHON=/path/to/python."
    exit 2
fi
log "python: $PY ($("$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "(no GPU)")'))"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

# module -> requirement; triton is optional (without it the fused dequant tests skip
# and the decode falls back to torch ops, which the report shows)
REQUIRED="transformers:transformers>=5.0,<6 safetensors:safetensors>=0.4 rich:rich>=13
numpy:numpy>=1.26 sortedcontainers:sortedcontainers>=2.4 tqdm:tqdm>=4.66 xxhash:xxhash>=3
prometheus_client:prometheus-client>=0.20 pytest:pytest>=8"
OPTIONAL="triton:triton>=3.0"
missing() {
    for pair in $1; do
        "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('${pair%%:*}') is None)" \
            || printf '%s\n' "${pair#*:}"
    done
}
mapfile -t NEED < <(missing "$REQUIRED")
mapfile -t WANT < <(missing "$OPTIONAL")
if [ ${#NEED[@]} -gt 0 ] || [ ${#WANT[@]} -gt 0 ]; then
    log "installing: ${NEED[*]} ${WANT[*]}"
    "$PY" -m pip install --quiet --retries 0 --timeout 10 "${NEED[@]}" "${WANT[@]}" 2>&1 | tail -3 \
        || true
    mapfile -t NEED < <(missing "$REQUIRED")
    if [ ${#NEED[@]} -gt 0 ]; then
        log "FAILED: missing and not installable here: ${NEED[*]}"
        exit 1
    fi
    mapfile -t WANT < <(missing "$OPTIONAL")
    [ ${#WANT[@]} -eq 0 ] || log "note: ${WANT[*]} not installed: the fused dequant tests skip"
fi
# build the native CPU kernels now (a few seconds; used by the host-side codecs)
"$PY" -c "from kvstrata import _native; print('native kernels:', _native.available())" >&2

# -- 2. gpu-marked tests -------------------------------------------------------------------------
log "tests (at most ${TESTS_S}s)"
timeout "$TESTS_S" "$PY" -m pytest -p no:cacheprovider -o addopts="-q -ra" -m gpu \
    tests/test_cuda_gpu.py tests/test_transfer.py --junitxml "$OUT_DIR/gpu_tests.xml" \
    2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -40
TESTS_RC=${PIPESTATUS[0]}
[ "$TESTS_RC" -eq 124 ] && log "FAILED: the tests ran past ${TESTS_S}s (junit may be partial)"
log "tests exit status: $TESTS_RC"

# -- 3. benchmarks (+ the test results) into one JSON --------------------------------------------
ELAPSED=$(( $(date +%s) - START ))
BENCH_S=$(( TOTAL_S - ELAPSED ))
[ "$BENCH_S" -lt 60 ] && BENCH_S=60
log "bench gpu (budget ${BENCH_S}s)"
BENCH_ARGS=()
[ "$DRY" = 1 ] && BENCH_ARGS=(--quick --device cpu --dtype fp32)
timeout $(( BENCH_S + 90 )) "$PY" -m kvstrata.cli bench gpu "${BENCH_ARGS[@]}" --budget-s "$BENCH_S" \
    --tests-junit "$OUT_DIR/gpu_tests.xml" --out "$OUT_DIR/gpu_check.json" \
    2>&1 | tee "$OUT_DIR/gpu_bench.log" | tail -60
BENCH_RC=${PIPESTATUS[0]}
[ "$BENCH_RC" -eq 124 ] && log "FAILED: the benchmark ran past its time limit"

log "report: $OUT_DIR/gpu_check.json ($(( $(date +%s) - START ))s in all)"
if [ "$TESTS_RC" -ne 0 ] || [ "$BENCH_RC" -ne 0 ]; then
    log "FAILED (tests: $TESTS_RC, bench: $BENCH_RC)"
    exit 1
fi
log "OK"
