"""Every code block of the README and the docs runs, is checked, or says why not.

A fenced block must name its language. What the test does with it:

- `python`: runs in a fresh interpreter, in a temporary directory (top-level `await`
  allowed). `<!-- docs-test: setup=tiny -->` just before the block first loads the
  embedded model as `model` / `tokenizer` and a prompt as `input_ids` / `prompt_ids`.
- `bash`: every `kvstrata ...` command (pipes and `\\` continuations followed) is parsed
  by kvstrata's own parser with the empty-value check, every `make X` names a target of
  the Makefile, every `pip install '.[a,b]'` names extras of pyproject.toml. Then the
  block either runs (`<!-- docs-test: run -->`: bash in a temporary directory) or says
  why it cannot (`<!-- docs-test: skip REASON -->`, still checked as above).
- `text` (diagrams, a command's printed output), `json`, `yaml`: not code.
- `<!-- docs-test: skip REASON -->` skips a block; the reason is required (a server that
  must be running, a GPU, vLLM's own virtualenv...).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
NOT_CODE = {"text", "json", "yaml"}
MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")

TINY_SETUP = """\
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from kvstrata.workload.zoo import default_model_dir

tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
input_ids = tokenizer("def fibonacci(n):\\n", return_tensors="pt").input_ids
prompt_ids = input_ids
"""
SETUPS = {"tiny": TINY_SETUP}
RUNNER = """\
import ast, asyncio, sys
source = sys.stdin.read()
code = compile(source, "<docs block>", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
result = eval(code, {"__name__": "__main__"})
if asyncio.iscoroutine(result):
    asyncio.run(result)
"""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    code: str
    marker: str  # the docs-test marker just before the block, "" if none

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    found = []
    for path in DOC_FILES:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            fence = FENCE.match(lines[i])
            if not fence:
                i += 1
                continue
            indent, lang = fence.groups()
            start = i
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i][len(indent) :])
                i += 1
            before = next((s for s in reversed(lines[:start]) if s.strip()), "")
            marker = MARKER.fullmatch(before.strip())
            found.append(
                Block(path, start + 1, lang, "\n".join(body) + "\n", marker[1] if marker else "")
            )
            i += 1
    return found


ALL = blocks()


def _commands(code: str) -> list[str]:
    """The block's shell commands, continuations and quoted newlines joined, comments
    dropped."""
    text = code.replace("\\\n", " ")
    out, pending = [], ""
    for line in text.splitlines():
        pending += line + "\n"
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on
            continue
        pending = ""
        if words:
            out.append(shlex.join(words))
    assert not pending, f"unclosed quote in: {pending!r}"
    return out


def _segments(command: str) -> list[list[str]]:
    """A command line's commands (split at |, &&, ;, &) as word lists, environment
    assignments dropped."""
    words = shlex.split(command)
    segments: list[list[str]] = [[]]
    for word in words:
        if word in ("|", "||", "&&", ";", "&"):
            segments.append([])
        elif word.endswith(";"):  # `for i in 1 2; do`
            segments[-1].append(word[:-1])
            segments.append([])
        else:
            segments[-1].append(word)
    return [
        [w for i, w in enumerate(seg) if not (re.fullmatch(r"\w+=.*", w) and i == 0)]
        for seg in segments
        if seg
    ]


def _check_kvstrata(words: list[str], where: str) -> None:
    from kvstrata.cli import UsageError, build_parser, check_no_empty_values

    if words == ["--version"]:
        return
    parser = build_parser()
    parser.argv = tuple(words)
    try:
        args = parser.parse_args(words)
    except UsageError as exc:
        pytest.fail(f"{where}: `kvstrata {shlex.join(words)}`: {exc}")
    assert isinstance(args, argparse.Namespace)
    check_no_empty_values(args)


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([\w-]+):", text, flags=re.M))


def _extras() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+) = \[", section, flags=re.M))


def _check_shell(block: Block) -> None:
    targets, extras = _make_targets(), _extras()
    for command in _commands(block.code):
        for words in _segments(command):
            head, rest = words[0], words[1:]
            if head == "kvstrata":
                _check_kvstrata(rest, block.id)
            elif head == "make":
                for target in (w for w in rest if "=" not in w and not w.startswith("-")):
                    assert target in targets, f"{block.id}: no Makefile target {target!r}"
            elif head == "pip" and rest[:1] == ["install"]:
                for spec in rest[1:]:
                    named = re.search(r"\[([\w,-]+)\]", spec)
                    for extra in named[1].split(",") if named else ():
                        assert extra in extras, f"{block.id}: no extra {extra!r} in pyproject"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@pytest.mark.parametrize("block", ALL, ids=[b.id for b in ALL])
def test_block_names_its_language(block: Block) -> None:
    assert block.lang in {"python", "bash"} | NOT_CODE, (
        f"{block.id}: a fenced block names its language (python, bash, text, json, yaml)"
    )


RUNNABLE = [b for b in ALL if b.lang in ("python", "bash")]


@pytest.mark.slow
@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_block_runs(block: Block, tmp_path: Path) -> None:
    if block.lang == "bash":
        _check_shell(block)  # a skipped block too: its commands must still be right
    if block.marker.startswith("skip"):
        reason = block.marker[len("skip") :].strip()
        assert reason, f"{block.id}: `docs-test: skip` needs a reason"
        pytest.skip(f"{block.id}: {reason}")
    if block.lang == "bash":
        assert block.marker == "run", (
            f"{block.id}: a bash block runs (<!-- docs-test: run -->) or says why not "
            "(<!-- docs-test: skip REASON -->)"
        )
        argv, source = ["bash", "-euo", "pipefail", "-c", block.code], None
    else:
        setup = ""
        if block.marker:
            name = block.marker.removeprefix("setup=")
            assert name in SETUPS, f"{block.id}: unknown docs-test marker {block.marker!r}"
            setup = SETUPS[name]
        argv, source = [sys.executable, "-c", RUNNER], setup + block.code
    done = subprocess.run(
        argv, input=source, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, f"{block.id} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_the_shell_check_catches_a_wrong_flag_target_and_extra() -> None:
    """The checks above can fail: a planted bad flag, make target and extra each do."""
    from kvstrata.core.errors import ConfigError

    for code in (
        "kvstrata plan --model llama-2-7b --contxt 8k\n",
        "make tset\n",
        "pip install '.[serev]'\n",
        "cat x | kvstrata generate --prompt-file - --max-new-tokens ''\n",
    ):
        block = Block(ROOT / "README.md", 0, "bash", code, "")
        with pytest.raises((pytest.fail.Exception, AssertionError, ConfigError)):
            _check_shell(block)
