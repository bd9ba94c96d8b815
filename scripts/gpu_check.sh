#!/usr/bin/env bash
# The CUDA path of kvstrata checked on one GPU, in one go, into one JSON report.
#
#   scripts/gpu_check.sh [OUT_DIR]        (default: $OUT, else ./gpu_check_out)
#
# 1. finds a Python whose torch sees CUDA ($PYTHON, .venv/bin/python, python3),
#    uses kvstrata from this checkout (PYTHONPATH=src, nothing built) and installs
#    what is missing of its dependencies (pip; fails fast without network: then
#    they must be there already, or in a wheelhouse named by $PIP_FIND_LINKS);
# 2. runs the gpu-marked tests (tests/platform/test_cuda_gpu.py, tests/attention/test_transfer.py):
#    exact tokens vs DynamicCache in fp32 at every placement, bf16 within tolerance,
#    device KV peak = resident budget + staging and flat from 4k to 64k, a 16k-token
#    prefill in bounded memory, kernels vs references, no host synchronisation in the
#    staging path -> OUT_DIR/gpu_tests.xml;
# 3. runs `kvstrata bench gpu` (pinned vs pageable GB/s vs the link model, decode
#    tok/s at 8k / 32k / 64k with 100 / 25 / 10 % resident, raw and int4 over the
#    link, step time vs the PCIe bound, peak memory), which folds the test results
#    in -> OUT_DIR/gpu_check.json (rewritten after every section and measured row,
#    so a run cut short keeps what it measured), and prints a summary.
#
# Time: one absolute deadline, GPU_CHECK_BUDGET_S (default 470 s) after the start,
# under 8 minutes whatever happens: installing and building get at most what is left
# of it, the tests at most GPU_CHECK_TESTS_S (200 s) and never the bench's minimum,
# the benchmark is killed at the deadline less a margin (it stops starting new
# measurements a minute before; what it did not start is listed under "skipped"). If
# a timeout fires, the JSON still gets the tests' summary and "timed_out": true.
# Exit status: 0 when every test passed and every benchmark section ran (on CUDA the
# fused Triton dequant must be installed, enabled, tested and used), 1 otherwise, 2
# when there is no CUDA.
#
# GPU_CHECK_CPU_DRY_RUN=1 runs the same flow on a machine without CUDA (the tests
# skip, the benchmark runs at toy sizes on the CPU): a check of this script itself.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
OUT_DIR=${1:-${OUT:-gpu_check_out}}
mkdir -p "$OUT_DIR"
TOTAL_S=${GPU_CHECK_BUDGET_S:-470}
TESTS_S=${GPU_CHECK_TESTS_S:-200}
BENCH_MIN_S=120  # the tests never eat into this much of the bench's time
MARGIN_S=20      # kept at the end: kill grace, the timed-out JSON, the summary
START=$(date +%s)
DEADLINE=$(( START + TOTAL_S ))
left() { echo $(( DEADLINE - $(date +%s) )); }
# at most $1 seconds, and never past the deadline less the margin (at least 1)
cap() { local n=$(( $(left) - MARGIN_S )); [ "$n" -gt "$1" ] && n=$1; [ "$n" -lt 1 ] && n=1; echo "$n"; }
log() { echo "gpu_check: $*" >&2; }
DRY=${GPU_CHECK_CPU_DRY_RUN:-0}
CUDA_CHECK='import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'
[ "$DRY" = 1 ] && CUDA_CHECK='import torch'
FAILED=0

# -- 1. Python, torch with CUDA, dependencies ----------------------------------------------------
PY=""
for candidate in "${PYTHON:-}" .venv/bin/python python3 python; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if timeout 60 "$candidate" -c "$CUDA_CHECK" >/dev/null 2>&1; then
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

