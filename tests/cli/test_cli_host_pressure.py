"""--host-pressure / --host-headroom on `kvstrata serve`: one-line refusals (exit 2)
and the CacheConfig fields they set."""

from __future__ import annotations

import pytest

from kvstrata.cli import build_parser, main

REFUSED = [  # argv, words of the one-line message
    (["--host-pressure", "bogus"], ["host_pressure='bogus'", "one of off, auto"]),
    (["--host-headroom", "0"], ["host_headroom='0'"]),
    (["--host-headroom", "lots"], ["host_headroom='lots'"]),
    (["--host-pressure", "auto", "--host-budget", "4MiB"], ["host_pressure", "disk_dir"]),
]


@pytest.mark.parametrize("argv, words", REFUSED, ids=lambda v: " ".join(v) if v[0] else "")
def test_bad_flags_exit_2_with_one_line(capsys, argv, words):
    assert main(["serve", "--port", "0", "--model", "tiny", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("kvstrata serve: error: "), err
    for word in words:
        assert word in err, err


def test_the_flags_set_the_fields(tmp_path):
    from kvstrata.cli.serve import build_engine

    argv = ["serve", "--model", "tiny", "--host-budget", "4MiB", "--disk-dir", str(tmp_path)]
    argv += ["--disk-budget", "8MiB", "--host-pressure", "auto", "--host-headroom", "32MiB"]
    engine = build_engine(build_parser().parse_args(argv))
    try:
        config = engine.store.config
        assert (config.host_pressure, config.host_headroom) == ("auto", 32 << 20)
    finally:
        engine.shutdown()
