"""`kvstrata bench report --smoke` on the embedded model: every figure, table and the JSON
are produced, and from measured data — values that follow the inputs (DynamicCache's
bytes grow with the context, a fixed device share stays flat, bits shrink with the
codec, a lossy host tier that scoring reads changes the perplexity), and output that
changes when the data does. No timing thresholds: timed values only have to differ."""

from __future__ import annotations

import copy
import json
import re
import shutil
import sys
from pathlib import Path

import pytest

from kvstrata.cli import main
from kvstrata.core.errors import ConfigError
from kvstrata.report import command as bench_report
from kvstrata.report import compression, figures, markdown, predicted

FIGURES = ("strategy", "resident", "context", "block_size", "codecs", "serving", "planner")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    assert main(["bench", "report", "--smoke", "--model", "tiny", "--out", str(out)]) == 0
    return out, json.loads((out / "report.json").read_text())


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path.name} is not a PNG"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_every_figure_is_a_legible_png_embedded_with_its_command(smoke):
    out, report = smoke
    md = (out / "report.md").read_text()
    for name in FIGURES:
        path = out / f"{name}.png"
        width, height = _png_size(path)
        assert width >= 700 and height >= 400, (name, width, height)
        assert f"]({name}.png)" in md
    base = f"kvstrata bench report --smoke --out {out} --model tiny"
    for section in report["sections"]:
        needs = "strategy,context,planner" if section == "planner" else section
        assert f"`{base} --sections {needs}`" in md
    assert md.count("*Figure ") == len(FIGURES)
    assert "[report.json](report.json)" in md


def test_report_records_the_machine_and_the_command(smoke):
    _, report = smoke
    m = report["machine"]
    assert m["cores"] >= 1 and m["ram_bytes"] > 0 and m["cpu"]
    assert m["versions"]["torch"] and m["versions"]["matplotlib"]
    assert report["command"].startswith("kvstrata bench report --smoke --out ")
    assert "--sections" not in report["command"]  # every section: no --sections
    assert report["scale"] == "smoke" and report["seconds"] > 0
    assert [r["command"] for r in report["runs"]] == [report["command"]]
    assert report["failed"] == []
    assert list(report["sections"]) == [
        "strategy", "resident", "context", "block_size", "codecs", "compression", "prefix",
        "serve", "planner",
    ]  # fmt: skip


def test_context_bytes_follow_the_context(smoke):
    _, report = smoke
    ctx = report["sections"]["context"]
    steps = ctx["steps"]
    rows = {(r["variant"], r["context"]): r for r in ctx["rows"]}
    # DynamicCache holds every token: 4 layers x K,V x 2 heads x 64 x 4 B = 4 KiB per token
    dynamic = [rows[("DynamicCache", c)]["device_bytes"] for c in ctx["contexts"]]
    assert dynamic == [4096 * (c + steps) for c in ctx["contexts"]]
    # the tiered cache keeps a fixed device share: flat once the context exceeds it
    tiered = [rows[("TieredCache, host fp32", c)]["device_bytes"] for c in ctx["contexts"]]
    assert len(set(tiered[1:])) == 1 and tiered[-1] < dynamic[-1]
    stored = [rows[("TieredCache, host fp32", c)]["stored_bytes"] for c in ctx["contexts"]]
    assert stored == sorted(stored) and stored[0] < stored[-1]
    assert all(r["step_s"] > 0 for r in ctx["rows"])


