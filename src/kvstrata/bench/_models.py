"""The model a server bench runs when none is named (smollm2 where its package is
installed, else the embedded tiny model, said in one line), and the real text its
prompts are cut from."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvstrata.core.errors import KvstrataError


def bench_model(name: str | None, say: Callable[[str], None]) -> tuple[str, Path]:
    """(name, directory) of `name`, or of the default: smollm2, else tiny."""
    from kvstrata.workload.zoo import EMBEDDED_NAMES, resolve_model_dir

    if name is not None:
        return name, resolve_model_dir(name)
    try:
        return "smollm2", resolve_model_dir("smollm2")
    except KvstrataError as exc:
        say(f"smollm2 is not available ({exc}); using the tiny embedded model")
        return EMBEDDED_NAMES[0], resolve_model_dir(EMBEDDED_NAMES[0])


def heldout_ids(tokenizer: Any, need: int) -> list[int]:
    """At least `need` token ids of the embedded model's held-out stdlib files (all of
    them when they hold fewer), tokenized file by file in their listed order."""
    from kvstrata.workload.zoo import heldout_files

    ids: list[int] = []
    for path in heldout_files("default"):
        text = path.read_text(errors="replace")
        ids += tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) >= need:
            break
    return ids
