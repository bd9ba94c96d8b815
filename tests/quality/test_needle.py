"""Passkey retrieval (kvstrata.quality.needle), greedy agreement (kvstrata.quality.agreement), their
`kvstrata eval needle` / `eval greedy` commands, and prompt files, on tiny models."""

from __future__ import annotations

import io
import json
import sys

import pytest
import torch

from kvstrata.cli import main
from kvstrata.core.errors import ConfigError
from kvstrata.integrations.hf.cache import TieredCache
from kvstrata.model.budgets import placement
from kvstrata.quality.agreement import first_difference, greedy_agreement, greedy_tokens
from kvstrata.quality.evaluate import EXACT
from kvstrata.quality.needle import (
    ANSWER_PREFIX,
    INSTRUCTION,
    NEEDLE,
    QUESTION,
    NeedleReport,
    answer_of,
    haystack_text,
    needle_case,
    needle_cases,
    needle_sweep,
)
from kvstrata.workload.prompts import read_prompt_file
from kvstrata.workload.zoo import build_byte_tokenizer, load_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir)


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_needle_case_fits_and_plants_the_key_at_its_depth():
    tok = build_byte_tokenizer()  # one token per byte: positions are easy to check
    text = haystack_text()
    assert len(text) > 200_000 and "try" in text
    needle = NEEDLE.format(key="40617")
    positions = []
    for depth in (0.1, 0.5, 0.9):
        case = needle_case(tok, text, 1024, depth, "40617", chat=False)
        prompt = tok.decode(case.prompt_ids)
        assert 1024 - 8 - 8 <= len(case.prompt_ids) <= 1024 - 8  # prompt + answer fit
        assert prompt.count(needle) == 1
        assert prompt.startswith(INSTRUCTION + "\n\n")
        assert prompt.endswith(f"\n\n{QUESTION} {ANSWER_PREFIX}")
        # the needle is on a line of its own, at `depth` of the haystack around it
        at = prompt.index(needle)
        assert prompt[at - 1] == "\n" and prompt[at + len(needle)] == "\n"
        start = len(INSTRUCTION) + 2
        haystack = len(prompt) - start - len(needle) - 2 - len(f"\n\n{QUESTION} ")
        assert abs((at - 1 - start) / (haystack - len(ANSWER_PREFIX)) - depth) < 0.03
        # the key is first seen where the case says
        assert tok.decode(case.prompt_ids[: case.needle_position + 1]).endswith("40617")
        assert not tok.decode(case.prompt_ids[: case.needle_position]).endswith("40617")
        positions.append(case.needle_position)
    assert positions == sorted(positions)
    with pytest.raises(ConfigError, match="length=64 is invalid: at least"):
        needle_case(tok, text, 64, 0.5, "12345", chat=False)
    with pytest.raises(ConfigError, match="depth=1.5 is invalid"):
        needle_case(tok, text, 1024, 1.5, "12345", chat=False)


def test_needle_cases_differ_per_trial_and_scoring_is_exact_match():
    tok = build_byte_tokenizer()
    cases = needle_cases(tok, [512, 768], [0.25, 0.75], trials=2, chat=False, seed=3)
    assert [(c.length, c.depth, c.trial) for c in cases][:3] == [
        (512, 0.25, 0),
        (512, 0.25, 1),
        (512, 0.75, 0),
    ]
    assert len({c.key for c in cases}) == len(cases) == 8
    assert cases[0].prompt_ids[100:200] != cases[1].prompt_ids[100:200]  # other text
    assert answer_of(" 12345.") == "12345" and answer_of(" is 0012 and 9") == "0012"
    assert answer_of(" twelve") is None
    right = [f" {c.key}." for c in cases]
    wrong = [f" {c.key}1" if i % 2 else f" {c.key}" for i, c in enumerate(cases)]
    report = NeedleReport(cases, {EXACT: right, "lossy": wrong})
    assert report.accuracy(EXACT) == 1.0
    assert report.correct("lossy") == [i % 2 == 0 for i in range(8)]
    assert report.accuracy("lossy", 512) == 0.5
    data = report.to_dict()
    assert data["accuracy"]["lossy"] == {"all": 0.5, "512": 0.5, "768": 0.5}
    assert data["cases"][1]["answers"] == {EXACT: right[1], "lossy": wrong[1]}


def test_needle_sweep_lossless_is_exact_and_lossy_runs(tiny):
    model, tok = tiny
    cases = needle_cases(tok, [384], [0.2, 0.8], chat=False)

    def config(codec: str):
        return lambda n: placement(model, n, codec=codec, resident=0.25, block_size=16,
                                   residual_tokens=16)  # fmt: skip

    calls = []
    report = needle_sweep(
        model,
        tok,
        cases,
        {"none": config("none"), "fp8": config("fp8")},
        progress=calls.append,
    )
    assert len(calls) == 2 * 3
    assert report.answers["none"] == report.answers[EXACT]
    assert all(len(a) > 0 for a in report.answers["fp8"])


