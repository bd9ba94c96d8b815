"""`kvstrata eval ppl`: perplexity through the tiered cache vs the exact cache.

kvstrata eval ppl --model smollm2 --codec none,int8,fp8,int4 --context 2048
kvstrata eval ppl --model tiny --codec none --resident 1,0.25,0.1 --disk --json

(`eval needle` and `eval greedy` live in cli/_eval_long.py.) Held-out text: the Python
standard library files the embedded model never saw in training (the same files for
every named model; a model directory lists its own in heldout_files.txt).

Every configuration and the exact reference (transformers' DynamicCache + sdpa) run over
the same held-out windows, token by token through the cache, so the figures compare like
with like. A lossless codec must reproduce the exact cache: its row is checked and the
command exits 1 when one is not.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from kvstrata.cli.generate import apply_threads, model_help, parse_threads
from kvstrata.config import BLOCK_SIZE_MAX
from kvstrata.core.errors import ConfigError
from kvstrata.core.units import parse_fraction, parse_int, parse_tokens
from kvstrata.model.budgets import placement
from kvstrata.workload.zoo import quiet_transformers

if TYPE_CHECKING:  # the quality harness loads transformers: imported when a command runs
    from kvstrata.quality.evaluate import Comparison

DEFAULT_CODECS = "none,int8,fp8,int4"


def _positive_int(value: str, field: str, minimum: int = 1) -> int:
    return parse_int(value, field, minimum=minimum)


def _block_size(args: argparse.Namespace) -> int:
    return parse_tokens(args.block_size, "block_size", maximum=BLOCK_SIZE_MAX)


def _residual(args: argparse.Namespace) -> int:
    return parse_tokens(args.residual, "residual", allow_zero=True)


def _fraction(value: str) -> float:
    return parse_fraction(value, "resident")


def _split(values: list[str] | None, default: str) -> list[str]:
    """Repeatable, comma-separated flag values, in order, without duplicates."""
    items = [part.strip() for v in (values or [default]) for part in v.split(",")]
    return list(dict.fromkeys(i for i in items if i))


def _label(codec: str, resident: float, disk: bool) -> str:
    where = "device" if resident >= 1 else f"{resident:.0%} device"
    return f"{codec} @ {where}" + (" + disk" if disk else "")


def parse_grid(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    """The codecs and resident fractions asked for (validated before any model loads)."""
    from kvstrata.codecs.registry import get_codec

    codecs = _split(args.codec, DEFAULT_CODECS)
    residents = _split(args.resident, "0.1")
    for name, values, given in (
        ("codec", codecs, args.codec),
        ("resident", residents, args.resident),
    ):
        if not values:
            raise ConfigError.field(name, ",".join(given or []), "one or more, comma-separated")
    for codec in codecs:
        get_codec(codec, "codec")
    _check_calibration_flag(args, codecs)
    return codecs, [_fraction(r) for r in residents]


def _check_calibration_flag(args: argparse.Namespace, codecs: list[str]) -> None:
    """A calibrated codec (lowrank-*, heads*) needs --calibration, and only then."""
    from kvstrata.codecs.calibration import FIX
    from kvstrata.codecs.registry import is_calibrated

    calibrated = [c for c in codecs if is_calibrated(c)]
    if calibrated and getattr(args, "calibration", None) is None:
        raise ConfigError.field(
            "calibration", None, f"codec {calibrated[0]!r} needs --calibration FILE; {FIX}"
        )


def build_configs(
    model: Any, args: argparse.Namespace, context: int, disk_dir: str | None
) -> tuple[dict[str, dict[str, Any]], dict[str, bool]]:
    """name -> CacheConfig fields, and name -> whether the codec is lossless."""
    from kvstrata.cli._eval_long import budget_label, parse_budgets
    from kvstrata.codecs.registry import get_codec, is_calibrated

    codecs, residents = parse_grid(args)
    block_size = _block_size(args)
    residual = _residual(args)
    configs: dict[str, dict[str, Any]] = {}
    lossless: dict[str, bool] = {}
    for codec, budget in itertools.product(codecs, parse_budgets(args.attention_budget)):
        is_lossless = get_codec(codec, "codec").lossless and budget is None
        for resident in residents:
            name = _label(codec, resident, disk_dir is not None) + budget_label(budget)
            configs[name] = placement(
                model,
                context,
                codec=codec,
                resident=resident,
                block_size=block_size,
                residual_tokens=residual,
                disk_dir=disk_dir,
            )
            if budget is not None:
                configs[name]["attention_budget"] = budget
            if is_calibrated(codec):
                configs[name]["codec_calibration"] = args.calibration
            lossless[name] = is_lossless
    return configs, lossless


def _tiers(kwargs: dict[str, Any], none_block_bytes: int) -> str:
    """'device 256 tok, host int8' — where the window's tokens may live."""
    device_tokens = kwargs["device_budget"] // none_block_bytes * kwargs["block_size"]
    parts = [f"device {device_tokens} tok"]
    if kwargs.get("host_budget"):
        parts.append(f"host {kwargs['host_codec']}")
    if kwargs.get("disk_budget"):
        parts.append(f"disk {kwargs['disk_codec']}")
    return ", ".join(parts)


