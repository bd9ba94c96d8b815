"""`kvstrata` command line. Each subcommand is a module in this package with

    def register(subparsers: argparse._SubParsersAction) -> None

which adds its parser and sets `func=run` (run(args) -> int exit code). Modules are
discovered, so adding a subcommand touches no other file.

Errors a user can fix (ConfigError and friends) print one line and exit 2, no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from kvstrata.errors import ConfigError, KvstrataError, UnsupportedModelError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstrata",
        description="Tiered, paged, compressed KV cache for LLM inference.",
    )
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


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvstrata` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
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
