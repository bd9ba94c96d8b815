"""Fixtures of the vLLM backend tests. They run in .venv-vllm (`make venv-vllm`; `make
test` runs them when it exists); the main suite (.venv, no vLLM) never collects this
directory (pyproject's `--ignore`)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM tests run in .venv-vllm (make venv-vllm)")

# Block hashes are seeded from PYTHONHASHSEED: equal in every engine process (restarts).
os.environ.setdefault("PYTHONHASHSEED", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from tests.integrations.vllm.tiny import Engine, build_tiny_llama  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def engine_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Engine(model, **fields) with its stats file in a fresh directory."""

    def make(model: Path, **fields: Any) -> Engine:
        stats = tmp_path_factory.mktemp("stats") / "kvstrata-stats.json"
        return Engine(model, stats, **fields)

    yield make
