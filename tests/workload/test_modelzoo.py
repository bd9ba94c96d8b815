"""The model loader: a good directory loads; each broken one gives a one-line ConfigError."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from hf_models import make_tiny_model_dir
from kvstrata.core.errors import ConfigError
from kvstrata.workload.zoo import (
    DEFAULT_MODEL_NAME,
    default_model_dir,
    heldout_files,
    load_model,
    load_tokenizer,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory) -> Path:
    """A tiny Llama with the real byte tokenizer, saved the way the trainer saves."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def model_dir(good_dir, tmp_path) -> Path:
    """A private copy each test may break."""
    return Path(shutil.copytree(good_dir, tmp_path / "m"))


def _edit_config(model_dir: Path, **fields) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    config.update(fields)
    (model_dir / "config.json").write_text(json.dumps(config))


def _load_error(model_dir: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_model(model_dir)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_loads_good_dir(model_dir):
    model, tokenizer = load_model(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    assert not model.training
    assert len(tokenizer) == model.config.vocab_size == 259
    assert model.config.num_key_value_heads == 1


def test_dtype_is_applied(model_dir):
    model, _ = load_model(model_dir, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16


def test_missing_config(model_dir):
    (model_dir / "config.json").unlink()
    assert _load_error(model_dir) == (
        f"{model_dir / 'config.json'}: missing; a model directory needs config.json"
    )


def test_config_not_json(model_dir):
    (model_dir / "config.json").write_text("{not json")
    assert _load_error(model_dir).startswith(f"{model_dir / 'config.json'}: unreadable JSON (")


def test_unsupported_model_type(model_dir):
    _edit_config(model_dir, model_type="t5", architectures=["T5ForConditionalGeneration"])
    message = _load_error(model_dir)
    assert message.startswith(f"{model_dir / 'config.json'}: model_type='t5' is not supported")
    assert "not a causal language model" in message and "llama, mistral" in message


def test_uncacheable_model_is_refused_before_loading(model_dir):
    _edit_config(model_dir, layer_types=["full_attention", "linear_attention"])
    message = _load_error(model_dir)
    assert message.startswith(f"{model_dir / 'config.json'}: model_type='llama' has layers")
    assert "linear_attention" in message


def test_unsupported_architecture(model_dir):
    _edit_config(model_dir, architectures=["LlamaForSequenceClassification"])
    assert "architectures=['LlamaForSequenceClassification'] is not supported" in (
        _load_error(model_dir)
    )


def test_missing_weights(model_dir):
    (model_dir / "model.safetensors").unlink()
    message = _load_error(model_dir)
    assert message.startswith(f"{model_dir / 'model.safetensors'}: missing;")


def test_truncated_weights(model_dir):
    weights = model_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    assert _load_error(model_dir) == (
        f"{weights}: truncated: header describes {len(data)} bytes, file has {len(data) - 100}"
    )


def test_garbage_weights(model_dir):
    weights = model_dir / "model.safetensors"
    weights.write_bytes(b"\xff" * 64)
    assert "truncated or corrupt: header length" in _load_error(model_dir)


def test_missing_tensor(model_dir):
    weights = model_dir / "model.safetensors"
    tensors = safetensors_torch.load_file(weights)
    del tensors["model.norm.weight"]
    safetensors_torch.save_file(tensors, weights, metadata={"format": "pt"})
    message = _load_error(model_dir)
    assert "model.norm.weight" in message


def test_tokenizer_vocab_larger_than_model(model_dir):
    _edit_config(model_dir, vocab_size=200)
    assert _load_error(model_dir) == (
        f"{model_dir / 'config.json'}: vocab_size=200 is invalid: the tokenizer has 259 "
        "tokens; need vocab_size >= 259"
    )


def test_missing_tokenizer(model_dir):
    (model_dir / "tokenizer.json").unlink()
    (model_dir / "tokenizer_config.json").unlink()
    with pytest.raises(ConfigError, match="tokenizer failed to load") as info:
        load_tokenizer(model_dir)
    assert "\n" not in str(info.value)


def test_not_a_directory(tmp_path):
    with pytest.raises(ConfigError, match=r"^model='.*nope' is invalid: not a local directory$"):
        load_model(tmp_path / "nope")


def test_heldout_files(model_dir):
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    # Files absent on this interpreter are skipped; present ones resolve under the stdlib.
    (model_dir / "heldout_files.txt").write_text("json/encoder.py\nno/such/file.py\n")
    assert heldout_files(model_dir) == [stdlib / "json" / "encoder.py"]
    (model_dir / "heldout_files.txt").unlink()
    with pytest.raises(ConfigError, match="heldout_files.txt: missing"):
        heldout_files(model_dir)


def test_default_model_dir_location():
    path = default_model_dir()
    assert path.name == DEFAULT_MODEL_NAME
    assert path.parent.name == "checkpoints"
    assert path.parent.parent.name == "kvstrata"


def test_shipped_model_loads_and_is_trained():
    """Must NOT be skipped once the weights are committed."""
    if not default_model_dir().is_dir():
        pytest.skip("embedded model not built yet (scripts/train_embedded_model.py)")
    model_dir = default_model_dir()
    assert (model_dir / "model.safetensors").stat().st_size <= 25 * 2**20
    model, tokenizer = load_model("default")
    config = model.config
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (259, 256, 4)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 64)
    assert sum(p.numel() for p in model.parameters()) == 2_968_576
    report = json.loads((model_dir / "training_report.json").read_text())
    assert report["heldout_bits_per_byte"] < 4.0
    assert len(heldout_files("default")) > 0
    # A trained model predicts ordinary Python far better than uniform (8.02 bits/byte).
    text = "def add(self, other):\n    return self.value + other.value\n" * 2
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    assert float(loss) / math.log(2) < 5.0
