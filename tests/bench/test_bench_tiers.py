"""Smoke test of `kvstrata bench tiers --quick --json`: the report has every field
(no timing assertions: the numbers depend on the machine)."""

from __future__ import annotations

import argparse
import json

import pytest

from kvstrata.bench import tiers as bench_tiers
from kvstrata.cli import main
from kvstrata.core.errors import ConfigError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_tiers.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_quick_json_report_has_ratio_fields(tmp_path, capsys):
    assert bench_tiers.run(_args("--quick", "--json", "--dir", str(tmp_path))) == 0
    report = json.loads(capsys.readouterr().out)
    tp = report["throughput"]
    for tier in ("host", "disk"):
        assert {"write_ratio", "read_ratio", "gb_per_s"} <= set(tp[tier])
        assert tp[tier]["write_ratio"] > 0 and tp[tier]["read_ratio"] > 0
    assert "read_layer_x_L_ratio" in tp["disk"]
    assert tp["disk"]["stored_fraction"] == 1.0  # no compression: every byte stored
    assert [row["block_size"] for row in report["sweep"]] == [16, 32, 64, 128, 256, 512]
    assert {"host", "disk"} <= set(report["sweep"][0])
    for tier in ("host", "disk"):
        assert {"p50_us", "p99_us", "std_us"} <= set(report["jitter"][tier])
    pf = report["prefetch"]
    assert 0.0 <= pf["hidden_fraction"] <= 1.0
    assert {"speedup_vs_serial", "transfer_s", "compute_s"} <= set(pf)
    assert list(tmp_path.iterdir()) == []  # the benchmark cleans up its files


def test_quick_o_direct_row_with_cold_reads(tmp_path, capsys):
    argv = ["--quick", "--json", "--dir", str(tmp_path), "--o-direct", "--cold"]
    try:
        assert bench_tiers.run(_args(*argv)) == 0
    except ConfigError as exc:  # tmpfs and some others have no O_DIRECT
        pytest.skip(str(exc))
    tp = json.loads(capsys.readouterr().out)["throughput"]
    assert tp["disk O_DIRECT"]["read_ratio"] > 0 and tp["disk O_DIRECT"]["write_ratio"] > 0
    assert list(tmp_path.iterdir()) == []


def test_cli_prints_tables(tmp_path, capsys):
    assert main(["bench", "tiers", "--quick", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "tier vs raw" in out and "hidden" in out and "p99" in out
