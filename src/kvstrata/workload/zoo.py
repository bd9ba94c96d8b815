"""The model zoo: the embedded default model, its byte tokenizer, and a checked loader.

kvstrata ships one small model, ``kvstrata-code-tiny`` (a byte-level Llama trained on CPU on
the Python standard library by ``scripts/train_embedded_model.py``), so every command works
offline. :func:`load_model` takes a model name — ``tiny`` (that model; ``default`` is its old
name) or ``smollm2`` (a real instruct model, converted once from a package's GGUF file into
the user's cache by :mod:`kvstrata.workload.gguf`) — or any local Hugging Face model directory
whose architecture uses standard attention, and turns every broken-directory case into a
one-line :class:`~kvstrata.core.errors.ConfigError` naming the file and the problem.

Tokenizer guarantee: token id ``b`` *is* byte ``b`` for ``b < 256``; ids 256-258 are
``<bos>``, ``<eos>``, ``<pad>``. For any ``str`` s, ``tok.decode(tok.encode(s)) == s``
(the Hugging Face API takes ``str``, i.e. valid Unicode). For arbitrary bytes, including
invalid UTF-8, use :func:`bytes_to_ids` / :func:`ids_to_bytes`, which are exact inverses and
agree with the tokenizer on every valid UTF-8 input.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstrata.core.errors import ConfigError, KvstrataError
from kvstrata.model.geometry import KVGeometry
from kvstrata.model.presets import PRESETS
from kvstrata.model.support import check_cacheable
from kvstrata.workload.gguf import MODELS, converted_dir, damaged_cache_hint, gguf_file_dir

if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_MODEL_NAME = "kvstrata-code-tiny"
# Names of the embedded model. "default" was its only name before the real models came;
# the commands now default to CLI_DEFAULT_MODEL.
EMBEDDED_NAMES = ("tiny", "default")
CLI_DEFAULT_MODEL = "smollm2"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
BYTE_VOCAB_SIZE = 259
_SPECIALS = {"<bos>": BOS_ID, "<eos>": EOS_ID, "<pad>": PAD_ID}
# model_type -> architecture class of the families the test suite checks against
# DynamicCache through every placement (tests/integrations/hf/test_hf_integration.py); others that
# transformers loads as causal LMs are accepted too when their attention goes through
# its AttentionInterface (tests/integrations/hf/test_model_families.py checks fifteen more).
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
}
_MAX_MSG = 300


def default_model_dir() -> Path:
    """Return the directory of the embedded model inside the installed package.

    Returns:
        ``<package>/checkpoints/kvstrata-code-tiny`` (it may be absent in a source checkout
        that has not been trained yet).
    """
    return Path(__file__).resolve().parents[1] / "checkpoints" / DEFAULT_MODEL_NAME


def is_byte_tokenizer(tokenizer: Any) -> bool:
    """Whether `tokenizer` is the embedded byte-level one (id == byte): its held-out text
    is then read as bytes, not encoded (`heldout_windows(..., tokenizer=None)`)."""
    return len(tokenizer) == BYTE_VOCAB_SIZE and tokenizer.eos_token_id == EOS_ID


def bytes_to_ids(data: bytes) -> list[int]:
    """Map raw bytes to byte-tokenizer ids (id == byte value); works for invalid UTF-8.

    Args:
        data: Any bytes.

    Returns:
        One id per byte.
    """
    return list(data)


def ids_to_bytes(ids: list[int]) -> bytes:
    """Inverse of :func:`bytes_to_ids`; special ids (>= 256) are dropped.

    Args:
        ids: Token ids of the byte tokenizer.

    Returns:
        The bytes the byte ids stand for.
    """
    return bytes(i for i in ids if 0 <= i < 256)


def _byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer uses."""
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            # Unprintable bytes get code points 256+ in byte order, as in GPT-2.
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def build_byte_tokenizer() -> PreTrainedTokenizerBase:
    """Build the byte tokenizer: 256 byte tokens (id == byte value) + <bos>, <eos>, <pad>.

    Returns:
        A fast tokenizer that ``save_pretrained`` writes as tokenizer.json +
        tokenizer_config.json, loadable offline with ``AutoTokenizer.from_pretrained``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {sym: b for b, sym in enumerate(_byte_symbols())}
    vocab.update(_SPECIALS)
    # BPE with no merges over the byte alphabet is one token per byte. No regex split:
    # with no merges it changes nothing and only costs time.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(_SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )


def tiny_code_config(**overrides: Any) -> LlamaConfig:
    """Return the LlamaConfig of kvstrata-code-tiny (d=256, 4 layers, 4 Q / 2 KV heads of 64).

    Args:
        **overrides: Fields to change (tests use fewer layers, a larger init range).

    Returns:
        The config.
    """
    from transformers import LlamaConfig

    fields: dict[str, Any] = {
        "vocab_size": BYTE_VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }
    fields.update(overrides)
    return LlamaConfig(**fields)


def _one_line(exc: BaseException) -> str:
    """Collapse an exception message to one bounded line."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= _MAX_MSG else text[: _MAX_MSG - 3] + "..."