def test_greedy_tokens_match_generate_and_agreement_counts(tiny):
    model, tok = tiny
    prompt = tok("def fibonacci(n):\n    ", add_special_tokens=False).input_ids
    kwargs = placement(model, len(prompt) + 24, codec="none", resident=0.25, block_size=16)
    cache = TieredCache(model.config, **kwargs)
    ours = greedy_tokens(model, prompt, cache, 24)
    cache.close()
    from transformers import DynamicCache

    model.set_attn_implementation("sdpa")
    ids = torch.tensor([prompt])
    ref = model.generate(
        ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(config=model.config),
        max_new_tokens=24, do_sample=False, min_new_tokens=24, pad_token_id=tok.pad_token_id,
    )[0, len(prompt):].tolist()  # fmt: skip
    assert ours == ref
    assert first_difference([1, 2, 3], [1, 2, 4]) == 2 and first_difference([1, 2], [1, 2, 3]) == 2
    configs = {
        "none": placement(model, len(prompt) + 24, codec="none", resident=0.25, block_size=16),
        "fp8": placement(
            model, len(prompt) + 24, codec="fp8", resident=0.25, block_size=16,
            residual_tokens=16,
        ),
    }  # fmt: skip
    report = greedy_agreement(model, [prompt, prompt[:10]], configs, 24)
    row = report.rows["none"]
    assert row.identical == [True, True] and row.prefixes == report.exact_lengths
    assert row.agreement == 1.0
    lossy = report.rows["fp8"]
    assert all(0 <= p <= n for p, n in zip(lossy.prefixes, lossy.lengths, strict=True))


def test_eval_needle_command(tiny_dir, capsys):
    code, out, err = _run(
        capsys,
        "eval", "needle", "--model", str(tiny_dir), "--lengths", "384", "--depths", "25,75",
        "--codec", "none,int8", "--resident", "0.25", "--residual", "16,32", "--block-size", "16",
        "--json",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    names = list(data["accuracy"])
    assert names == [
        EXACT,
        "none @ 25% device",
        "int8 @ 25% device, residual 16",
        "int8 @ 25% device, residual 32",
    ]
    assert [c["depth"] for c in data["cases"]] == [0.25, 0.75]
    for case in data["cases"]:
        assert case["prompt_tokens"] <= 384 - 8
        assert case["answers"]["none @ 25% device"] == case["answers"][EXACT]
    code, out, err = _run(
        capsys,
        "eval", "needle", "--model", str(tiny_dir), "--lengths", "384", "--depths", "50",
        "--codec", "int8", "--resident", "0.25", "--residual", "16", "--block-size", "16",
    )  # fmt: skip
    assert code == 0, err
    assert out.lstrip().startswith("Passkey retrieval: 1 depth(s) (50%) x 1 trial(s)")
    assert "exact (DynamicCache)" in out and "int8 @ 25% device, residual 16" in out


def test_eval_greedy_command(tiny_dir, capsys):
    code, out, err = _run(
        capsys,
        "eval", "greedy", "--model", str(tiny_dir), "--prompts", "2", "--context", "48",
        "--new", "16", "--codec", "none,int8", "--resident", "0.25", "--residual", "16",
        "--block-size", "16", "--json",
    )  # fmt: skip
    assert code == 0, err
    data = json.loads(out)
    assert data["prompt_tokens"] == [48, 48] and data["max_new"] == 16
    rows = {r["name"]: r for r in data["configs"]}
    assert rows["none @ 25% device"]["identical_runs"] == 2
    assert rows["none @ 25% device"]["agreement"] == 1.0
    assert rows["int8 @ 25% device, residual 16"]["runs"] == 2


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["eval", "needle", "--depths", "120"], ["depths='120'", "0-100"]),
        (["eval", "needle", "--lengths", "0"], ["lengths='0'"]),
        (["eval", "needle", "--trials", "0"], ["trials='0'"]),
        (["eval", "needle", "--codec", "banana"], ["codec='banana'"]),
        (["eval", "needle", "--residual", "-1"], ["residual='-1'"]),
        (["eval", "greedy", "--new", "0"], ["new='0'"]),
        (["eval", "greedy", "--prompts", "x"], ["prompts='x'"]),
        (["generate", "--prompt-file", "/nonexistent/p.txt"], ["prompt_file=", "cannot read"]),
        (["generate", "--prompt-file", "-", "--prompt", "x"], ["not both"]),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv, names, capsys):
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1
    for name in names:
        assert name in err, err


def test_eval_lengths_beyond_the_model_are_refused(tiny_dir, capsys):
    code, out, err = _run(capsys, "eval", "needle", "--model", str(tiny_dir), "--lengths", "8k")
    assert code == 2 and err.count("\n") == 1
    assert "lengths='8k' is invalid: at most the model's max_position_embeddings (4096)" in err


def test_prompt_file_and_stdin(tmp_path, monkeypatch):
    path = tmp_path / "doc.txt"
    path.write_text("héllo\nworld\n", encoding="utf-8")
    assert read_prompt_file(str(path)) == "héllo\nworld\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"from stdin")))
    assert read_prompt_file("-") == "from stdin"
    path.write_bytes(b"ok \xff bad")
    with pytest.raises(ConfigError, match=r"not UTF-8 text \(byte 0xff at 3\)"):
        read_prompt_file(str(path))
    path.write_text("  \n")
    with pytest.raises(ConfigError, match="a file with some text in it"):
        read_prompt_file(str(path))
    with pytest.raises(ConfigError, match="cannot read it"):
        read_prompt_file(str(tmp_path))  # a directory
