"""Digests that name a model's weights: the one home of "which weights are these".

Three questions, three names, each saying what it hashes:

- `weights_digest(model)`: a loaded model's parameters (every name, shape and dtype,
  and the first bytes of each tensor's data). Cheap, and it tells a fine-tune or another
  seed apart. The store names its blocks with it (`remember_weights` / `weights_of`),
  and a codec calibration file records it to refuse another model.
- `files_digest(root, files, cache_file)`: weight files on disk, whole contents
  (XXH3-128), with a small JSON cache keyed by path, size and mtime so a restart does
  not read the weights again. The vLLM backend names its blocks with it when vLLM
  loads a local directory.
- `hub_commit(model_name, revision, download_dir)`: the snapshot commit of a Hugging
  Face hub model in the local hub cache (the vLLM backend's name for hub models).

Every digest is a pure function of bytes (no Python `hash()`), so it is the same in
every process and after a restart.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import xxhash

log = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_READ_CHUNK = 8 << 20  # bytes read at a time when hashing a weight file


def weights_digest(model: Any, sample_bytes: int = 4096) -> str:
    """16 hex digits naming a loaded model's weights.

    Hashes every parameter's name, shape and dtype, and the first `sample_bytes` bytes
    of its data (a few KiB per tensor, not the whole model), so models that differ in
    their weights (a fine-tune, another seed) or in their dtype get different digests.
    """
    import torch

    h = hashlib.blake2b(digest_size=8, person=b"kvstrata.wts")
    for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        flat = param.detach().reshape(-1)
        count = max(1, sample_bytes // max(1, flat.element_size()))
        head = flat[:count].cpu().contiguous().view(torch.uint8)
        h.update(f"{name}:{tuple(param.shape)}:{param.dtype}".encode())
        h.update(head.numpy().tobytes())
    return h.hexdigest()


# config id -> weights_digest of the model that owns it (set by kvstrata.enable); a
# store names the weights in its block hashes with it, so two models with one config
# name never share a block.
_WEIGHTS: dict[int, str] = {}


def remember_weights(model: Any) -> str:
    """Record `weights_digest(model)` for the model's config (see `weights_of`)."""
    digest = weights_digest(model)
    config = model.config
    if id(config) not in _WEIGHTS:
        weakref.finalize(config, _WEIGHTS.pop, id(config), None)
    _WEIGHTS[id(config)] = digest
    return digest


def weights_of(config: Any) -> str | None:
    """The weights digest recorded for this config object, if any."""
    return _WEIGHTS.get(id(config))


def weight_files(directory: Path) -> list[Path]:
    """The weight files below `directory` (by suffix), sorted."""
    return sorted(p for p in directory.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file())


def files_digest(root: Path, files: Sequence[Path], cache_file: Path | None = None) -> str:
    """32 hex digits over the names (relative to `root`, or the bare name when `root`
    is a file) and whole contents of `files`; each file's XXH3-128 is kept in
    `cache_file` by path, size and mtime, so an unchanged file is not read again."""
    cache = _DigestCache(cache_file)
    h = hashlib.blake2b(digest_size=16, person=b"kvstrata.wts")
    for file in files:
        rel = file.name if root.is_file() else file.relative_to(root).as_posix()
        h.update(f"{rel}:{cache.digest(file)}\n".encode())
    cache.save()
    return h.hexdigest()


def hub_commit(model_name: str, revision: str | None, download_dir: str | None) -> str:
    """The commit of the hub snapshot cached for `model_name` at `revision` (a branch,
    tag or commit; "main" when None) in the hub cache (`download_dir` when given); ""
    when it is not there, not a hub id, or huggingface_hub is missing."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(
            model_name, "config.json", cache_dir=download_dir, revision=revision
        )
    except (ImportError, ValueError, OSError):  # not a hub id, or no hub library
        return ""
    return Path(found).parent.name if isinstance(found, str) else ""  # snapshots/<commit>/


class _DigestCache:
    """path -> (size, mtime_ns, XXH3-128 of the contents), kept in a JSON file."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries: dict[str, dict[str, Any]] = {}
        self.changed = False
        if path is not None:
            with contextlib.suppress(OSError, ValueError):
                loaded = json.loads(path.read_text(encoding="utf-8"))
                if isinstance(loaded, dict):
                    self.entries = loaded

    def digest(self, file: Path) -> str:
        real = file.resolve()
        st = real.stat()
        key = str(real)
        entry = self.entries.get(key)
        if (
            isinstance(entry, dict)
            and entry.get("size") == st.st_size
            and entry.get("mtime_ns") == st.st_mtime_ns
            and isinstance(entry.get("digest"), str)
        ):
            return entry["digest"]
        h = xxhash.xxh3_128()
        with open(real, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                h.update(chunk)
        digest = h.hexdigest()
        self.entries[key] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "digest": digest}
        self.changed = True
        return digest

    def save(self) -> None:
        if self.path is None or not self.changed:
            return
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.entries, indent=1, sort_keys=True), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:  # the cache only saves time
            log.warning("kvstrata: cannot write %s: %s", self.path, exc)
            with contextlib.suppress(OSError):
                tmp.unlink()