def _read_config(model_dir: Path) -> dict[str, Any]:
    """Read config.json and check the architecture is one kvstrata serves."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: missing; a model directory needs config.json")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: unreadable JSON ({_one_line(exc)})") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: top level must be a JSON object")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    causal = (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    )
    if causal is None:
        tested = ", ".join(SUPPORTED_ARCHITECTURES)
        raise ConfigError(
            f"{path}: model_type={model_type!r} is not supported: not a causal language "
            f"model this transformers loads (tested: {tested})"
        )
    classes = (causal,) if isinstance(causal, str) else tuple(causal)
    archs = config.get("architectures") or list(classes[:1])
    bad = [a for a in archs if a not in classes]
    if bad:
        raise ConfigError(
            f"{path}: architectures={bad!r} is not supported: a {model_type} causal LM is "
            f"{' or '.join(classes)}"
        )
    try:
        check_cacheable(config, str(path))
    except KvstrataError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    # a multimodal wrapper (Gemma-3, Gemma-3n...) keeps its sizes in text_config
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    vocab_size = config.get("vocab_size", text.get("vocab_size"))
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ConfigError(f"{path}: vocab_size={vocab_size!r} is invalid: a positive integer")
    return {**config, "vocab_size": vocab_size}


def _check_safetensors(path: Path) -> None:
    """Check a safetensors file's header parses and its data is all there (not truncated)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConfigError(f"{path}: truncated: {size} bytes, not even a header")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:
                raise ConfigError(
                    f"{path}: truncated or corrupt: header length {header_len} exceeds "
                    f"file size {size}"
                )
            header = json.loads(f.read(header_len))
    except ConfigError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: corrupt safetensors header ({_one_line(exc)})") from exc
    ends = [
        int(v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v
    ]
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        raise ConfigError(f"{path}: truncated: header describes {expected} bytes, file has {size}")


def _weight_files(model_dir: Path) -> list[Path]:
    """Return the safetensors files of a model dir (single file or sharded index)."""
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"{index}: unreadable shard index ({_one_line(exc)})") from exc
        shards = [model_dir / name for name in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.is_file():
                raise ConfigError(f"{shard}: missing; {index.name} names it")
        return shards
    raise ConfigError(
        f"{single}: missing; kvstrata loads safetensors weights only "
        "(model.safetensors or model.safetensors.index.json)"
    )


def model_names() -> list[str]:
    """The model names :func:`resolve_model_dir` accepts (besides directories)."""
    return [*MODELS, EMBEDDED_NAMES[0]]


def resolve_model_dir(path_or_default: str | Path) -> Path:
    """Turn a model name or a path into an existing model directory.

    Args:
        path_or_default: ``"tiny"`` (or ``"default"``) for the embedded model, a name of
            :data:`kvstrata.workload.gguf.MODELS` (converted into the cache on first use), a
            local model directory, or a local ``.gguf`` file (converted likewise).

    Returns:
        The directory.
    """
    name = str(path_or_default)
    if name in EMBEDDED_NAMES:
        model_dir = default_model_dir()
        if not model_dir.is_dir():
            raise ConfigError(
                f"{model_dir}: missing; the embedded model is not installed "
                "(build it with scripts/train_embedded_model.py or pass a model directory)"
            )
        return model_dir
    if name in MODELS:
        return converted_dir(name)
    model_dir = Path(path_or_default).expanduser()
    if model_dir.suffix.lower() == ".gguf" and model_dir.is_file():
        return gguf_file_dir(model_dir)
    if not model_dir.is_dir():
        if "/" not in name and not name.startswith("."):
            names = ", ".join(model_names())
            raise ConfigError.field(
                "model", name, f"not a model name ({names}), local directory nor .gguf file"
            )
        raise ConfigError(f"model={name!r} is invalid: not a local directory")
    return model_dir


def load_tokenizer(path_or_default: str | Path = "default") -> PreTrainedTokenizerBase:
    """Load a model's tokenizer and check it fits the model's vocab_size.

    Args:
        path_or_default: A model name (see :func:`resolve_model_dir`) or a local directory.

    Returns:
        The tokenizer.
    """
    model_dir = resolve_model_dir(path_or_default)
    with damaged_cache_hint(str(path_or_default), model_dir):
        return _load_tokenizer(model_dir)


def _load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    config = _read_config(model_dir)
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any loader failure is a bad directory
        raise ConfigError(f"{model_dir}: tokenizer failed to load ({_one_line(exc)})") from exc
    # Models often pad vocab_size past the tokenizer (e.g. Qwen2), which is fine; a token id
    # at or past vocab_size would index outside the embedding table, which is not.
    num_tokens = len(tokenizer)
    if num_tokens > config["vocab_size"]:
        raise ConfigError(
            f"{model_dir / 'config.json'}: vocab_size={config['vocab_size']} is invalid: "
            f"the tokenizer has {num_tokens} tokens; need vocab_size >= {num_tokens}"
        )
    return tokenizer


def load_model(
    path_or_default: str | Path = "default", dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, checking the directory first.

    Args:
        path_or_default: A model name — ``"tiny"`` / ``"default"`` (the embedded model),
            ``"smollm2"`` (converted into the cache on first use) — or a local model
            directory.
        dtype: Parameter dtype (default torch.float32).

    Returns:
        ``(model, tokenizer)``, the model in eval mode on CPU.
    """
    model_dir = resolve_model_dir(path_or_default)
    with damaged_cache_hint(str(path_or_default), model_dir):
        return _load_model(model_dir, dtype)


def _load_model(
    model_dir: Path, dtype: torch.dtype | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    import torch
    from transformers import AutoModelForCausalLM

    _read_config(model_dir)
    for weights in _weight_files(model_dir):
        _check_safetensors(weights)
    tokenizer = _load_tokenizer(model_dir)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            model_dir,
            dtype=torch.float32 if dtype is None else dtype,
            local_files_only=True,
            output_loading_info=True,
        )
    except Exception as exc:  # noqa: BLE001 - any loader failure is a bad directory
        raise ConfigError(f"{model_dir}: model failed to load ({_one_line(exc)})") from exc
    # A missing tensor would be silently random-initialised: refuse instead.
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ConfigError(f"{model_dir}: weights are missing {len(missing)} tensors ({shown})")
    model.eval()
    return model, tokenizer


def heldout_files(path_or_default: str | Path = "default") -> list[Path]:
    """Return the held-out source files of the embedded model that exist on this machine.

    ``heldout_files.txt`` lists paths relative to the stdlib the model was trained on; they
    are resolved against the running interpreter's stdlib. A named real model (not trained
    here) is evaluated on the embedded model's held-out files: real Python source, the same
    text for every model.

    Args:
        path_or_default: A model name or a model directory holding heldout_files.txt.

    Returns:
        Absolute paths, in the file's order; files absent here are skipped.
    """
    import sysconfig

    if str(path_or_default) in MODELS:
        path_or_default = EMBEDDED_NAMES[0]
    model_dir = resolve_model_dir(path_or_default)
    listing = model_dir / "heldout_files.txt"
    if not listing.is_file():
        raise ConfigError(f"{listing}: missing; only the embedded model lists held-out files")
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = [line.strip() for line in listing.read_text().splitlines() if line.strip()]
    return [root / rel for rel in rels if (root / rel).is_file()]


def quiet_transformers() -> None:
    """No per-weight loading bars on stderr: the commands print their own output."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def load_geometry(spec: str) -> KVGeometry:
    """A geometry from a preset name, a config.json path, a model directory or a GGUF file.

    Args:
        spec: "llama-3-8b", "/models/x/config.json" or "/models/x".

    Raises:
        ConfigError: unknown preset / missing or malformed config (lists the presets).
    """
    path = Path(spec).expanduser()
    if spec.lower() in PRESETS:
        return KVGeometry.from_preset(spec)
    if path.suffix.lower() == ".gguf" and path.is_file():
        path = gguf_file_dir(path)  # converted into the cache once
    if path.is_dir() or path.is_file():
        return KVGeometry.from_json(path)
    return KVGeometry.from_preset(spec)  # raises, listing the presets
