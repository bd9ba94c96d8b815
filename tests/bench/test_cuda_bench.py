"""`kvstrata bench gpu` (scripts/gpu_check.sh's driver) runs end to end on the CPU at
toy sizes, so the harness a GPU run depends on is exercised in every test run: the
report's sections and fields, compressed bytes over the link, the memory section
(with a stand-in for CUDA's allocator statistics), the test-result summary, and a
clear refusal without CUDA."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from kvstrata.bench import gpu
from kvstrata.bench.gpu import command as gpu_command
from kvstrata.bench.gpu import report as gpu_report
from kvstrata.bench.gpu import sections as gpu_sections
from kvstrata.bench.gpu import setup as gpu_setup
from kvstrata.cli import main


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """The quick CPU run, and a copy of the report each time it was saved."""
    out = tmp_path_factory.mktemp("gpu") / "report.json"
    argv = ["bench", "gpu", "--quick", "--device", "cpu", "--dtype", "fp32",
            "--contexts", "256", "--fractions", "1,0.25", "--out", str(out)]  # fmt: skip
    saves = []
    real = gpu_command.write_report

    def write(path, report):
        real(path, report)
        saves.append(json.loads(out.read_text()))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gpu_command, "write_report", write)
        code = main(argv)
    return code, json.loads(out.read_text()), saves


@pytest.fixture(scope="module")
def quick_report(quick_run):
    return quick_run[:2]


def test_report_is_saved_after_every_section_and_row(quick_run):
    """A run killed by a timeout keeps what it measured: the report is rewritten after
    each section and each measured row (atomically), the last write is the report."""
    _, report, saves = quick_run
    sections = [tuple(k for k in ("environment", "links", "memory", "decode") if k in r)
                for r in saves]  # fmt: skip
    assert sections[0] == ("environment",) and sections[-1][-1] == "decode"
    partial = [r["decode"]["rows"] for r in saves if r.get("decode", {}).get("partial")]
    assert [len(rows) for rows in partial] == [1, 2, 3, 4]  # one save per row
    assert saves[-1] == report and "partial" not in report["decode"]


def test_mark_timed_out_keeps_the_saved_report(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    out = tmp_path / "report.json"
    gpu.mark_timed_out(str(out), str(junit), "tests", "bench")  # nothing saved yet
    report = json.loads(out.read_text())
    assert report["timed_out"] is True and report["ok"] is False
    assert report["timed_out_in"] == ["tests", "bench"] and report["tests"]["tests"] == 3
    gpu.write_report(out, {"scenario": "gpu", "ok": True, "links": {"x": 1}})
    gpu.mark_timed_out(str(out), str(tmp_path / "missing.xml"))
    report = json.loads(out.read_text())
    assert report["links"] == {"x": 1} and report["timed_out_in"] == ["bench"]
    assert report["ok"] is False and "error" in report["tests"]


def test_fused_dequant_must_cover_a_cuda_run(monkeypatch):
    from kvstrata.codecs import triton_dequant

    report = {
        "tests": {"skipped_tests": [{"test": "t::test_fused_dequant_gives_the_tokens[int8]"}]},
        "decode": {"rows": [
            {"context": 256, "resident_fraction": 0.25, "codec": "int4", "fused_dequant": 0},
            {"context": 256, "resident_fraction": 0.25, "codec": "int8", "fused_dequant": 12},
            {"context": 256, "resident_fraction": 0.25, "codec": "none", "fused_dequant": 0},
        ]},
    }  # fmt: skip
    monkeypatch.setattr(triton_dequant, "available", lambda: False)
    monkeypatch.setattr(triton_dequant, "disabled", "RuntimeError: no kernel image")
    problems = gpu_report.fused_dequant_problems(torch.device("cuda"), report)
    assert len(problems) == 4, problems
    assert "kvstrata[cuda]" in problems[0] and "no kernel image" in problems[1]
    assert "skipped" in problems[2] and "int4: the fused kernel never ran" in problems[3]
    assert gpu_report.fused_dequant_problems(torch.device("cpu"), report) == []


def test_quick_cpu_run_reports_every_section(quick_report):
    code, report = quick_report
    assert code == 0 and report["ok"] is True and report["skipped"] == []
    env = report["environment"]
    assert env["device"] == "cpu" and env["attention_kernel"] == "cpu"
    assert report["links"]["pinned"] == {"skipped": "pinned memory needs CUDA"}
    assert report["links"]["pageable"]["h2d"]["gbs"] > 0
    assert report["memory"] == {"skipped": "needs CUDA memory statistics"}
    rows = report["decode"]["rows"]
    assert [(r["variant"], r["resident_fraction"], r["codec"]) for r in rows] == [
        ("DynamicCache", 1.0, None),
        ("TieredCache", 1.0, "none"),
        ("TieredCache", 0.25, "none"),
        ("TieredCache", 0.25, "int4"),
    ]
    raw, int4 = rows[2], rows[3]
    assert rows[1]["tokens_agree"] == 1.0 and raw["tokens_agree"] == 1.0
    assert raw["tokens_equal_prefix"] == 4 * (1 + 1)  # steps x (warm-up + repeats)
    assert raw["host_blocks"] > 0 and int4["host_blocks"] == raw["host_blocks"]
    # int4 crosses the link compressed: 4.5 of fp32's 32 bits per element
    assert int4["link_bytes_per_step"] / raw["link_bytes_per_step"] == pytest.approx(4.5 / 32)
    for r in (raw, int4):
        assert r["pcie_bound_s"] > 0 and 0 <= r["hidden_fraction"] <= 1
        assert r["fused_dequant"] == 0  # kernel launches: no GPU (and no interpreter) here


def test_memory_section_with_stand_in_statistics():
    class Probe:
        def __init__(self):
            self.calls = []

        def allocated(self):
            return 1000

        def reset_peak(self):
            self.calls.append("reset")

        def peak(self):
            return 5000

        def release(self):
            pass

    args = argparse.Namespace(
        quick=True, contexts=None, memory_contexts="256,1024", codecs=None, steps=None,
        repeats=None, copy_mib=None, fractions="1", dtype="fp32",
    )  # fmt: skip
    s = gpu_setup.settings(args)
    device = torch.device("cpu")
    model = gpu_setup.build_model(s, device)
    probe = Probe()
    out = gpu_sections.memory(
        model, device, s, lambda ctx: gpu_setup.prefill(model, ctx), gpu_setup.Budget(60), probe
    )
    assert out["flat"] is True and probe.calls == ["reset", "reset"]
    per_token = gpu_setup.kv_bytes_per_token(model)
    for row, ctx in zip(out["rows"], (256, 1024), strict=True):
        assert row["context"] == ctx and row["peak_kv_bytes"] == 4000
        assert row["device_budget_bytes"] == 128 * per_token  # fixed, whatever the context
        assert row["dynamic_cache_kv_bytes"] == ctx * per_token
    assert out["rows"][1]["host_blocks"] > 0


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="3" time="1.5">
<testcase classname="tests.test_cuda_gpu" name="test_a" time="0.1"/>
<testcase classname="tests.test_cuda_gpu" name="test_b" time="0.1">
<failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.test_cuda_gpu" name="test_c" time="0.0">
<skipped message="needs CUDA"/></testcase>
</testsuite></testsuites>"""


def test_junit_summary(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    summary = gpu_report.junit_summary(str(path))
    assert (summary["tests"], summary["failures"], summary["errors"], summary["skipped"]) == (
        3, 1, 0, 1,
    )  # fmt: skip
    assert summary["failed"] == [
        {"test": "tests.test_cuda_gpu::test_b", "message": "assert 1 == 2"}
    ]
    assert summary["skipped_tests"][0]["reason"] == "needs CUDA"


def test_cuda_refused_without_cuda(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert main(["bench", "gpu"]) == 2
    assert "device='cuda' is invalid: CUDA is not available here" in capsys.readouterr().err
    assert main(["bench", "gpu", "--device", "cpu"]) == 2
    assert "the full run needs a GPU; add --quick" in capsys.readouterr().err
    assert main(["bench", "gpu", "--quick", "--device", "cpu", "--fractions", "0"]) == 2
    assert gpu.IN_ALL is False  # `bench all` (CPU machines) leaves it out
