"""The parts of `kvstrata bench gpu`'s report that need no GPU: the pytest JUnit
summary folded into it, the check that the fused dequant covered a CUDA run, and the
printed summary."""

from __future__ import annotations

from typing import Any

import torch

from kvstrata.bench import _timing

_MIB = 1 << 20


def junit_summary(path: str) -> dict[str, Any]:
    """Counts and failures of a pytest JUnit XML file."""
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors")}
    counts["skipped"] = sum(int(s.get("skipped", 0)) for s in suites)
    counts["time_s"] = sum(float(s.get("time", 0)) for s in suites)
    failed, skipped = [], []
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                failed.append({"test": name, "message": (node.get("message") or "")[:500]})
        node = case.find("skipped")
        if node is not None:
            skipped.append({"test": name, "reason": (node.get("message") or "")[:200]})
    return {**counts, "failed": failed, "skipped_tests": skipped}


def fused_dequant_problems(device: torch.device, report: dict[str, Any]) -> list[str]:
    """On CUDA, why the fused Triton dequant did not cover the run (empty: it did):
    not installed, disabled after a failure, its tests skipped, or a variant with a
    quantized host codec that never launched it."""
    from kvstrata.codecs import triton_dequant
    from kvstrata.codecs.registry import get_codec

    if device.type != "cuda":
        return []
    problems = []
    if not triton_dequant.available():
        problems.append("Triton is not installed (pip install 'kvstrata[cuda]')")
    if triton_dequant.disabled:
        problems.append(f"the kernel was disabled: {triton_dequant.disabled}")
    tests = report.get("tests") or {}
    skipped = [
        t["test"]
        for t in tests.get("skipped_tests", [])
        if "fused" in t["test"] or "triton" in t["test"]
    ]
    if skipped:
        problems.append(f"{len(skipped)} fused dequant tests skipped, e.g. {skipped[0]}")
    for row in (report.get("decode") or {}).get("rows", []):
        codec = row.get("codec")
        if codec in (None, "none") or row.get("fused_dequant", 0) > 0:
            continue
        if triton_dequant.kernel_codec(get_codec(codec)):
            problems.append(
                f"decode @ {row['context']}, {row['resident_fraction']:.0%} resident, {codec}: "
                "the fused kernel never ran"
            )
    return problems


def print_summary(report: dict[str, Any]) -> None:
    """One line per result (tests, links, peak memory, decode variants, failures)."""
    lines = [f"ok: {report['ok']}   elapsed: {report['elapsed_s']:.0f} s"]
    tests = report.get("tests")
    if tests and "error" not in tests:
        lines.append(
            f"tests: {tests['tests']} run, {tests['failures'] + tests['errors']} failed, "
            f"{tests['skipped']} skipped"
        )
    for kind in ("pinned", "pageable"):
        rates = report.get("links", {}).get(kind) or {}
        if "h2d" in rates:
            lines.append(
                f"{kind}: h2d {rates['h2d']['gbs']:.1f} GB/s, d2h {rates['d2h']['gbs']:.1f} GB/s"
            )
    for row in report.get("memory", {}).get("rows", []):
        lines.append(
            f"peak KV @ {row['context']}: {row['peak_kv_bytes'] / _MIB:.1f} MiB "
            f"(budget + staging {row['budget_plus_staging_bytes'] / _MIB:.1f} MiB)"
        )
    for row in report.get("decode", {}).get("rows", []):
        extra = ""
        if "pcie_bound_s" in row:
            extra = f", PCIe bound {1e3 * row['pcie_bound_s']:.2f} ms"
        lines.append(
            f"{row['variant']} @ {row['context']} {row['resident_fraction']:.0%} "
            f"{row['codec'] or ''}: {row['tok_per_s']:.1f} tok/s "
            f"(step {1e3 * row['step_s']:.2f} ms{extra})"
        )
    for name in ("tests", "environment", "links", "memory", "decode"):
        section = report.get(name)
        if isinstance(section, dict) and "error" in section:
            lines.append(f"[red]{name} failed: {section['error']}[/red]")
    if report.get("skipped"):
        lines.append(f"skipped (time budget): {', '.join(report['skipped'])}")
    _timing.print_table("kvstrata bench gpu", ("result",), [(line,) for line in lines], [])