def lossless_failures(report: Comparison, lossless: dict[str, bool]) -> list[str]:
    """Names of lossless configurations that did not reproduce the exact cache."""
    from kvstrata.quality.evaluate import LOSSLESS_TOLERANCE_PCT

    return [
        name
        for name, res in report.configs.items()
        if lossless.get(name)
        and (abs(res.delta_ppl_pct) > LOSSLESS_TOLERANCE_PCT or res.top1_agreement != 1.0)
    ]


def render(
    report: Comparison, lossless: dict[str, bool], failures: list[str], none_block_bytes: int
) -> None:
    """Print the comparison as a rich table (none_block_bytes sizes the device column)."""
    from rich.console import Console
    from rich.table import Table

    from kvstrata.quality.evaluate import LOSSLESS_TOLERANCE_PCT

    console = Console(width=None if sys.stdout.isatty() else 140, soft_wrap=False)
    table = Table(
        title=f"Perplexity through the cache: {report.num_windows} window(s) x "
        f"{report.context} tokens, {report.exact.num_tokens} predictions",
        caption=f"one token per step through each cache; ΔPPL % = 100 (PPL / exact PPL - 1); "
        f"a lossless row must stay within ±{LOSSLESS_TOLERANCE_PCT:g} % (float rounding) "
        "and agree on every top-1 token",
    )
    for col, justify in (
        ("config", "left"),
        ("tiers", "left"),
        ("PPL", "right"),
        ("bits/byte", "right"),
        ("ΔPPL %", "right"),
        ("top-1 agree", "right"),
        ("check", "left"),
    ):
        table.add_column(col, justify=justify)
    ex = report.exact
    table.add_row(
        "exact (DynamicCache)", "device", f"{ex.ppl:.4f}", f"{ex.bits_per_byte:.4f}", "-", "-", ""
    )
    for name, res in report.configs.items():
        if not lossless.get(name):
            check = "lossy"
        elif name in failures:
            check = "[red]NOT EXACT[/]"
        else:
            check = "[green]exact[/]"
        table.add_row(
            name,
            _tiers(res.cache_kwargs, none_block_bytes),
            f"{res.result.ppl:.4f}",
            f"{res.result.bits_per_byte:.4f}",
            f"{res.delta_ppl_pct:+.4f}",
            f"{res.top1_agreement:.2%}",
            check,
        )
    console.print(table)


