"""Every command and subcommand prints its --help and exits 0 (argparse formats help
strings with %, so a stray "%" in one would crash the whole `--help` of its parent)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kvstrata.cli import build_parser, main


def _command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _command_paths(sub, (*prefix, name))


PATHS = list(_command_paths(build_parser()))


def test_every_command_is_found():
    names = {" ".join(p) for p in PATHS}
    assert {"bench", "bench decode", "bench tiers", "generate", "plan", "eval ppl"} <= names


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "kvstrata")
def test_help_exits_zero(path, capsys):
    with pytest.raises(SystemExit) as info:
        main([*path, "--help"])
    assert info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_building_the_cli_loads_neither_transformers_nor_fastapi():
    """`kvstrata --help` and bad-flag errors stay quick: the commands import transformers
    (seconds) and the server's FastAPI only when they run."""
    code = (
        "import sys; from kvstrata.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('transformers', 'fastapi') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_importing_kvstrata_loads_no_torch():
    """`import kvstrata` is light: torch (and its OpenMP threads) loads when a part that
    needs it is imported, so thread settings made after `import kvstrata` still apply."""
    code = "import sys, kvstrata; kvstrata.parse_size('1GiB'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