def test_strategies_place_and_compress_the_kv(smoke):
    _, report = smoke
    rows = {r["strategy"]: r for r in report["sections"]["strategy"]["rows"]}
    assert rows["offload to host"]["device_bytes"] < rows["all on device"]["device_bytes"]
    assert rows["offload to host"]["held"]["host"] > 0
    assert rows["offload + int4"]["stored_bytes"] < rows["offload + int8"]["stored_bytes"]
    assert rows["offload + int8"]["stored_bytes"] < rows["offload to host"]["stored_bytes"]
    assert rows["offload + int4 + disk"]["held"]["disk"] > 0
    for name in ("all on device", "offload to host"):  # lossless: exactly the reference
        assert rows[name]["decode_tokens_identical"]
        assert rows[name]["top1_agreement"] == 1.0 and rows[name]["greedy_agreement"] == 1.0
        assert abs(rows[name]["delta_ppl_pct"]) < 1e-3
    assert len({r["tok_per_s"] for r in rows.values()}) > 1  # timed, not a constant


def test_scoring_reads_lossy_blocks_and_sees_their_error(smoke):
    """ΔPPL must be able to move: the scored window is longer than the exact span, so
    offloaded caches answer predictions from host / disk blocks, and int4 blocks change
    the model's output (a constant ΔPPL of 0 would mean no lossy block was ever read)."""
    _, report = smoke
    strategy = report["sections"]["strategy"]
    rows = {r["strategy"]: r for r in strategy["rows"]}
    predictions = strategy["ppl"]["predictions"]
    assert strategy["ppl"]["prefill"] < predictions
    assert rows["all on device"]["ppl_lower_tier_predictions"] == 0
    for name in ("offload to host", "offload + int8", "offload + int4", "offload + int4 + disk"):
        assert 0 < rows[name]["ppl_lower_tier_predictions"] <= predictions, name
        assert rows[name]["ppl_device_fraction"] < 1.0
    for name in ("offload + int4", "offload + int4 + disk"):
        int4 = rows[name]
        assert int4["delta_ppl_pct"] != 0 or int4["top1_agreement"] < 1, name
    codecs = {r["codec"]: r for r in report["sections"]["codecs"]["rows"]}
    assert all(r["ppl_lower_tier_predictions"] > 0 for r in codecs.values())
    assert codecs["none"]["top1_agreement"] == 1.0 and abs(codecs["none"]["delta_ppl_pct"]) < 1e-3
    assert codecs["int4"]["delta_ppl_pct"] != 0 or codecs["int4"]["top1_agreement"] < 1


def test_sweeps_and_benches_report_measured_values(smoke):
    _, report = smoke
    s = report["sections"]
    resident = s["resident"]["rows"]
    for codec in ("none", "int4"):  # the measured share follows the asked one
        pts = sorted((a["fraction"], r["device_fraction"]) for r in resident
                     for a in r["asked"] if a["codec"] == codec)  # fmt: skip
        assert [f for f, _ in pts] == [0.1, 0.5, 1.0], codec
        shares = [d for _, d in pts]
        assert shares == sorted(shares) and shares[0] < shares[-1] == 1.0, (codec, shares)
    none = [d for r in resident for a in r["asked"] if a["codec"] == "none"
            for d in [r["device_fraction"]]]  # fmt: skip
    assert len(set(none)) == 3  # three distinct caches: 10 %, 50 %, all
    assert len({r["tok_per_s"] for r in resident}) > 1
    sweep = s["block_size"]["sweep"]
    assert [r["block_size"] for r in sweep] == [16, 32, 64, 128, 256, 512]
    assert [r["block_bytes"] for r in sweep] == [sweep[0]["block_bytes"] * 2**i for i in range(6)]
    assert all(r[t]["latency_us"] > 0 for r in sweep for t in ("host", "disk"))
    assert s["block_size"]["samples"] == sweep[0]["host"]["samples"] > 0
    assert s["block_size"]["dtype"] == "fp16" and s["codecs"]["dtype"] == "fp16"
    bits = [r["bits"] for r in s["codecs"]["rows"]]
    assert bits == sorted(bits, reverse=True) and bits[0] == 16.0
    errors = [r["attn_rel_err"] for r in s["codecs"]["rows"]]
    assert errors[0] == 0.0 and 0 < errors[1] < errors[2]
    prefix = {v["variant"]: v for v in s["prefix"]["variants"]}
    assert prefix["warm"]["hit_tokens_by_tier"] and prefix["restart"]["hit_tokens_by_tier"]["disk"]
    serve = s["serve"]["variants"]
    assert all(v["tokens_per_s"] > 0 for v in serve.values())
    assert all(v["exact_vs_baseline"] for k, v in serve.items() if k != "baseline")


