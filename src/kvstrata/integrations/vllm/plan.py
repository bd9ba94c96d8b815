"""What the backend stores, and where: the block layout, the namespace, the tier sizes.

Computed the same way, from the same inputs, in vLLM's scheduler process (the
manager) and its worker process (the worker), so the two agree on the host arena
they share without talking to each other.

One kvstrata block is one vLLM offload chunk (`blocks_per_chunk` vLLM blocks) of one
KV cache group: every layer of the group, K and V. vLLM's key for it (a block hash
chained over the prompt, plus the group index) does not name the model, so every key
is hashed again with a *namespace* — model and weights, dtype, layout, codecs — and
the disk tier lives in a subdirectory of `disk_dir` named after it: two models never
share a directory or a block by accident.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.budgets import lower_slots
from kvstrata.codecs.base import Codec
from kvstrata.codecs.registry import get_codec
from kvstrata.errors import ConfigError, UnsupportedModelError
from kvstrata.geometry import DTYPES, KVGeometry, dtype_name
from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.layout import BlockLayout

NAMESPACE_VERSION = 1  # bump when the key derivation or the page reading changes
KEY_BYTES = 16
# How the worker reads K and V out of one layer's page of one vLLM block:
#   "cpu-hnd":  vLLM's CPU attention, [Hkv, 2 * N, D] per page — for every head its N
#               key rows, then its N value rows (vllm/v1/attention/backends/cpu_attn.py)
#   "opaque":   any other backend: the page is copied as bytes (lossless codecs only)
PAGE_LAYOUTS = ("cpu-hnd", "opaque")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_SAMPLE = 1 << 16  # bytes hashed at each end of a weight file


@dataclass(frozen=True)
class VllmSide:
    """What vLLM tells a spec about the model and its KV cache (OffloadingConfig)."""

    model_name: str
    dtype: str
    num_layers: int  # layers of the offloaded KV cache group
    tokens_per_block: int  # vLLM's KV block
    blocks_per_chunk: int
    worker_kv_bytes_per_block: int
    engine_id: str
    world_size: int = 1
    page_layout: str = "cpu-hnd"


@dataclass(frozen=True)
class BackendPlan:
    """The layout, namespace and tier sizes both processes derive from VllmSide.

    `layout` is the kvstrata block (one chunk); `page_shape` is one vLLM block's page
    of one layer as the worker reads it: (heads, 2, tokens, dim) in `layout.dtype`.
    """

    layout: BlockLayout
    page_shape: tuple[int, int, int, int]
    page_layout: str
    blocks_per_chunk: int
    host_codec: Codec
    disk_codec: Codec | None
    host_slots: int
    disk_slots: int
    namespace: dict[str, Any] = field(repr=False)
    digest: str = ""
    disk_path: str | None = None
    region_path: str = ""

    def key(self, vllm_key: bytes) -> bytes:
        """The kvstrata key of vLLM's key: namespaced, KEY_BYTES long, the same in
        every process (hashlib, never Python's salted hash())."""
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvstrata.vllm")
        h.update(bytes.fromhex(self.digest))
        h.update(vllm_key)
        return h.digest()


def make_plan(options: VllmOptions, side: VllmSide, geometry: KVGeometry) -> BackendPlan:
    """The plan of one engine, or ConfigError / UnsupportedModelError (one line)."""
    if side.world_size != 1:
        raise UnsupportedModelError(
            f"kvstrata's vLLM backend runs one worker per engine; this engine has "
            f"{side.world_size} (tensor / pipeline parallel): use vLLM's own offloading there"
        )
    if side.page_layout not in PAGE_LAYOUTS:
        raise ConfigError.field("page_layout", side.page_layout, f"one of {PAGE_LAYOUTS}")
    name = dtype_name(side.dtype, "dtype")  # fp8 KV caches are refused here
    dtype, elem = DTYPES[name]
    heads, dim, n = geometry.num_kv_heads, geometry.head_dim, side.tokens_per_block
    page_bytes = side.worker_kv_bytes_per_block // max(1, side.num_layers)
    if (
        geometry.num_layers != side.num_layers
        or geometry.v_head_dim != dim
        or page_bytes * side.num_layers != side.worker_kv_bytes_per_block
        or page_bytes != 2 * heads * n * dim * elem
    ):
        raise UnsupportedModelError(
            f"{side.model_name}: vLLM's KV pages ({side.num_layers} layers, "
            f"{side.worker_kv_bytes_per_block} bytes per block) do not match the model's "
            f"config ({geometry.num_layers} layers x {heads} kv heads x {dim} dims, {name}): "
            "kvstrata supports one full-attention KV cache group (no sliding-window, hybrid "
            "or MLA models yet)"
        )
    if side.page_layout == "opaque":
        heads, dim = 1, heads * dim  # a page is [1, 2 * N, Hkv * D]: any view is lossless
    tokens = n * side.blocks_per_chunk
    layout = BlockLayout(side.num_layers, heads, dim, tokens, dtype)
    cache = options.cache
    host_codec = _codec(cache.host_codec, "host_codec", layout, side.page_layout)
    disk_codec = None
    if cache.disk_dir is not None:
        disk_codec = _codec(cache.disk_codec, "disk_codec", layout, side.page_layout)
    namespace = {
        "backend": f"vllm/{NAMESPACE_VERSION}",
        "model": options.model_key or side.model_name,
        "weights": "" if options.model_key else weights_fingerprint(side.model_name),
        "dtype": name,
        "layout": [layout.num_layers, layout.num_kv_heads, layout.head_dim, tokens],
        "vllm_block": n,
        "page": side.page_layout,
        "host_codec": host_codec.name,
        "disk_codec": disk_codec.name if disk_codec else "",
        "disk_compress": cache.disk_compress,
    }
    text = json.dumps(namespace, sort_keys=True, separators=(",", ":"))
    digest = hashlib.blake2b(text.encode(), digest_size=16, person=b"kvstrata.ns").hexdigest()
    disk_path = None
    disk_slots = 0
    if cache.disk_dir is not None and disk_codec is not None:
        disk_path = str(Path(cache.disk_dir) / f"{_slug(namespace['model'])}-{digest[:16]}")
        disk_slots = lower_slots(cache.disk_budget, disk_codec.block_nbytes(layout), "disk_budget")
    return BackendPlan(
        layout=layout,
        page_shape=(heads, 2, n, dim),
        page_layout=side.page_layout,
        blocks_per_chunk=side.blocks_per_chunk,
        host_codec=host_codec,
        disk_codec=disk_codec,
        host_slots=lower_slots(cache.host_budget, host_codec.block_nbytes(layout), "host_budget"),
        disk_slots=disk_slots,
        namespace=namespace,
        digest=digest,
        disk_path=disk_path,
        region_path=region_path(side.engine_id, digest),
    )


def _codec(name: str, field: str, layout: BlockLayout, page_layout: str) -> Codec:
    codec = get_codec(name, field)
    if page_layout == "opaque" and not codec.lossless:
        raise ConfigError.field(
            field,
            name,
            "a lossy codec needs to know where K and V sit in vLLM's KV pages; kvstrata "
            "reads them on vLLM's CPU backend only: use 'none' here",
        )
    codec.validate(layout)
    return codec


def model_geometry(model_name: str) -> KVGeometry:
    """The model's KV geometry from its config.json (a local directory, or the Hugging
    Face cache vLLM downloaded it into)."""
    path = Path(model_name)
    if path.is_dir() and (path / "config.json").is_file():
        with open(path / "config.json", encoding="utf-8") as f:
            return KVGeometry.from_hf_config(json.load(f), name=model_name)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_name)
    return KVGeometry.from_hf_config(config, name=model_name)


