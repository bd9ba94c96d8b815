"""CLI smoke tests for `kvstrata eval ppl`, `kvstrata generate` and `kvstrata demo` on a
tiny random byte-level model; bad flags exit 2 with one line."""

from __future__ import annotations

import json
import re

import pytest

import kvstrata.workload.zoo
from kvstrata.cli import main
from kvstrata.cli.eval import lossless_failures
from kvstrata.quality.evaluate import Comparison, ConfigResult, PplResult

PROMPT = "def fibonacci(n):"


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_eval_ppl_json(tiny_dir, capsys):
    code, out, err = _run(
        capsys,
        "eval", "ppl", "--model", str(tiny_dir), "--codec", "none,int8", "--codec", "none",
        "--resident", "1,0.25", "--context", "48", "--windows", "1", "--block-size", "16",
        "--residual", "16", "--json",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    assert (data["context"], data["windows"]) == (48, 1)
    assert data["exact"]["tokens"] == 47
    names = [row["name"] for row in data["configs"]]
    assert names == [
        "none @ device",
        "none @ 25% device",
        "int8 @ device",
        "int8 @ 25% device",
    ]
    rows = {row["name"]: row for row in data["configs"]}
    for name in ("none @ device", "none @ 25% device"):
        assert rows[name]["lossless"] is True
        assert rows[name]["exact_match"] is True
        assert rows[name]["top1_agreement"] == 1.0
    # everything resident: the codec never applies, so int8 is exact too
    assert abs(rows["int8 @ device"]["delta_ppl_pct"]) < 1e-4
    assert rows["int8 @ 25% device"]["lossless"] is False
    assert rows["int8 @ 25% device"]["exact_match"] is None
    assert rows["none @ 25% device"]["cache"]["host_codec"] == "none"


def test_eval_ppl_table_with_disk(tiny_dir, capsys):
    code, out, err = _run(
        capsys,
        "eval", "ppl", "--model", str(tiny_dir), "--codec", "none", "--resident", "25%",
        "--context", "48", "--windows", "1", "--block-size", "16", "--disk",
    )  # fmt: skip
    assert code == 0, err
    assert "exact (DynamicCache)" in out
    assert "none @ 25% device + disk" in out
    assert "device 16 tok, host none, disk none" in out
    assert "exact" in out.split("none @ 25% device + disk")[1].splitlines()[0]


def test_lossless_failures_flags_a_drift():
    exact = PplResult(10.0, 10, 10, [1] * 10)
    drift = ConfigResult("none @ 10% device", {}, PplResult(10.1, 10, 10, [1] * 10), 1.0, 1.0)
    flip = ConfigResult("b", {}, PplResult(10.0, 10, 10, [2] + [1] * 9), 0.0, 0.9)
    ok = ConfigResult("c", {}, PplResult(10.0, 10, 10, [1] * 10), 1e-7, 1.0)
    lossy = ConfigResult("int8", {}, PplResult(10.1, 10, 10, [1] * 10), 1.0, 1.0)
    report = Comparison(10, 1, exact, {c.name: c for c in (drift, flip, ok, lossy)})
    lossless = {"none @ 10% device": True, "b": True, "c": True, "int8": False}
    assert lossless_failures(report, lossless) == ["none @ 10% device", "b"]


def test_generate_greedy_with_host_tier_and_stats(tiny_dir, capsys):
    code, out, err = _run(
        capsys,
        "generate", "--model", str(tiny_dir), "--prompt", PROMPT, "--max-new-tokens", "24",
        "--resident-fraction", "0.34", "--block-size", "16", "--stats", "--temperature", "0",
    )  # fmt: skip
    assert code == 0, err
    assert out.startswith(PROMPT)
    assert "KV cache tiers (block size 16 tokens)" in out
    assert "device->host" in out
    assert "tokens cached: 40" in out  # 17 prompt + 24 new - the last one never fed


@pytest.mark.parametrize(
    ("flags", "frames"),
    [
        ([], set()),
        (["--disk-compress"], {b"KVZ1"}),
        (["--disk-compress", "--disk-delta"], {b"KVZ2"}),
    ],
)
def test_generate_reuses_the_prompt_prefix_a_previous_run_left_on_disk(
    tiny_dir, capsys, tmp_path, flags, frames
):
    """Also compressed, and delta coded (--disk-delta: KVZ2 frames, which say which bytes
    are delta coded): the second run reads the same tokens back."""
    argv = [
        "generate", "--model", str(tiny_dir), "--prompt", PROMPT * 8, "--max-new-tokens", "8",
        "--block-size", "16", "--resident-fraction", "0.5", "--disk-dir", str(tmp_path),
        "--temperature", "0", "--no-stream", "--stats", *flags,
    ]  # fmt: skip
    code, first, err = _run(capsys, *argv)
    assert code == 0, err
    assert "prefix cache: 0 of" in first
    code, second, err = _run(capsys, *argv)  # a new run: the store is reopened from disk
    assert code == 0, err
    reused = re.search(r"prefix cache: (\d+) of (\d+) prompt tokens reused \(disk (\d+)\)", second)
    assert reused, second
    hit, total, on_disk = map(int, reused.groups())
    assert hit == on_disk == (total - 1) // 16 * 16 > 0
    assert first.split("KV cache tiers")[0] == second.split("KV cache tiers")[0]
    stored = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    assert {m for m in (b"KVZ1", b"KVZ2") if m in stored} == frames


def test_generate_matches_between_placements_and_samples_with_seed(tiny_dir, capsys):
    base = ["generate", "--model", str(tiny_dir), "--max-new-tokens", "12", "--no-stream"]
    texts = []
    for extra in ([], ["--resident-fraction", "0.5", "--block-size", "16"]):
        code, out, err = _run(capsys, *base, *extra)
        assert code == 0, err
        texts.append(out)
    assert texts[0] == texts[1]  # a lossless placement changes no token
    sampled = []
    for _ in range(2):
        code, out, err = _run(capsys, *base, "--temperature", "1.0", "--top-k", "5", "--seed", "3")
        assert code == 0, err
        sampled.append(out)
    assert sampled[0] == sampled[1]  # the seed makes sampling repeatable


def test_demo_with_model(tiny_dir, capsys, monkeypatch):
    """The demo's sections in order over the embedded model (here a tiny random one); a
    section appended to SECTIONS runs last and sees what the others left."""
    import kvstrata.cli.demo as demo

    seen = {}

    def extra(state) -> int:
        seen.update(state.results, model=state.model, job=state.job)
        print("extra section ran")
        return 0

    monkeypatch.setattr(kvstrata.workload.zoo, "default_model_dir", lambda: tiny_dir)
    monkeypatch.setattr(demo, "SECTIONS", [*demo.SECTIONS, demo.Section("extra", extra)])
    code, out, err = _run(capsys, "demo", "--model", "tiny", "--max-new-tokens", "80")
    assert code == 0, err
    titles = [line for line in out.splitlines() if line.startswith("== ")]
    assert titles[:4] == [
        "== 1. model ==",
        "== 2. plan ==",
        "== 3. the job, 10% of its KV on the device ==",
        "== 4. exactness ==",
    ]
    assert titles[-1] == f"== {len(demo.SECTIONS)}. extra =="
    assert out.split("== 2. plan ==\n")[1].startswith("plan: tiny: llama: 2 layers")
    assert PROMPT in out
    assert "device->host" in out and "host->disk" in out
    same = re.search(r"tokens identical to DynamicCache: yes \((\d+) tokens\)", out)
    assert same and 17 + 40 < int(same.group(1)) <= 17 + 80  # 17 prompt tokens
    assert out.rstrip().endswith("extra section ran")
    assert 0 < len(seen["answer_tokens"]) <= 80 and seen["model"] is not None
    memory = seen["memory"]
    assert memory["device_peak"] < memory["resident"] and memory["held"] > 0


def test_demo_without_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(kvstrata.workload.zoo, "default_model_dir", lambda: tmp_path / "absent")
    code, out, err = _run(capsys, "demo", "--model", "tiny")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("kvstrata demo: the embedded model kvstrata-code-tiny is not")
    assert lines[1].startswith("plan: kvstrata-code-tiny: llama: 4 layers x 2 KV heads x 64")
    assert "4,096 B/token" in lines[1]


@pytest.mark.parametrize(
    ("argv", "field"),
    [
        (["eval", "ppl", "--codec", "banana"], "codec='banana'"),
        (["eval", "ppl", "--context", "0"], "context='0'"),
        (["eval", "ppl", "--context", "1"], "context='1'"),
        (["eval", "ppl", "--windows", "0"], "windows='0'"),
        (["eval", "ppl", "--resident", "2"], "resident='2'"),
        (["eval", "ppl", "--threads", "none"], "threads='none'"),
        (["generate", "--host-codec", "banana"], "host_codec='banana'"),
        (["generate", "--temperature", "-1"], "temperature='-1'"),
        (["generate", "--max-new-tokens", "0"], "max_new_tokens='0'"),
        (["generate", "--resident-fraction", "0"], "resident_fraction='0'"),
        (["generate", "--top-k", "0.5"], "top_k='0.5'"),
        (["generate", "--no-repeat-ngram", "-1"], "no_repeat_ngram='-1'"),
        # checked with the model's geometry: the embedded model (no extra needed)
        (["generate", "--model", "tiny", "--disk-compress"], "disk_compress=True"),
        (["generate", "--model", "tiny", "--disk-delta"], "disk_delta=True"),
        (  # delta codes the compressed frames: without --disk-compress it is refused
            ["generate", "--model", "tiny", "--disk-dir", "/tmp", "--disk-delta"],
            "set disk_compress=True too",
        ),
        (
            ["generate", "--model", "tiny", "--disk-dir", "/proc/kvstrata-no"],
            "disk_dir='/proc/kvstrata-no'",
        ),
        (["bench", "decode", "--steps", "0"], "steps=0"),
        (["bench", "decode", "--threads", "0"], "threads=0"),
        (["bench", "quantized", "--group", "0"], "group=0"),
        (["bench", "tiers", "--size-mib", "-5"], "size_mib=-5"),
        (["bench", "tiers", "--dir", "/proc/kvstrata-no"], "dir='/proc/kvstrata-no'"),
        (["bench", "codecs", "--repeats", "0"], "repeats=0"),
        (["demo", "--max-new-tokens", "x"], "max_new_tokens='x'"),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv, field, capsys):
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1
    assert field in err


def test_model_dir_errors_exit_2(tmp_path, capsys):
    code, _, err = _run(capsys, "eval", "ppl", "--model", str(tmp_path / "nope"))
    assert code == 2
    assert err.count("\n") == 1 and "not a local directory" in err
    code, _, err = _run(capsys, "generate", "--model", str(tmp_path), "--max-new-tokens", "1")
    assert code == 2
    assert err.count("\n") == 1 and "config.json: missing" in err


@pytest.mark.parametrize("stream", [False, True])
def test_lossy_host_codec_without_room_for_the_residual_window_exits_2(tiny_dir, capsys, stream):
    argv = [
        "generate", "--model", str(tiny_dir), "--max-new-tokens", "24",
        "--resident-fraction", "0.25", "--block-size", "16", "--host-codec", "int8",
    ]  # fmt: skip
    code, out, err = _run(capsys, *argv, *([] if stream else ["--no-stream"]))
    assert code == 2
    assert err.count("\n") == 1 and "residual window" in err
    assert out == ""  # the streamed prompt waits for the first new token