def test_compression_codes_the_real_kv_of_every_dtype_and_codec(smoke):
    """The delta-coding sub-table: the embedded model's K/V at the smoke context, a row per
    dtype/codec and kind; bytes follow the storage (raw fp32 = 4 layers x 2 heads x 64 x
    4 B per kind and token, quantized fewer), `pays` and `kept` follow the bytes and kinds."""
    _, report = smoke
    data = report["sections"]["compression"]
    assert list(data["modes"]) == ["delta", "calibrated", "selection"]
    delta = data["modes"]["delta"]
    assert delta["model"] == "tiny" and delta["contexts"] == [256] and delta["variant"] == "sub"
    rows = {(r["dtype/codec"], r["kind"]): r for r in delta["rows"]}
    labels = ["fp32/none", "bf16/none", "fp16/none", "fp32/int8", "fp32/int4", "fp32/int4-g32",
              "fp32/fp8"]  # fmt: skip
    assert list(rows) == [(label, kind) for label in labels for kind in ("k", "v")]
    assert rows[("fp32/none", "k")]["bytes_per_token_raw"] == 4 * 2 * 64 * 4
    assert rows[("fp16/none", "v")]["bytes_per_token_raw"] == 4 * 2 * 64 * 2
    raw = [rows[(label, "k")]["bytes_per_token_raw"] for label in labels]
    assert raw[3] < raw[1] and raw[4] < raw[3]  # int8 < 16-bit, int4 < int8
    for r in delta["rows"]:
        assert r["context"] == r["tokens"] == 256 and r["mode"] == "sub"
        assert r["bytes_per_token_zstd"] <= r["bytes_per_token_raw"]
        assert r["pays"] == (r["bytes_per_token_delta"] < r["bytes_per_token_zstd"])
        assert r["kept"] == (r["kind"] == "k")  # disk_delta codes the keys only
        assert r["encode_ms_per_block"] > 0 and r["zstd_decode_ms_per_block"] > 0
    assert data["command"].endswith("--sections compression")


def test_compression_calibrated_codecs_are_measured_against_their_baselines(smoke):
    """The calibrated sub-table: a calibration pass on the embedded model, then int8 /
    int4 baselines, low-rank keys at three ranks (fewer key bytes as the rank drops)
    and a third of the heads in int8 chosen by calibration or at random (equal bytes)."""
    out, report = smoke
    cal = report["sections"]["compression"]["modes"]["calibrated"]
    rows = {r["setting"] if r["mode"] != "lowrank-pre-true" else "true " + r["setting"]: r
            for r in cal["rows"]}  # fmt: skip
    assert {"int8", "int4", "lowrank-r16", "lowrank-r32", "lowrank-pre-r16",
            "lowrank-pre-r29-int8", "true lowrank-pre-r29-int8"} <= set(rows)  # fmt: skip
    assert rows["lowrank-r16"]["key_bytes_per_token"] < rows["lowrank-r32"]["key_bytes_per_token"]
    pre, true = rows["lowrank-pre-r29-int8"], rows["true lowrank-pre-r29-int8"]
    assert pre["key_bytes_per_token"] == true["key_bytes_per_token"]
    damage, random = rows["heads33-int8-int4 by damage"], rows["heads33-int8-int4 random"]
    assert damage["key_bytes_per_token"] == random["key_bytes_per_token"]
    assert all(r["kl_nats_per_token"] >= 0 and 0 <= r["top1_agreement"] <= 1 for r in cal["rows"])
    md = (out / "report.md").read_text()
    assert f"### {compression.MODES['calibrated'].title}" in md
    assert compression.lowrank_verdict(cal["rows"]) in md


