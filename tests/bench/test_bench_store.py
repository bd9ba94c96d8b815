"""Smoke tests of `kvstrata bench prefix` and `kvstrata bench placement` (--quick --json):
the reports carry measured fields and the token checks (no timing assertions)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvstrata.bench import placement as bench_placement
from kvstrata.bench import prefix as bench_prefix


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _args(module, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_prefix_quick_hits_each_tier_and_keeps_tokens(tmp_path, capsys):
    assert bench_prefix.run(_args(bench_prefix, "--quick", "--json", "--dir", str(tmp_path))) == 0
    report = json.loads(capsys.readouterr().out)
    rows = {v["variant"]: v for v in report["variants"]}
    assert set(rows) == {"cold", "warm", "restart", "cold_disk"}
    assert all(v["tokens_identical"] for v in rows.values())
    assert rows["cold"]["hit_tokens_by_tier"] == {} == rows["cold_disk"]["hit_tokens_by_tier"]
    assert sum(rows["warm"]["hit_tokens_by_tier"].values()) == 512
    assert rows["restart"]["hit_tokens_by_tier"] == {"disk": 512}
    assert report["ratios"]["cold/warm"] > 0 and report["ratios"]["cold_disk/restart"] > 0


def test_placement_quick_reports_fractions_per_context(capsys):
    assert bench_placement.run(_args(bench_placement, "--quick", "--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert [r["context"] for r in report["rows"]] == [256, 2048]
    assert report["rows"][1]["blocks"] > report["rows"][0]["blocks"] > 0
    for row in report["rows"]:
        assert row["manager_ms"] > 0 and row["model_step_ms"] > 0
    assert report["growth_vs_blocks"] > 0 and report["fraction_at_largest"] > 0
