"""Fixtures every test module shares."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hf_models import make_tiny_model_dir


@pytest.fixture(scope="module", autouse=True)
def restore_threads() -> Iterator[None]:
    """Commands and engines pick their own torch thread count (one for tiny models):
    every module gives the next one the count it found."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_thread(restore_threads: None) -> None:
    """Token-by-token forwards of a tiny model are dispatch-bound: one thread is faster
    and steadier on a shared machine."""
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer byte-level Llama saved with its tokenizer (`make_tiny_model_dir`)."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))