def test_the_low_rank_verdict_names_the_setting_that_meets_the_target_or_the_closest():
    def row(mode, setting, kb, dppl):
        return {"mode": mode, "setting": setting, "key_bytes_per_token": kb, "delta_ppl_pct": dppl}

    int8 = row("uniform", "int8", 6000, 0.0)
    rows = [int8, row("lowrank-post", "a", 2900, 3.0), row("lowrank-pre", "b", 2990, 0.5),
            row("lowrank-pre", "c", 2800, 0.9), row("lowrank-pre-true", "d", 100, 0.0)]  # fmt: skip
    text = compression.lowrank_verdict(rows)
    assert text.startswith("Chosen rank: `c` (2.14x fewer") and "+0.90 %" in text
    text = compression.lowrank_verdict([int8, rows[1], row("lowrank-pre", "e", 4000, 0.2)])
    assert text.startswith("No low-rank setting meets both")
    assert "best is `a`" in text and "smallest is `e` (1.50x" in text
    assert compression.lowrank_verdict([int8]).startswith("No low-rank row")


def test_compression_selection_reads_a_share_of_the_keys_full_attention_reads(smoke):
    """The selection sub-table: full attention and budgets of 1/8 and 1/4 over the same
    placement; the budgets attend and read a share of the keys, full attention all."""
    out, report = smoke
    sel = report["sections"]["compression"]["modes"]["selection"]
    (run,) = sel["runs"]
    assert run["context"] == 256 and run["resident"] == 0.1
    full, eighth, quarter = run["rows"]
    assert full["config"] == "full attention" and full["delta_ppl_pct"] == 0
    assert full["attended_share"] == 1 and full["top1_agreement"] == 1
    for row in (eighth, quarter):
        assert 0 < row["attended_share"] < 1
        assert row["kv_bytes_per_step"] < full["kv_bytes_per_step"]
        assert row["summary_bytes_per_step"] > 0 and row["decode_ms"] > 0
    assert eighth["attended_share"] < quarter["attended_share"]
    md = (out / "report.md").read_text()
    assert f"### {compression.MODES['selection'].title}" in md
    assert f"| 256 | budget 0.125 | {eighth['delta_ppl_pct']:+.2f} % |" in md


def test_compression_renders_the_known_modes_it_holds(smoke):
    out, report = smoke
    md = (out / "report.md").read_text()
    data = report["sections"]["compression"]
    assert f"### {compression.MODES['delta'].title}" in md
    for r in data["modes"]["delta"]["rows"]:
        change = 100 * (r["bytes_per_token_delta"] / r["bytes_per_token_zstd"] - 1)
        assert (
            f"| {r['context']} | {r['dtype/codec']} | {r['kind'].upper()} | "
            f"{r['bytes_per_token_raw']:,.0f} | {r['bytes_per_token_zstd']:,.0f} | "
            f"{r['bytes_per_token_delta']:,.0f} | {change:+.1f} % |"
        ) in md
    # a mode this code does not know is skipped, an absent one left out
    text = compression.render({**data, "modes": {"future": {"rows": []}}})
    assert "###" not in text and "No compression mode measured" in text
    assert data["command"] in text


def test_a_new_compression_mode_is_measured_and_rendered_as_its_own_sub_table(
    monkeypatch, tmp_path
):
    """What a new mode does: add itself to MODES; the section measures it, stores its data
    under modes[name] and report.md renders it after the earlier modes."""
    measured = []

    def measure(session):
        measured.append(session.scale.name)
        session.tick("compression: toy")
        return {"rows": [{"heads": 3, "bytes_saved": 0.5}]}

    def render(d):
        row = d["rows"][0]
        return f"heads {row['heads']}, saved {row['bytes_saved']:.0%}\n"

    toy = compression.Mode(title="Toy mode", measure=measure, render=render, ticks=lambda s: 1)
    monkeypatch.setattr(compression, "MODES", {"toy": toy})
    out = tmp_path / "r"
    argv = ["bench", "report", "--smoke", "--out", str(out), "--sections", "compression"]
    assert main(argv) == 0 and measured == ["smoke"]
    report = json.loads((out / "report.json").read_text())
    assert report["sections"]["compression"]["modes"] == {
        "toy": {"rows": [{"heads": 3, "bytes_saved": 0.5}]}
    }
    md = (out / "report.md").read_text()
    assert "### Toy mode\n\nheads 3, saved 50%\n" in md


