"""Smoke tests of `kvstrata bench decode` / `kvstrata bench quantized` (--quick): the
reports have the ratio fields and the token checks pass. No timing assertions: the
numbers depend on the machine."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from kvstrata.bench import decode as bench_decode
from kvstrata.bench import quantized as bench_quantized
from kvstrata.cli import main


@pytest.fixture(scope="module")
def decode_report():
    return _json_run(["bench", "decode", "--quick", "--json"])


def _json_run(argv: list[str]) -> tuple[int, dict]:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    return code, json.loads(buf.getvalue())


def test_decode_quick_json_has_ratios_and_identical_tokens(decode_report):
    code, report = decode_report
    assert code == 0
    assert report["tokens_identical"] is True
    # The identity check is not blind: changing the first prompt tokens changes the output.
    assert report["context_sensitive"] == {"128": True, "512": True}
    assert set(report["ratios"]) == {
        "resident_vs_dynamic",
        "host90_vs_resident",
        "resident_vs_dynamic_long",
        "staged_vs_resident",
    }
    assert all(r > 0 for r in report["ratios"].values())
    rows = {row["key"]: row for row in report["variants"]}
    assert sorted(rows) == ["a", "b", "c", "d", "e", "f"]
    assert [rows[k]["context"] for k in "abcdef"] == [128, 128, 512, 512, 512, 512]
    assert all(row["tokens_identical"] for row in rows.values())
    assert rows["a"]["host_fraction"] is None  # DynamicCache has no tiers
    assert rows["b"]["host_fraction"] == 0.0 and rows["c"]["host_fraction"] == 0.0
    # resident_fraction=0.1: 4 of 34 blocks on the device, the other 29 used ones on host.
    for key in "df":
        assert 0.8 <= rows[key]["host_fraction"] < 1.0
    assert report["steps"] == 6 and report["repeats"] == 2 and report["model"]["layers"] == 1


def test_decode_table_prints_target_ratios(decode_report, monkeypatch, capsys):
    _, report = decode_report
    monkeypatch.setattr(bench_decode, "measure", lambda args: report)
    assert main(["bench", "decode", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "b/a resident vs DynamicCache @ 128" in out and "target >= 0.95" in out
    assert "d/c 90 % host vs resident @ 512" in out and "target >= 0.85" in out
    assert "tokens identical across all variants: ✓" in out


def test_decode_exits_1_when_tokens_differ(decode_report, monkeypatch, capsys):
    _, report = decode_report
    bad = copy.deepcopy(report)
    bad["tokens_identical"] = False
    bad["variants"][3]["tokens_identical"] = False
    monkeypatch.setattr(bench_decode, "measure", lambda args: bad)
    assert main(["bench", "decode", "--quick"]) == 1
    out = capsys.readouterr().out
    assert "│      ✗ │" in out and "tokens identical across all variants: ✗ FAILED" in out


def test_replayed_prefill_decodes_like_a_real_prefill():
    """The benchmark's method: K/V replayed through Cache.update == a prefill forward."""
    from kvstrata.integrations.hf.cache import TieredCache

    sdpa = bench_decode.tiny_llama(num_layers=1)
    model = bench_decode.kvstrata_twin(sdpa)
    pre = bench_decode.prefill(sdpa, 200)

    def cache():
        return TieredCache(
            model.config, block_size=16, max_tokens=224, resident_fraction=0.1, host_budget=2**20
        )

    replayed = bench_decode.decode(model, bench_decode.replay(cache(), pre), pre.first_token, 8)
    real = cache()
    with torch.no_grad():
        out = model(input_ids=bench_decode.prompt_ids(200), cache=real)
    assert int(out.logits[0, -1].argmax()) == int(pre.first_token)
    forwarded = bench_decode.decode(model, real, pre.first_token, 8)
    assert torch.equal(replayed.tokens, forwarded.tokens)
    torch.testing.assert_close(replayed.logits, forwarded.logits, rtol=1e-5, atol=1e-5)


def test_quantized_quick_json_has_ratios_and_errors():
    code, report = _json_run(["bench", "quantized", "--quick", "--json"])
    assert code == 0
    assert report["contexts"] == [384, 640]
    rows = {(r["variant"], r["context"]): r for r in report["variants"]}
    for ctx in (384, 640):
        exact = rows[("exact", ctx)]
        assert exact["logits_rel_err_final"] == 0.0 and exact["top1_agreement"] == 1.0
        ours = rows[("kvstrata-int4", ctx)]
        # Lossy but not garbage: int4 beyond the 64-token residual window.
        assert 0.0 < ours["logits_rel_err_mean"] < 0.5
        assert report["ratios"][f"kvstrata_vs_exact@{ctx}"] > 0
    qc = report["quantized_cache"]
    if qc["available"]:
        backend = qc["backend"]
        assert (f"hf-{backend}", 640) in rows
        assert report["ratios"]["kvstrata_vs_quantized@640"] > 0
    else:
        assert qc["unavailable_reason"]
        assert report["ratios"]["kvstrata_vs_quantized@640"] is None


def test_quantized_reports_unavailable_backend(monkeypatch, capsys):
    monkeypatch.setattr(
        bench_quantized, "quantized_cache_factory", lambda *a, **k: (None, "no backend here")
    )
    assert main(["bench", "quantized", "--quick", "--contexts", "384"]) == 0
    out = capsys.readouterr().out
    assert "QuantizedCache backend unavailable: no backend here" in out
    assert "kvstrata int4 / exact" in out


def test_quantized_cache_factory_names_the_failing_backend():
    sdpa = bench_decode.tiny_llama(num_layers=1)
    factory, reason = bench_quantized.quantized_cache_factory(
        sdpa.config, 64, 64, backends=("nosuch",)
    )
    assert factory is None
    assert reason.startswith("nosuch: Unknown quantization backend")
    assert "kvstrata[quanto]" in reason
