"""`kvstrata bench blend`: its workload (seeded, documents shuffled, the needle in the
asked one), a real quick run on the embedded model checking what it reports — never
timings — and its one-line flag errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from kvstrata.bench import blend
from kvstrata.workload.zoo import load_tokenizer


def args_of(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    blend.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_workload_is_seeded_and_asks_about_a_document_it_holds():
    tok = load_tokenizer("tiny")
    args = args_of("--docs", "3", "--pool", "5", "--requests", "4", "--quick")
    a, b = blend.workload(tok, args), blend.workload(tok, args)
    assert a == b and len(a) == 8  # a warm-up half, a timed half
    for req in a:
        assert len(req["docs"]) == 3 and all(d in req["text"] for d in req["docs"])
        holder = [d for d in req["docs"] if f"is {req['code']}." in d]
        assert len(holder) == 1  # the code asked about is in one of its documents
    assert len({tuple(r["docs"]) for r in a}) > 1  # orders and picks change


def test_a_quick_run_reports_reuse_and_quality(tmp_path, one_thread):
    out = tmp_path / "blend.json"
    cmd = [sys.executable, "-m", "kvstrata.cli", "bench", "blend", "--quick", "--threads", "1"]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    variants = [v["variant"] for v in report["ttft"]]
    assert variants == ["full", "prefix", *(f"blend@{r:g}" for r in blend.RATIOS)]
    assert report["blend_tokens"]["reused"] > 0  # documents were found and moved
    quality = {q["variant"]: q for q in report["quality"]}
    assert quality["full"]["agreement"] == 1.0 and quality["full"]["ppl_rise"] == 0
    assert all(0 <= q["accuracy"] <= 1 and q["answer_ppl"] > 0 for q in quality.values())
    assert "answer quality" in proc.stdout


def test_bad_flags_are_one_line():
    cmd = [sys.executable, "-m", "kvstrata.cli", "bench", "blend"]
    for argv, field in (
        (["--docs", "9", "--pool", "3"], "docs=9"),
        (["--requests", "0"], "requests"),
    ):
        proc = subprocess.run([*cmd, *argv], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert field in proc.stderr and "Traceback" not in proc.stderr