def test_planner_bytes_match_the_caches_to_one_block(smoke):
    _, report = smoke
    planner = report["sections"]["planner"]
    assert len(planner["rows"]) == 6 + 3 * 3  # strategy rows + context variants x contexts
    for row in planner["rows"]:
        assert all(row["bytes_within_one_block"].values()), row["case"]
        assert row["predicted"]["step_s"] > 0 and row["measured"]["step_s"] > 0
        expected = not 0.5 <= row["step_ratio"] <= 2.0
        assert row["step_off_by_more_than_2x"] == expected
    assert planner["summary"]["bytes_mismatched"] == []
    dynamic = next(r for r in planner["rows"] if r["case"].startswith("DynamicCache @"))
    assert dynamic["predicted"]["device"] == dynamic["measured"]["device"]
    rows = {r["case"]: r for r in planner["rows"] if r["section"] == "strategy"}
    strategy = report["sections"]["strategy"]
    # the planner is given the asked share, not the cache's budget: a lossless host tier's
    # device bytes follow from 10 %, a lossy one's from the sinks + residual floor
    host = rows["offload to host"]
    assert host["asked_resident"] == strategy["resident"] and host["floor_tokens"] == 64
    int4 = rows["offload + int4"]
    assert int4["asked_resident"] == strategy["resident"]
    assert int4["floor_tokens"] == 64 * 3 > int4["asked_resident"] * int4["tokens"]
    assert int4["predicted"]["staging"] > 0 and int4["measured"]["staging"] > 0
    assert rows["all on device"]["predicted"]["staging"] == 0
    assert [r["host_capacity_from_cache"] for r in rows.values()].count(True) == 1


def test_tables_quote_the_json(smoke):
    out, report = smoke
    md = (out / "report.md").read_text()
    tp = report["sections"]["block_size"]["throughput"]
    assert f"({tp['blocks']} blocks of {tp['block_size']} tokens;" in md
    assert "| device excl. staging: plan / cache | staging: plan / cache |" in md
    assert md.count("ΔPPL vs DynamicCache |") == 2  # strategy and codec tables: one wording
    for row in report["sections"]["strategy"]["rows"]:
        assert f"| {row['strategy']} |" in md and f"| {row['tok_per_s']:.1f} |" in md
    for row in report["sections"]["context"]["rows"]:
        assert f"{row['device_bytes'] / 2**20:,.2f} MiB" in md
    for row in report["sections"]["codecs"]["rows"]:
        assert f"| {row['codec']} | {row['bits']:.3f} |" in md


def test_output_follows_the_data(smoke, tmp_path):
    """Rendering is a function of the data: change a measured value and the table and the
    figure change with it."""
    out, report = smoke
    changed = copy.deepcopy(report)
    sections = changed["sections"]
    sections["context"]["rows"][0]["device_bytes"] = 123 * 2**20
    sections["strategy"]["rows"][0]["tok_per_s"] = 4321.5
    captions = {name: (f"{name}.png", "caption") for name in FIGURES}
    md = markdown.render(changed, captions)
    assert "123.00 MiB" in md and "| 4321.5 |" in md
    assert "123.00 MiB" not in (out / "report.md").read_text()
    for name in ("context", "strategy"):
        figures.FIGURES[name][1](sections[name], tmp_path / f"{name}.png")
        assert (tmp_path / f"{name}.png").read_bytes() != (out / f"{name}.png").read_bytes()


