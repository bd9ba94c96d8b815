"""`kvstrata bench fleet`: the workload and summaries on made-up records, its flag
errors, and one real small run (tiny model, two `kvstrata serve` replicas, vllm-router,
a real redis-server) checking what it reports — where prompts were found, equal
answers — never timings."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstrata.bench import fleet
from kvstrata.bench.fleet import command
from kvstrata.bench.fleet import report as rep
from kvstrata.bench.fleet import workload as wl
from kvstrata.core.errors import ConfigError
from redis_harness import needs_redis


def args_of(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    fleet.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_workload_is_the_same_for_the_same_seed_and_tenants_share_their_prompt():
    ids = list(range(5000))
    sizes = wl.Sizes(tenants=3, system_tokens=100, question_tokens=5, requests=20, rate=2.0)
    a = wl.build(ids, lambda piece: " ".join(map(str, piece)), sizes, seed=1)
    b = wl.build(ids, lambda piece: " ".join(map(str, piece)), sizes, seed=1)
    assert a == b
    assert [r.tenant for r in a.warmup] == [0, 1, 2]
    assert len(a.measured) == 20 and {r.tenant for r in a.measured} <= {0, 1, 2}
    times = [r.at for r in a.measured]
    assert times == sorted(times) and times[0] == 0.0
    # a tenant's requests share its system prompt; other tenants' prompts differ there
    system = {t: a.warmup[t].prompt.split(wl.QUESTION_HEAD)[0] for t in range(3)}
    for r in a.measured:
        assert r.prompt.startswith(system[r.tenant] + wl.QUESTION_HEAD)
    assert len(set(system.values())) == 3
    assert len({r.prompt for r in a.measured}) == 20  # every question is new
    c = wl.build(ids, lambda piece: " ".join(map(str, piece)), sizes, seed=2)
    assert [r.tenant for r in c.measured] != [r.tenant for r in a.measured]


def _rec(key: str, ttft: float, text: str = "t", error: str | None = None) -> dict:
    return {
        "key": key, "ttft_s": ttft, "text": text, "error": error, "completion_tokens": 4,
        "prompt_tokens": 100, "cached_tokens": 64,
    }  # fmt: skip


def test_summaries_sources_and_equal_texts():
    records = [_rec(f"q{i}", t) for i, t in enumerate([0.1, 0.2, 0.3, 0.4, 1.0])]
    records.append(_rec("q5", math.nan, error="APIError: boom"))
    s = wl.summarize(records, wall_s=2.0)
    assert s["requests"] == 6 and s["errors"] == 1
    assert s["ttft_p50_s"] == pytest.approx(0.3) and s["ttft_p90_s"] > 0.4
    assert s["output_tokens_per_s"] == pytest.approx(20 / 2.0)
    before = {"prompt": 100.0, "hit:device": 10.0, "requests": 1.0}
    after = {"prompt": 1100.0, "hit:device": 410.0, "hit:remote": 300.0, "requests": 9.0}
    assert wl.sources(before, after) == {"device": 400.0, "remote": 300.0, "recomputed": 300.0}
    assert rep.shares({"device": 1.0, "recomputed": 3.0})["recomputed"] == 0.75
    runs = {
        "round_robin": [_rec("a", 1, "x"), _rec("b", 1, "y"), _rec("c", 1, "z")],
        "kv_aware": [_rec("a", 1, "x"), _rec("b", 1, "other"), _rec("c", 1, error="e")],
    }
    same = wl.texts_equal(runs)["kv_aware"]
    assert (same["equal"], same["differ"], same["skipped"]) == (1, 1, 1)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--policies", "round_robin,nope"], "--policies"),
        (["--rate", "0"], "--rate"),
        (["--tenants", "-3"], "--tenants"),
        (["--hold", "0"], "--hold"),
        (["--kv-temperature", "-1"], "--kv-temperature"),
    ],
)
def test_bad_flags_are_one_line_config_errors(argv, flag):
    with pytest.raises(ConfigError, match=flag):
        command._options(args_of(*argv))


def test_the_cli_exits_2_on_a_bad_flag_without_a_traceback():
    done = subprocess.run(
        [sys.executable, "-m", "kvstrata.cli", "bench", "fleet", "--policies", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert "--policies" in done.stderr and "Traceback" not in done.stderr


ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which(
    "vllm-router"
)


@pytest.mark.slow
@needs_redis
@pytest.mark.skipif(ROUTER is None, reason="vllm-router is not installed (kvstrata[fleet])")
def test_a_small_fleet_run_reports_where_prompts_were_found(tmp_path):
    out = tmp_path / "fleet.json"
    argv = [sys.executable, "-m", "kvstrata.cli", "bench", "fleet", "--model", "tiny"]
    argv += ["--replicas", "2", "--tenants", "4", "--system-tokens", "256", "--requests", "10"]
    argv += ["--rate", "2", "--policies", "round_robin,kv_aware,round_robin+remote"]
    argv += ["--json", str(out), "--log-dir", str(tmp_path / "logs")]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["policies"]) == ["round_robin", "kv_aware", "round_robin+remote"]
    assert report["budgets"]["hold_tenants"] == 2  # 4 tenants over 2 replicas
    share = {n: rep.shares(p["measured"]["sources"]) for n, p in report["policies"].items()}
    for name, p in report["policies"].items():
        m = p["measured"]
        assert m["requests"] == 10 and m["errors"] == 0, name
        assert sum(m["per_replica"]) == 10, (name, m["per_replica"])
        assert sum(m["sources"].values()) > 0
    # lossless tiers: every policy's greedy answers are the first policy's
    for name, same in report["texts"].items():
        assert same["differ"] == 0 and same["equal"] == 10, (name, same)
    # kv_aware sends each tenant where its prompt is: little beyond the questions is
    # recomputed; round robin lands requests on replicas that do not hold them
    assert share["kv_aware"]["recomputed"] < 0.2, share
    assert share["kv_aware"]["recomputed"] < share["round_robin"]["recomputed"], share
    # with the shared tier, round robin finds on Redis what another replica computed
    assert share["round_robin+remote"]["remote"] > 0, share
    assert share["round_robin"]["remote"] == 0
    assert "ttft_p90 round_robin / kv_aware" in report["ratios"]
    assert "TTFT p50" in done.stdout and "kv_aware" in done.stdout
    assert "warm-up" in done.stderr  # progress


def test_a_shared_tier_policy_without_redis_names_the_fix(monkeypatch):
    monkeypatch.setattr(command.proc, "redis_available", lambda: False)
    with pytest.raises(ConfigError, match="redis-server"):
        command._options(args_of("--policies", "round_robin,kv_aware+remote"))
    assert command._options(args_of("--policies", "round_robin")).policies == ["round_robin"]