# module -> requirement. triton (the fused dequant, kvstrata[cuda]) is required on CUDA:
# without it the fused dequant tests skip and quantized blocks decode with torch ops
# (the same bounds as pyproject.toml: an older transformers is there but unusable)
REQUIRED="transformers:transformers>=5.24,<6 safetensors:safetensors>=0.8 rich:rich>=13
numpy:numpy>=1.26 sortedcontainers:sortedcontainers>=2.4 tqdm:tqdm>=4.66 xxhash:xxhash>=3
prometheus_client:prometheus-client>=0.20 pytest:pytest>=8"
OPTIONAL="triton:triton>=3.0"
# the requirements of $1 that are not importable at a version they accept, one a line
missing() {
    "$PY" - "$1" <<'PYEOF'
import importlib
import importlib.util
import re
import sys
from importlib import metadata

def version_tuple(text):
    return tuple(int(n) for n in re.findall(r"\d+", text)[:3])

for pair in sys.argv[1].split():
    module, spec = pair.split(":", 1)
    name, _, bounds = re.match(r"([A-Za-z0-9_.-]+)(.*)", spec).group(1, 0, 2)
    try:  # imported, not only found: transformers checks its own dependencies then
        importlib.import_module(module)
        ok = True
    except Exception as exc:  # noqa: BLE001 - any failure makes it unusable
        ok = False
        print(f"gpu_check: import {module} failed: {exc}"[:300], file=sys.stderr)
    if ok:
        try:
            have = version_tuple(metadata.version(name))
        except metadata.PackageNotFoundError:
            have = None
        for op, want in re.findall(r"(>=|<)([0-9.]+)", bounds):
            if have is not None and (have >= version_tuple(want)) != (op == ">="):
                ok = False
    if not ok:
        print(spec)
PYEOF
}
# A wheelhouse carried with the checkout (.whl/: scripts/gpu_wheels.sh fills it for the
# device machine, which has no network): installed into a private directory first.
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    SITE=${GPU_CHECK_SITE:-/tmp/kvstrata-gpu-site}
    log "installing the carried wheels of .whl/ into $SITE"
    for wheel in .whl/*.whl; do  # one at a time: a wheel for another Python is skipped
        timeout -k 5 "$(cap 60)" "$PY" -m pip install --quiet --no-index --no-deps \
            --no-compile --no-cache-dir --upgrade --target "$SITE" "$wheel" 2>&1 | tail -2 \
            || true
    done
    export PYTHONPATH="$PWD/src:$SITE${PYTHONPATH#"$PWD/src"}"
fi
# "${A[@]}" of an empty array is an error under set -u before bash 4.4: ${A[@]+"${A[@]}"}
mapfile -t NEED < <(missing "$REQUIRED")
mapfile -t WANT < <(missing "$OPTIONAL")
if [ ${#NEED[@]} -gt 0 ] || [ ${#WANT[@]} -gt 0 ]; then
    log "installing: ${NEED[*]+${NEED[*]}} ${WANT[*]+${WANT[*]}}"
    timeout -k 5 "$(cap 120)" "$PY" -m pip install --quiet --retries 0 --timeout 10 \
        ${NEED[@]+"${NEED[@]}"} ${WANT[@]+"${WANT[@]}"} 2>&1 | tail -3 || true
    mapfile -t NEED < <(missing "$REQUIRED")
    if [ ${#NEED[@]} -gt 0 ]; then
        log "FAILED: missing and not installable here: ${NEED[*]}"
        exit 1
    fi
fi
mapfile -t WANT < <(missing "$OPTIONAL")
if [ ${#WANT[@]} -gt 0 ]; then
    if [ "$DRY" = 1 ]; then
        log "note: ${WANT[*]} not installed: the fused dequant tests skip"
    else
        log "FAILED: ${WANT[*]} not installed (pip install 'kvstrata[cuda]'): the fused dequant" \
            "cannot run or be tested; carrying on to measure the rest"
        FAILED=1
    fi
fi
# build the native CPU kernels now (a few seconds; used by the host-side codecs)
timeout -k 5 "$(cap 90)" "$PY" -c \
    "from kvstrata.platform import native; print('native kernels:', native.available())" >&2 \
    || log "note: building the native kernels failed or timed out (exit $?); torch ops are used"

# -- 2. gpu-marked tests -------------------------------------------------------------------------
# SIGINT first: pytest stops and still writes its JUnit XML; KILL 10 s later
TESTS_CAP=$(( $(left) - BENCH_MIN_S - MARGIN_S - 10 ))
[ "$TESTS_CAP" -gt "$TESTS_S" ] && TESTS_CAP=$TESTS_S
[ "$TESTS_CAP" -lt 10 ] && TESTS_CAP=10
log "tests (at most ${TESTS_CAP}s)"
rm -f "$OUT_DIR/gpu_tests.xml" "$OUT_DIR/gpu_check.json"
timeout -s INT -k 10 "$TESTS_CAP" "$PY" -m pytest -p no:cacheprovider -o addopts="-q -ra" -m gpu \
    tests/platform/test_cuda_gpu.py tests/attention/test_transfer.py --junitxml "$OUT_DIR/gpu_tests.xml" \
    2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -40
TESTS_RC=${PIPESTATUS[0]}
TESTS_TIMED_OUT=0
if [ "$TESTS_RC" -eq 124 ] || [ "$TESTS_RC" -eq 137 ]; then
    TESTS_TIMED_OUT=1
    log "FAILED: the tests ran past ${TESTS_CAP}s (junit may be partial)"
fi
log "tests exit status: $TESTS_RC"

# -- 3. benchmarks (+ the test results) into one JSON --------------------------------------------
BENCH_HARD=$(( $(left) - MARGIN_S ))   # killed then (TERM, KILL 5 s later)
[ "$BENCH_HARD" -lt 10 ] && BENCH_HARD=10
BENCH_S=$(( BENCH_HARD - 60 ))         # no measurement starts after this
[ "$BENCH_S" -lt 5 ] && BENCH_S=5
log "bench gpu (starts measurements for ${BENCH_S}s, killed after ${BENCH_HARD}s)"
BENCH_ARGS=()
[ "$DRY" = 1 ] && BENCH_ARGS=(--quick --device cpu --dtype fp32)
timeout -k 5 "$BENCH_HARD" "$PY" -m kvstrata.cli bench gpu ${BENCH_ARGS[@]+"${BENCH_ARGS[@]}"} \
    --budget-s "$BENCH_S" --tests-junit "$OUT_DIR/gpu_tests.xml" --out "$OUT_DIR/gpu_check.json" \
    2>&1 | tee "$OUT_DIR/gpu_bench.log" | tail -60
BENCH_RC=${PIPESTATUS[0]}
TIMED_OUT=""
[ "$TESTS_TIMED_OUT" = 1 ] && TIMED_OUT="tests"
if [ "$BENCH_RC" -eq 124 ] || [ "$BENCH_RC" -eq 137 ]; then
    log "FAILED: the benchmark ran past its ${BENCH_HARD}s"
    TIMED_OUT="$TIMED_OUT bench"
fi
if [ -n "$TIMED_OUT" ]; then  # the report as last saved, or a new one: "timed_out": true
    timeout -k 2 "$(( $(left) > 5 ? $(left) - 3 : 2 ))" "$PY" -c \
        'import sys; from kvstrata.bench.gpu import mark_timed_out; mark_timed_out(*sys.argv[1:])' \
        "$OUT_DIR/gpu_check.json" "$OUT_DIR/gpu_tests.xml" $TIMED_OUT \
        || log "could not mark the report as timed out"
fi

log "report: $OUT_DIR/gpu_check.json ($(( $(date +%s) - START ))s in all)"
if [ "$TESTS_RC" -ne 0 ] || [ "$BENCH_RC" -ne 0 ] || [ "$FAILED" -ne 0 ]; then
    log "FAILED (tests: $TESTS_RC, bench: $BENCH_RC, setup: $FAILED)"
    exit 1
fi
log "OK"