def test_step_time_off_by_2x_is_said_with_each_case_s_reason(smoke):
    _, report = smoke
    data = copy.deepcopy(report["sections"]["planner"])
    rows = data["rows"]
    for r in rows:
        r["step_ratio"], r["step_off_by_more_than_2x"] = 1.0, False
    by = {r["case"]: r for r in rows if r["section"] == "strategy"}
    flagged = [by["DynamicCache (transformers)"], by["offload + int4"]]
    for r in flagged:
        r["step_ratio"], r["step_off_by_more_than_2x"] = 3.5, True
    data["summary"].update(step_off_by_more_than_2x=[r["case"] for r in flagged],
                           step_ratio_min=1.0, step_ratio_max=3.5)  # fmt: skip
    text = predicted.render(data)
    assert re.search(r"off by more than 2x in 2 of \d+ cases\*\*", text)
    lines = {line.split(" (3.5x)")[0]: line for line in text.splitlines() if "(3.5x)" in line}
    dynamic = lines["- strategy: DynamicCache (transformers)"]
    tokens = flagged[0]["tokens"]
    assert f"attention compute over {tokens} tokens / timing noise" in dynamic
    assert "int4" not in dynamic
    int4 = lines["- strategy: offload + int4"]
    assert "decoding int4 blocks is compute the bound does not count" in int4
    assert text.count("**off > 2x**") == 2
    for r in rows:
        r["step_off_by_more_than_2x"] = False
    data["summary"]["step_off_by_more_than_2x"] = []
    assert "within 2x of the measured step in all" in predicted.render(data)


def test_every_printed_sections_value_runs(smoke):
    """Each `--sections` the report and its docs page print is one the command accepts."""
    out, _ = smoke
    page = Path(__file__).resolve().parents[2] / "docs" / "evidence-report.md"
    for text in ((out / "report.md").read_text(), page.read_text()):
        values = re.findall(r"kvstrata bench report [^`]*--sections ([\w,]+)", text)
        assert values
        for value in values:
            bench_report._sections(value)  # raises ConfigError on a refused value


def test_a_partial_run_merges_into_the_report(smoke, tmp_path, capsys):
    out, report = smoke
    merged = tmp_path / "merged"
    shutil.copytree(out, merged)
    argv = ["bench", "report", "--smoke", "--model", "tiny", "--out", str(merged)]
    assert main([*argv, "--sections", "block_size"]) == 0
    again = json.loads((merged / "report.json").read_text())
    assert list(again["sections"]) == list(report["sections"])  # nothing lost, same order
    for name in report["sections"]:
        same = again["sections"][name] == report["sections"][name]
        assert same == (name != "block_size"), name
    command = f"kvstrata bench report --smoke --out {merged} --model tiny --sections block_size"
    assert again["command"] == command
    assert [r["command"] for r in again["runs"]] == [report["command"], command]
    md = (merged / "report.md").read_text()
    assert f"Measured by `{report['command']}`" in md
    assert f"then block_size measured again by `{command}`" in md
    # a run of another scale would mislabel the merged numbers: refused before measuring
    capsys.readouterr()
    assert main(["bench", "report", "--out", str(merged), "--sections", "block_size"]) == 2
    err = capsys.readouterr().err
    assert f"out='{merged}'" in err and "--smoke" in err and err.count("\n") == 1


def test_a_planner_whose_caches_were_measured_again_is_marked_stale(smoke):
    _, report = smoke
    data = copy.deepcopy(report["sections"])
    bench_report._mark_stale_planner(data, ["context", "planner"], "context")
    assert "stale" not in data["planner"]  # measured again in the same run
    bench_report._mark_stale_planner(data, ["block_size"], "block_size")
    assert "stale" not in data["planner"]  # not one of its cases
    bench_report._mark_stale_planner(data, ["context"], "context")
    assert "--sections strategy,context,planner" in data["planner"]["stale"]
    assert predicted.render(data["planner"]).startswith("> **Stale:** its context cases")


