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
from kvstrata.cli import main


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "report.json"
    argv = ["bench", "gpu", "--quick", "--device", "cpu", "--dtype", "fp32",
            "--contexts", "256", "--fractions", "1,0.25", "--out", str(out)]  # fmt: skip
    code = main(argv)
    return code, json.loads(out.read_text())


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
        assert r["fused_dequant"] is False  # no GPU (and no interpreter) here


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
    s = gpu._settings(args)
    device = torch.device("cpu")
    model = gpu._model(s, device)
    probe = Probe()
    out = gpu.memory(model, device, s, lambda ctx: gpu._prefill(model, ctx), gpu.Budget(60), probe)
    assert out["flat"] is True and probe.calls == ["reset", "reset"]
    per_token = gpu._kv_bytes_per_token(model)
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
    summary = gpu.junit_summary(str(path))
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