def weights_fingerprint(model_name: str) -> str:
    """A short digest naming the weights: for a local directory, every weight file's
    name, size and first and last 64 KiB; for a hub model, the snapshot (commit)
    vLLM loaded from the cache; "" when neither is known."""
    path = Path(model_name)
    h = hashlib.blake2b(digest_size=8, person=b"kvstrata.wts")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())
        for file in files:
            size = file.stat().st_size
            h.update(f"{file.name}:{size}".encode())
            with open(file, "rb") as f:
                h.update(f.read(_SAMPLE))
                f.seek(max(0, size - _SAMPLE))
                h.update(f.read(_SAMPLE))
        return h.hexdigest()
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model_name, "config.json")
    except (ImportError, ValueError, OSError):  # not a hub id, or no hub library
        return ""
    if isinstance(found, str):
        return Path(found).parent.name  # .../snapshots/<commit>/config.json
    return ""


def region_path(engine_id: str, digest: str) -> str:
    """The shared-memory file of an engine's host arena (RAM-backed where /dev/shm is)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"kvstrata-vllm-{_slug(engine_id)}-{digest[:16]}.host")


def _slug(text: str) -> str:
    """A file-name-safe short form of a model name or id (for people; the digest decides)."""
    tail = Path(str(text).rstrip("/")).name or "model"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", tail)[:48]