def test_a_failing_section_is_reported_and_the_others_still_run(monkeypatch, tmp_path, capsys):
    real = bench_report._measurers()

    def boom(session):
        raise RuntimeError("boom\nsecond line")

    def interrupted(session):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench_report, "_measurers", lambda: {**real, "block_size": boom})
    out = tmp_path / "r"
    argv = ["bench", "report", "--smoke", "--out", str(out), "--sections", "context,block_size"]
    assert main(argv) == 1
    assert "section block_size failed: RuntimeError: boom second line" in capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["failed"] == ["block_size"]
    assert report["sections"]["block_size"]["error"] == "RuntimeError: boom second line"
    assert report["sections"]["context"]["rows"]
    md = (out / "report.md").read_text()
    assert "section failed: RuntimeError: boom second line" in md
    assert "--sections context,block_size" in md
    assert not (out / "block_size.png").exists() and (out / "context.png").exists()
    # report.json is written after every section: a crash keeps what was measured
    monkeypatch.setattr(bench_report, "_measurers", lambda: {**real, "block_size": interrupted})
    crashed = tmp_path / "crashed"
    argv[argv.index(str(out))] = str(crashed)
    assert main(argv) == 130
    kept = json.loads((crashed / "report.json").read_text())
    assert list(kept["sections"]) == ["context"] and kept["sections"]["context"]["rows"]


def test_missing_matplotlib_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"pip install 'kvstrata\[report\]'"):
        figures.pyplot()
    assert main(["bench", "report", "--smoke", "--out", str(tmp_path / "r")]) == 2
    assert "kvstrata[report]" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["--sections", "context,nope"], "sections="),
        (["--sections", "planner,prefix"], "sections="),
        (["--quick", "--smoke"], "smoke="),
        (["--threads", "0"], "threads="),
    ],
)
def test_bad_flags_are_one_line_errors(argv, field, tmp_path, capsys):
    assert main(["bench", "report", *argv, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert field in err and err.count("\n") == 1


def test_bench_all_leaves_the_report_out(monkeypatch, capsys):
    """`kvstrata bench all` runs every scenario but the report (which runs them again)."""
    import argparse
    import types

    from kvstrata.cli import bench as cli_bench
    from kvstrata.report import command as bench_report

    ran = []
    other = types.SimpleNamespace(
        add_arguments=lambda parser: None, run=lambda args: ran.append("other") or 0
    )
    monkeypatch.setattr(bench_report, "run", lambda args: ran.append("report") or 0)
    monkeypatch.setattr(cli_bench, "_scenarios", lambda: {"other": other, "report": bench_report})
    assert cli_bench._run_all(argparse.Namespace()) == 0
    assert ran == ["other"]


def test_a_failing_remeasure_keeps_the_earlier_data(smoke, monkeypatch, tmp_path, capsys):
    out, report = smoke
    merged = tmp_path / "merged"
    shutil.copytree(out, merged)
    real = bench_report._measurers()

    def boom(session):
        raise RuntimeError("disk full")

    monkeypatch.setattr(bench_report, "_measurers", lambda: {**real, "block_size": boom})
    argv = ["bench", "report", "--smoke", "--model", "tiny", "--out", str(merged)]
    assert main([*argv, "--sections", "block_size"]) == 1
    err = capsys.readouterr().err
    assert "section block_size failed: RuntimeError: disk full (the earlier run's" in err
    again = json.loads((merged / "report.json").read_text())
    assert again["sections"]["block_size"] == report["sections"]["block_size"]
    assert again["runs"][-1]["sections"] == [] and again["runs"][-1]["failed"] == ["block_size"]
    md = (merged / "report.md").read_text()
    assert "then no section measured again" in md and "block_size failed there" in md
    assert (merged / "block_size.png").exists() and "section failed" not in md
