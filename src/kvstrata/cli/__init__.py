"""`kvstrata` command line. Each subcommand is a module in this package with

    def register(subparsers: argparse._SubParsersAction) -> None

which adds its parser and sets `func=run` (run(args) -> int exit code). Modules are
discovered, so adding a subcommand touches no other file.

Bad input exits 2 with one line on stderr and no traceback: ConfigError and friends
from the commands, and argparse's own errors (an unknown flag, a missing value, a
value argparse cannot convert), which `OneLineParser` prints without the usage block.
An empty value (`--flag ''`) is refused for every flag.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from typing import NoReturn

from kvstrata.cli import _openmp
from kvstrata.core.errors import ConfigError, KvstrataError, UnsupportedModelError
from kvstrata.core.version import __version__


class UsageError(Exception):
    """argparse could not parse the command line (printed as one line, exit 2)."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (`<prog>: error: <message>`) instead
    of the usage block; its subparsers are OneLineParsers too."""

    argv: tuple[str, ...] = ()  # the command line being parsed (set by main)

    def error(self, message: str) -> NoReturn:
        parser: argparse.ArgumentParser = self
        hint = ""
        if message.startswith("unrecognized arguments: "):
            # argparse reports these from the top parser: find the subcommand's parser
            # and suggest its closest flag.
            import difflib

            parser = _subcommand_parser(self, self.argv)
            flags = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
            first = message.split(": ", 1)[1].split()[0].split("=")[0]
            close = difflib.get_close_matches(first, flags, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
        raise UsageError(parser.prog, f"{message}{hint} (see {parser.prog} --help)")


def _subcommand_parser(
    parser: argparse.ArgumentParser, argv: tuple[str, ...]
) -> argparse.ArgumentParser:
    """The deepest (sub)parser that the words of `argv` select."""
    for word in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if subs and word in subs[0].choices:
            parser = subs[0].choices[word]
    return parser


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="kvstrata",
        description="Tiered, paged, compressed KV cache for LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"kvstrata {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def check_no_empty_values(args: argparse.Namespace) -> None:
    """ConfigError for a flag given an empty value (`--disk-dir ''` would otherwise mean
    the default or the current directory); only --prompt may be blank but not empty."""
    for name, value in vars(args).items():
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and (item == "" or (name != "prompt" and not item.strip())):
                raise ConfigError.field(
                    name, item, "give a value, or leave the flag out for its default"
                )


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvstrata` console script."""
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["serve"]:
        _openmp.spin_briefly()  # before build_parser loads torch (and its OpenMP)
    parser = build_parser()
    parser.argv = tuple(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        print(f"{exc.prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        check_no_empty_values(args)
        code = args.func(args)
    except (ConfigError, UnsupportedModelError) as exc:
        print(f"kvstrata {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KvstrataError as exc:
        print(f"kvstrata {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return int(code or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
