"""`kvstrata bench remote`: the summary maths and report on made-up records, the skip
without redis-server, and one real --quick run (tiny model, a real redis-server, three
`kvstrata serve` processes) checking that it reports what it claims — never timings."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from kvstrata.bench import remote
from kvstrata.bench.remote import command
from kvstrata.bench.remote import report as remote_report
from redis_harness import needs_redis


def args_of(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    remote.add_arguments(parser)
    return parser.parse_args(list(argv))


def _record(ttft: float, text: str = "same", hits: float = 0, recompute: float = 0) -> dict:
    counts = dict.fromkeys((*command.REMOTE_KEYS, "load", "recompute", "read_s", "reads"), 0.0)
    counts.update(hits=hits, recompute=recompute, load=float(hits > 0))
    if hits:
        counts.update(read_s=0.004 * hits, reads=1.0, bytes_read=1000.0 * hits)
    return {
        "ttft_s": ttft, "text": text, "cached_tokens": 64 * hits, "error": None,
        "completion_tokens": 4, "max_tokens": 4, "remote": counts, "load_1m": 1.5,
    }  # fmt: skip


def _out(**records: list[dict]) -> dict:
    kinds = ("A", "cold", "remote", "disk", "slow_cold", "slow_remote")
    out = {
        "scenario": "remote", "model": "tiny", "doc_tokens": 512, "prompt_tokens": 530,
        "repeats": 2, "max_tokens": 4, "delay_ms": 200, "block_tokens": 64, "cores": 2,
        "records": {k: records.get(k, []) for k in kinds}, "load_start": 1.0, "load_end": 2.0,
        "log_dir": "/tmp/logs", "redis_used_bytes": 2**20,
        "slow_link": {"latency_s": 0.2, "bytes_per_s": 1e6, "compute_tok_s": 1000.0,
                      "load": 1.0, "recompute": 2.0, "timeouts": 0.0, "reads": 1.0},
    }  # fmt: skip
    out["summary"] = remote_report.summarize(out)
    return out


def test_summary_ratios_agreement_round_trip_and_verdicts():
    out = _out(
        cold=[_record(2.0), _record(2.2)],
        remote=[_record(0.5, hits=8), _record(0.6, hits=8)],
        disk=[_record(0.9), _record(1.1, text="other")],
        slow_remote=[_record(2.1, recompute=1), _record(2.2, recompute=1)],
        slow_cold=[_record(2.0, recompute=1), _record(2.0, recompute=1)],
    )
    s = out["summary"]
    rows = s["rows"]
    assert rows["cold"]["ttft_s"] == pytest.approx(2.1) and rows["cold"]["vs_cold"] == 1
    assert rows["remote"]["vs_cold"] == pytest.approx(2.1 / 0.55)
    assert rows["remote"]["remote_hits"] == 16 and rows["remote"]["identical"]
    assert rows["disk"]["same_as_cold"] == "1/2" and not rows["disk"]["identical"]
    assert rows["slow_remote"]["decisions_recompute"] == 2
    rt = s["round_trip"]
    assert rt["blocks"] == 16 and rt["ms_per_block"] == pytest.approx(4.0)
    assert rt["bytes_per_block"] == 1000 and rt["mb_per_s"] == pytest.approx(0.25)
    v = s["verdicts"]
    assert v["remote_target_met"] and v["slow_target_met"]
    assert v["slow_vs_cold"] == pytest.approx(2.15 / 2.1 - 1)
    assert s["predicted"] == {"load_s": pytest.approx(0.2 + 8 * 1000 / 1e6), "blocks": 8,
                              "recompute_s": pytest.approx(0.512)}  # fmt: skip
    text = "\n".join(remote_report.report_lines(out))
    assert "B remote hit (A's blocks)" in text and "-> met" in text
    assert "4.000 ms/block" in text and "load average (1 min) at start 1.00" in text


def test_a_slow_speedup_or_different_tokens_miss_the_target():
    out = _out(cold=[_record(2.0)], remote=[_record(1.0, text="x", hits=8)],
               slow_remote=[_record(3.0)])  # fmt: skip
    v = out["summary"]["verdicts"]
    assert not v["remote_target_met"] and not v["slow_target_met"]
    assert "NOT met" in "\n".join(remote_report.report_lines(out))


def test_quick_defaults_and_bad_flags():
    o = command._options(args_of("--quick"))
    assert (o.repeats, o.doc_tokens, o.max_tokens, o.delay_ms, o.link_mb_s) == (1, 512, 4, 300, 2)
    o = command._options(args_of("--link-mb-s", "0"))
    assert (o.repeats, o.doc_tokens, o.max_tokens, o.delay_ms, o.link_mb_s) == (3, 4096, 16, 100, 0)
    from kvstrata.core.errors import ConfigError

    with pytest.raises(ConfigError, match="--repeats"):
        command._options(args_of("--repeats", "0"))


def test_without_redis_server_the_bench_says_so_and_skips(monkeypatch, capsys):
    monkeypatch.setattr(command._redis, "REDIS_SERVER", None)
    assert remote.run(args_of("--quick")) == 0
    assert "skipped: redis-server is not installed" in capsys.readouterr().out


@needs_redis
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("openai") is None, reason="needs openai")
def test_quick_run_reports_what_it_claims(tmp_path, capsys):
    path = tmp_path / "remote.json"
    argv = ["--quick", "--json", str(path), "--log-dir", str(tmp_path)]
    assert remote.run(args_of(*argv)) == 0
    out = json.loads(path.read_text())
    rows, blocks = out["summary"]["rows"], out["doc_tokens"] // 64
    assert set(rows) == {"A", "cold", "remote", "disk", "slow_cold", "slow_remote"}
    assert all(row["complete"] for row in rows.values())
    # greedy tokens of every configuration equal cold B's
    assert all(row["identical"] for row in rows.values()), {
        k: r["same_as_cold"] for k, r in rows.items()
    }
    assert rows["A"]["cached_tokens"] == rows["cold"]["cached_tokens"] == 0
    assert rows["cold"]["remote_hits"] == 0  # a fresh salt: nothing on the server
    # B's hit: the document's blocks came from Redis, in one batched read
    assert (
        rows["remote"]["remote_hits"] >= blocks and rows["remote"]["cached_tokens"] >= 64 * blocks
    )
    rt = out["summary"]["round_trip"]
    assert rt["reads"] == 1 and rt["ms_per_block"] > 0 and rt["bytes_per_block"] > 0
    # after a restart B serves it from its own disk tier, not from Redis
    assert rows["disk"]["cached_tokens"] >= 64 * blocks and rows["disk"]["remote_hits"] == 0
    # the slow link: the cost rule recomputes A's document, never reading it over the
    # slow link (a refused link is re-measured in the background), and the metrics say
    # so and why: the link model's figures and the last lookup's predictions
    slow = rows["slow_remote"]
    assert slow["decisions_recompute"] >= 1 and slow["decisions_load"] == 0
    assert slow["remote_hits"] == 0 and slow["cached_tokens"] == 0
    p, link = out["summary"]["predicted"], out["slow_link"]
    assert link["latency_s"] >= 0.25 and p["load_s"] > p["recompute_s"] > 0
    assert link["last_load_s"] > link["last_recompute_s"] > 0
    text = capsys.readouterr().out
    assert "B_slow, A's doc (slow link)" in text and "ms/block" in text and "target" in text
