#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the wheels scripts/gpu_check.sh needs on a GPU machine
# that has no network but an older stack: transformers at the version this checkout is
# tested with, and what it checks at import (tokenizers, safetensors, regex; not
# huggingface-hub, whose own dependencies would have to come too: gpu_check.sh says so
# if the machine's is too old). Pure-Python or
# manylinux x86_64 wheels for CPython $GPU_PYTHON (default 3.12). gpu_check.sh installs
# whatever .whl/ holds into a private directory before it checks its requirements.
#
#   scripts/gpu_wheels.sh            # then carry .whl along with the checkout
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
# transformers, and the packages whose versions it checks at import, as installed here
PINS=$("$PY" - <<'PYEOF'
from importlib import metadata
for name in ("transformers", "tokenizers", "safetensors"):
    print(f"{name}=={metadata.version(name)}")
PYEOF
)
mkdir -p .whl
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --dest .whl \
    --python-version "${GPU_PYTHON:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 \
    $PINS "regex>=2025.10.22"
ls -l .whl