def run_ppl(args: argparse.Namespace) -> int:
    """Run `kvstrata eval ppl`; exit 1 when a lossless configuration is not exact."""
    from kvstrata.quality.evaluate import compare, heldout_windows
    from kvstrata.workload.zoo import is_byte_tokenizer, load_model

    context = parse_tokens(args.context, "context")
    if context < 2:
        raise ConfigError.field("context", args.context, "a window of at least 2 tokens")
    num_windows = _positive_int(args.windows, "windows", 1)
    prefill = parse_tokens(args.prefill, "prefill") if args.prefill else 1
    if prefill >= context:
        raise ConfigError.field("prefill", args.prefill, f"fewer tokens than --context {context}")
    parse_grid(args)
    from kvstrata.cli._eval_long import parse_budgets

    parse_budgets(args.attention_budget)
    parse_threads(args.threads)
    _block_size(args)
    _residual(args)
    quiet_transformers()
    model, tokenizer = load_model(args.model)
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and context > limit:
        raise ConfigError.field(
            "context",
            args.context,
            f"at most the model's max_position_embeddings ({limit}) tokens per window",
        )
    apply_threads(model, args.threads)
    if args.calibration is not None:
        from kvstrata.quality.calibrate import check_calibration

        check_calibration(model, args.calibration, "calibration")
    byte_level = is_byte_tokenizer(tokenizer)
    windows = heldout_windows(
        args.model, context, num_windows, tokenizer=None if byte_level else tokenizer
    )

    def bytes_of(ids: list[int]) -> int:
        return len(tokenizer.decode(ids, skip_special_tokens=True).encode())

    with tempfile.TemporaryDirectory(prefix="kvstrata-eval-") as tmp:
        configs, lossless = build_configs(model, args, context, tmp if args.disk else None)
        from tqdm import tqdm

        total = (1 + len(configs)) * sum(len(w) - prefill for w in windows)
        # disable=None: a bar on a terminal, silence in logs and pipes.
        with tqdm(total=total, desc="eval ppl", unit="tok", disable=None, leave=False) as bar:
            report = compare(
                model,
                windows,
                configs,
                context,
                prefill=prefill,
                bytes_of=None if byte_level else bytes_of,
                progress=bar.update,
                score_prefill=prefill == 1,
            )
    failures = lossless_failures(report, lossless)
    if args.json:
        data = report.to_dict()
        for row in data["configs"]:
            row["lossless"] = lossless[row["name"]]
            row["exact_match"] = row["name"] not in failures if row["lossless"] else None
        print(json.dumps(data, indent=2))
    else:
        from kvstrata.codecs.registry import get_codec
        from kvstrata.quality.evaluate import block_layout

        block_size = _block_size(args)
        none_bytes = get_codec("none").block_nbytes(block_layout(model, block_size))
        render(report, lossless, failures, none_bytes)
    if failures:
        print(
            f"kvstrata eval: lossless configurations differ from the exact cache: "
            f"{', '.join(failures)}",
            file=sys.stderr,
        )
        return 1
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `eval` subcommand (with its `ppl`, `needle` and `greedy` actions)."""
    from kvstrata.cli._eval_long import add_budget_option, register_actions
    from kvstrata.workload.zoo import CLI_DEFAULT_MODEL

    p = sub.add_parser(
        "eval",
        help="quality harness: perplexity, passkey retrieval and greedy agreement vs the "
        "exact cache",
        description="Measure what the cache configuration does to model quality.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    ppl = actions.add_parser(
        "ppl",
        help="held-out perplexity, ΔPPL vs DynamicCache and top-1 agreement",
        description="Teacher-forced perplexity, one token per step through the cache, on "
        "held-out text, for each codec and placement, against the exact DynamicCache.",
    )
    ppl.add_argument("--model", default=CLI_DEFAULT_MODEL, help=model_help())
    ppl.add_argument(
        "--codec",
        action="append",
        help=f"codec of the lower tiers; repeat or comma-separate (default {DEFAULT_CODECS})",
    )
    ppl.add_argument(
        "--resident",
        action="append",
        help="fraction of the context on the device, rest on the host; repeat or "
        "comma-separate (default 0.1)",
    )
    ppl.add_argument(
        "--residual", default="128", help="newest tokens kept exact with lossy codecs (128)"
    )
    ppl.add_argument("--block-size", default="64", help="tokens per block (default 64)")
    ppl.add_argument(
        "--disk", action="store_true", help="also put half of the cold blocks on a disk tier"
    )
    ppl.add_argument("--context", default="2048", help="tokens per window (default 2048)")
    ppl.add_argument(
        "--prefill",
        default=None,
        help="tokens of each window fed in one first forward; only "
        "the rest, predicted one step at a time, is scored (default: 1, all scored)",
    )
    add_budget_option(ppl)
    ppl.add_argument("--windows", default="2", help="held-out windows (default 2)")
    ppl.add_argument(
        "--threads", default="auto", help="torch threads: N, or auto (1 for small models)"
    )
    ppl.add_argument(
        "--calibration",
        help="calibration file of the model (`kvstrata calibrate`), for the lossy, opt-in "
        "lowrank[-pre]-r<R>[-int8][+<codec>] and heads<PCT>-<kept>-<other> codecs",
    )
    ppl.add_argument("--json", action="store_true", help="machine-readable JSON output")
    ppl.set_defaults(func=run_ppl)
    register_actions(actions)
