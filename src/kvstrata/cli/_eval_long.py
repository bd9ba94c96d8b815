"""`kvstrata eval needle` and `kvstrata eval greedy` (registered by cli/eval.py).

kvstrata eval needle --model smollm2 --codec int8,fp8,int4 --lengths 1k,2k,4k,8k
kvstrata eval greedy --model smollm2 --codec none,int8,fp8,int4 --prompts 4 --new 256

needle: a 5-digit passkey planted at depths of a haystack of real text (Python's language
reference), asked for at the end; exact-match accuracy per length for the exact cache and
each codec x resident fraction x residual window. greedy: free-running greedy decoding of
held-out prompts with each configuration against the exact cache. Both exit 1 when a
lossless configuration answers differently from the exact cache.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from kvstrata.cli.generate import apply_threads, model_help, parse_threads
from kvstrata.config import BLOCK_SIZE_MAX
from kvstrata.core.errors import ConfigError
from kvstrata.core.units import parse_float, parse_fraction, parse_int, parse_tokens
from kvstrata.workload.zoo import quiet_transformers


@dataclass(frozen=True)
class GridPoint:
    """One cache configuration of a sweep."""

    label: str
    codec: str
    resident: float
    residual: int
    lossless: bool
    budget: int | float | None = None


def _split(values: list[str] | None, default: str) -> list[str]:
    items = [part.strip() for v in (values or [default]) for part in v.split(",")]
    return list(dict.fromkeys(i for i in items if i))


def _nonempty(name: str, values: list[str], given: list[str] | None) -> list[str]:
    if not values:
        raise ConfigError.field(name, ",".join(given or []), "one or more, comma-separated")
    return values


def parse_budgets(values: list[str] | None) -> list[int | float | None]:
    """--attention-budget values: 'none' (exact attention), tokens or a fraction."""
    from kvstrata.config import CacheConfig

    items = _nonempty("attention_budget", _split(values, "none"), values)
    return [
        None if v.lower() == "none" else CacheConfig(attention_budget=v).attention_budget
        for v in items
    ]


def budget_label(budget: int | float | None) -> str:
    if budget is None:
        return ""
    share = f"1/{round(1 / budget)}" if budget < 1 and (1 / budget) % 1 < 1e-9 else f"{budget:g}"
    return f", attend {share}" if budget < 1 else f", attend {_size(budget)} keys"


def parse_grid(args: argparse.Namespace, default_codecs: str) -> list[GridPoint]:
    """codec x resident x residual x attention budget, validated before any model loads."""
    from kvstrata.codecs.registry import get_codec

    codecs = _nonempty("codec", _split(args.codec, default_codecs), args.codec)
    residents = _nonempty("resident", _split(args.resident, "0.1"), args.resident)
    residuals = _nonempty("residual", _split(args.residual, "128"), args.residual)
    fractions = [parse_fraction(r, "resident") for r in residents]
    windows = [parse_tokens(r, "residual", allow_zero=True) for r in residuals]
    budgets = parse_budgets(args.attention_budget)
    points = []
    for codec, budget in itertools.product(codecs, budgets):
        lossless = get_codec(codec, "codec").lossless
        for resident in fractions:
            for residual in windows if not lossless else windows[:1]:
                where = "device" if resident >= 1 else f"{resident:.0%} device"
                label = f"{codec} @ {where}" + (f", residual {residual}" if not lossless else "")
                label += budget_label(budget)
                exact = lossless and budget is None
                points.append(GridPoint(label, codec, resident, residual, exact, budget))
    return points


def _block_size(args: argparse.Namespace) -> int:
    return parse_tokens(args.block_size, "block_size", maximum=BLOCK_SIZE_MAX)


def _load(args: argparse.Namespace) -> tuple[Any, Any]:
    from kvstrata.workload.zoo import load_model

    quiet_transformers()
    model, tokenizer = load_model(args.model)
    apply_threads(model, args.threads)
    return model, tokenizer


def _check_context(model: Any, tokens: int, field: str, value: str) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if isinstance(limit, int) and tokens > limit:
        raise ConfigError.field(
            field, value, f"at most the model's max_position_embeddings ({limit})"
        )


_DISK_DIRS = itertools.count()


def _placement_factory(model: Any, point: GridPoint, block_size: int, disk: str | None) -> Any:
    """context -> CacheConfig fields; each call gets a disk directory of its own, so no
    cache finds the blocks (prefix) an earlier one left on disk."""
    from kvstrata.model.budgets import placement

    def make(context: int) -> dict[str, Any]:
        sub = None if disk is None else f"{disk}/config-{next(_DISK_DIRS)}"
        fields = placement(
            model,
            context,
            codec=point.codec,
            resident=point.resident,
            block_size=block_size,
            residual_tokens=point.residual,
            disk_dir=sub,
        )
        return fields if point.budget is None else {**fields, "attention_budget": point.budget}

    return make


def _console() -> Any:
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160, soft_wrap=False)


def _bar(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", disable=None, leave=False)


def _size(n: int) -> str:
    return f"{n // 1024}k" if n % 1024 == 0 else str(n)


# -- needle ---------------------------------------------------------------------------------
def _depths(args: argparse.Namespace) -> list[float]:
    out = []
    for item in _nonempty("depths", _split(args.depths, "10,30,50,70,90"), args.depths):
        pct = parse_float(item.rstrip("%"), "depths", minimum=0.0)
        if pct > 100:
            raise ConfigError.field("depths", item, "percentages of the haystack, 0-100")
        out.append(pct / 100)
    return out


def _lengths(args: argparse.Namespace) -> list[int]:
    values = _nonempty("lengths", _split(args.lengths, "1k,2k,4k,8k"), args.lengths)
    return [parse_tokens(v, "lengths") for v in values]


def run_needle(args: argparse.Namespace) -> int:
    """Run `kvstrata eval needle`; exit 1 when a lossless configuration answers differently."""
    from kvstrata.quality.needle import needle_cases, needle_sweep
    from kvstrata.workload.prompts import uses_chat

    points = parse_grid(args, "int8,fp8,int4")
    lengths, depths = _lengths(args), _depths(args)
    trials = parse_int(args.trials, "trials", minimum=1)
    seed = parse_int(args.seed, "seed", minimum=0)
    block_size = _block_size(args)
    parse_threads(args.threads)
    model, tokenizer = _load(args)
    for length in lengths:
        _check_context(model, length, "lengths", _size(length))
    cases = needle_cases(tokenizer, lengths, depths, trials, seed=seed, chat=uses_chat(tokenizer))
    with tempfile.TemporaryDirectory(prefix="kvstrata-needle-") as tmp:
        disk = tmp if args.disk else None
        configs = {p.label: _placement_factory(model, p, block_size, disk) for p in points}
        with _bar(len(cases) * (1 + len(configs)), "eval needle") as bar:
            report = needle_sweep(model, tokenizer, cases, configs, progress=bar.update)
    from kvstrata.quality.evaluate import EXACT

    exact_answers = report.answers[EXACT]
    failures = [p.label for p in points if p.lossless and report.answers[p.label] != exact_answers]
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        render_needle(report, points, lengths, depths, trials, failures)
    if failures:
        print(
            f"kvstrata eval: lossless configurations answer differently from the exact cache: "
            f"{', '.join(failures)}",
            file=sys.stderr,
        )
        return 1
    return 0


def render_needle(
    report: Any,
    points: list[GridPoint],
    lengths: list[int],
    depths: list[float],
    trials: int,
    failures: list[str],
) -> None:
    """Accuracy per configuration and length; the cases each configuration missed."""
    from rich.table import Table

    per_length = len(depths) * trials
    table = Table(
        title=f"Passkey retrieval: {len(depths)} depth(s) ({', '.join(f'{d:.0%}' for d in depths)})"
        f" x {trials} trial(s) per length, exact match",
        caption="Δ = accuracy minus the exact cache's, in points, over all lengths",
    )
    table.add_column("config")
    for length in lengths:
        table.add_column(_size(length), justify="right")
    table.add_column("all", justify="right")
    table.add_column("Δ", justify="right")
    from kvstrata.quality.evaluate import EXACT

    exact_all = report.accuracy(EXACT)
    lossless = {p.label: p.lossless for p in points}
    for name in report.answers:
        cells = []
        for length in lengths:
            acc = report.accuracy(name, length)
            cells.append(f"{acc:.0%} ({round(acc * per_length)}/{per_length})")
        acc = report.accuracy(name)
        delta = "-" if name == EXACT else f"{100 * (acc - exact_all):+.1f}"
        label = name if name != EXACT else "exact (DynamicCache)"
        if name in failures:
            label += " [red]NOT EXACT[/]"
        elif lossless.get(name):
            label += " [green](exact)[/]"
        table.add_row(label, *cells, f"{acc:.1%}", delta)
    console = _console()
    console.print(table)
    for name in report.answers:
        missed = [
            f"{_size(c.length)}@{c.depth:.0%}" + (f"#{c.trial}" if trials > 1 else "")
            for ok, c in zip(report.correct(name), report.cases, strict=True)
            if not ok
        ]
        if missed:
            console.print(f"missed by {name}: {', '.join(missed)}", highlight=False)


# -- greedy ---------------------------------------------------------------------------------
def run_greedy(args: argparse.Namespace) -> int:
    """Run `kvstrata eval greedy`; exit 1 when a lossless configuration diverges."""
    from kvstrata.quality.agreement import greedy_agreement
    from kvstrata.quality.evaluate import heldout_windows

    points = parse_grid(args, "none,int8,fp8,int4")
    prompts_n = parse_int(args.prompts, "prompts", minimum=1)
    context = parse_tokens(args.context, "context")
    new = parse_tokens(args.new, "new")
    block_size = _block_size(args)
    parse_threads(args.threads)
    model, tokenizer = _load(args)
    _check_context(model, context + new, "context", f"{args.context} + {args.new} new")
    prompts = heldout_windows(args.model, context, prompts_n, tokenizer=tokenizer)
    with tempfile.TemporaryDirectory(prefix="kvstrata-greedy-") as tmp:
        disk = tmp if args.disk else None
        configs = {
            p.label: _placement_factory(model, p, block_size, disk)(context + new) for p in points
        }
        with _bar(prompts_n * (1 + len(configs)), "eval greedy") as bar:
            report = greedy_agreement(model, prompts, configs, new, progress=bar.update)
    failures = [
        p.label for p in points if p.lossless and report.rows[p.label].identical_runs < prompts_n
    ]
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        from rich.table import Table

        table = Table(
            title=f"Greedy decoding vs the exact cache: {prompts_n} held-out prompt(s) of "
            f"{context} tokens, {new} new tokens each",
            caption="agreement = tokens before the first divergence / tokens generated",
        )
        for col in ("config", "identical runs", "mean tokens to divergence", "agreement"):
            table.add_column(col, justify="left" if col == "config" else "right")
        for name, row in report.rows.items():
            check = " [red]NOT EXACT[/]" if name in failures else ""
            table.add_row(
                name + check,
                f"{row.identical_runs}/{prompts_n}",
                f"{row.mean_prefix:.1f}",
                f"{row.agreement:.1%}",
            )
        _console().print(table)
    if failures:
        print(
            f"kvstrata eval: lossless configurations diverge from the exact cache: "
            f"{', '.join(failures)}",
            file=sys.stderr,
        )
        return 1
    return 0


def _common(p: argparse.ArgumentParser, default_codecs: str) -> None:
    from kvstrata.workload.zoo import CLI_DEFAULT_MODEL

    p.add_argument("--model", default=CLI_DEFAULT_MODEL, help=model_help())
    p.add_argument(
        "--codec",
        action="append",
        help=f"codec of the lower tiers; repeat or comma-separate (default {default_codecs})",
    )
    p.add_argument(
        "--resident",
        action="append",
        help="fraction of the context on the device, rest on the host (default 0.1)",
    )
    p.add_argument(
        "--residual",
        action="append",
        help="newest tokens kept exact with lossy codecs; comma-separate (default 128)",
    )
    p.add_argument("--block-size", default="64", help="tokens per block (default 64)")
    add_budget_option(p)
    p.add_argument(
        "--disk", action="store_true", help="also put half of the cold blocks on a disk tier"
    )
    p.add_argument(
        "--threads", default="auto", help="torch threads: N, or auto (1 for small models)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable JSON output")


def add_budget_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--attention-budget",
        action="append",
        help="query-aware key selection (lossy): keys each decode step attends, as tokens "
        "(1k) or a share of the context (0.125); repeat or comma-separate; 'none' = exact "
        "attention (default none)",
    )


def register_actions(actions: argparse._SubParsersAction) -> None:
    """Add the `needle` and `greedy` actions to `kvstrata eval`."""
    needle = actions.add_parser(
        "needle",
        help="passkey retrieval from long haystacks, per codec and placement",
        description="A 5-digit passkey planted at depths of a haystack of real text, asked "
        "for at the end; exact-match accuracy of the exact cache and each configuration.",
    )
    _common(needle, "int8,fp8,int4")
    needle.add_argument(
        "--lengths", action="append", help="context lengths in tokens (default 1k,2k,4k,8k)"
    )
    needle.add_argument(
        "--depths", action="append", help="needle depths in %% (default 10,30,50,70,90)"
    )
    needle.add_argument("--trials", default="1", help="passkeys per length and depth (1)")
    needle.add_argument("--seed", default="0", help="passkey seed (default 0)")
    needle.set_defaults(func=run_needle)

    greedy = actions.add_parser(
        "greedy",
        help="greedy decoding agreement with the exact cache",
        description="Greedy decoding of held-out prompts with each configuration against "
        "the exact cache: identical runs and tokens before the first divergence.",
    )
    _common(greedy, "none,int8,fp8,int4")
    greedy.add_argument("--prompts", default="4", help="held-out prompts (default 4)")
    greedy.add_argument("--context", default="1024", help="tokens per prompt (default 1024)")
    greedy.add_argument("--new", default="256", help="tokens to generate (default 256)")
    greedy.set_defaults(func=run_greedy)
