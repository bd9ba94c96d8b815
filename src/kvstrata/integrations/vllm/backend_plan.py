"""What the backend stores, and where: the block layout, the namespace, the tier sizes.

Computed the same way, from the same inputs, in vLLM's scheduler process (the
manager) and its worker process (the worker), so the two agree on the host arena
they share without talking to each other.

One kvstrata block is one vLLM offload chunk (`blocks_per_chunk` vLLM blocks) of one
KV cache group — under vLLM's hybrid allocator (sliding-window + full layers) every
group has the same page and about the same layers, so every group's chunks share one
layout (a group with fewer layers leaves the last ones zero) — and, under tensor
parallel, of one worker's share of the heads. vLLM's key for it (a block hash chained
over the prompt, plus the group index) names neither the model nor the worker, so
each worker's share is keyed by vLLM's key, its rank and the TP size, and every key
is hashed again with a *namespace* — model and weights, dtype, layout, codecs, and
what vLLM's config says changes K and V (revision, quantization, rope settings,
hf_overrides: `model_identity`) — and the disk tier lives in a subdirectory of
`disk_dir` named after it: two models never share a directory or a block by accident.

The scheduler process has no vLLM config to read (vLLM hands an OffloadingSpec only
the model's name and dtype, and sets its "current config" in the worker process
only), so the worker computes the identity and publishes it in the header of the
host arena both map (region.py); the scheduler names its plan with it (`named`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvstrata.codecs.base import Codec
from kvstrata.codecs.fp8_input import for_dtype
from kvstrata.codecs.registry import get_codec
from kvstrata.core.errors import ConfigError, UnsupportedModelError
from kvstrata.core.fingerprint import files_digest, hub_commit, weight_files
from kvstrata.core.layout import BlockLayout
from kvstrata.integrations.vllm.kv_dtype import kv_cache_dtype
from kvstrata.integrations.vllm.options import VllmOptions
from kvstrata.integrations.vllm.region import SharedHostTier
from kvstrata.model.budgets import lower_slots
from kvstrata.model.geometry import KVGeometry

NAMESPACE_VERSION = 2  # bump when the key derivation or the page reading changes
KEY_BYTES = 16
# How the worker reads K and V out of one layer's page of one vLLM block:
#   "cpu-hnd":  vLLM's CPU attention, [Hkv, 2 * N, D] per page — for every head its N
#               key rows, then its N value rows (vllm/v1/attention/backends/cpu_attn.py)
#   "opaque":   any other backend: the page is copied as bytes (lossless codecs only)
PAGE_LAYOUTS = ("cpu-hnd", "opaque")
DIGEST_CACHE = "weights-digests.json"  # in disk_dir: weight file digests by path, size, mtime
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmSide:
    """What vLLM tells a spec about the model and its KV cache (OffloadingConfig)."""

    model_name: str
    dtype: str
    num_layers: int  # layers of the largest offloaded KV cache group
    tokens_per_block: int  # vLLM's KV block
    blocks_per_chunk: int
    worker_kv_bytes_per_block: int  # one worker's bytes of a block, largest group
    engine_id: str
    world_size: int = 1
    page_layout: str = "cpu-hnd"
    group_layers: tuple[int, ...] = ()  # layers per KV cache group; () = (num_layers,)
    tp_size: int = 1  # tensor parallel workers (each holds its share of the heads)


@dataclass(frozen=True)
class BackendPlan:
    """The layout, namespace and tier sizes both processes derive from VllmSide.

    `layout` is the kvstrata block (one chunk); `page_shape` is one vLLM block's page
    of one layer as the worker reads it: (heads, 2, tokens, dim) in `layout.dtype`.
    `arena_digest` names what both processes must agree on (layout, codecs, slots):
    the host arena's header carries it. `digest` adds the model identity (see
    `model_identity`; empty until `named`): it namespaces every key and names the
    disk tier's subdirectory. `layout` is one worker's share: under tensor parallel
    (`tp_size` > 1) each block is stored once per worker (`key(vllm_key, rank)`).
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
    arena_digest: str = ""
    disk_root: str | None = None
    disk_path: str | None = None
    region_path: str = ""
    tp_size: int = 1
    group_layers: tuple[int, ...] = ()

    def key(self, vllm_key: bytes, rank: int = 0) -> bytes:
        """The kvstrata key of vLLM's key (which carries the KV cache group) for the
        worker of tensor-parallel rank `rank`: namespaced, KEY_BYTES long, the same in
        every process (hashlib, never Python's salted hash()). Under tensor parallel it
        names the rank and the TP size: a worker's share of the heads is never read by
        another rank, nor under another TP size."""
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvstrata.vllm")
        h.update(bytes.fromhex(self.digest))
        h.update(vllm_key)
        if self.tp_size > 1:
            h.update(f"tp:{rank}/{self.tp_size}".encode())
        return h.digest()

    def named(self, identity: dict[str, Any]) -> BackendPlan:
        """This plan with the model identity in its namespace (digest, disk_path)."""
        namespace = {**self.namespace, "identity": identity}
        digest = _digest(namespace, b"kvstrata.ns")
        disk_path = None
        if self.disk_root is not None:
            disk_path = str(Path(self.disk_root) / f"{_slug(namespace['model'])}-{digest[:16]}")
        return replace(self, namespace=namespace, digest=digest, disk_path=disk_path)

    def host_tier(
        self, *, create: bool, identity: dict[str, Any] | None = None, join: bool = False
    ) -> Any:
        """The shared host arena of this plan: created by the worker (rank 0 under
        tensor parallel; with the model identity it publishes), joined by the other
        workers, opened by the scheduler."""
        return SharedHostTier(
            self.layout, self.host_slots, self.host_codec, self.region_path,
            self.arena_digest, create=create, identity=identity, join=join,
        )  # fmt: skip


def make_plan(
    options: VllmOptions,
    side: VllmSide,
    geometry: KVGeometry,
    identity: dict[str, Any] | None = None,
) -> BackendPlan:
    """The plan of one engine, or ConfigError / UnsupportedModelError (one line).
    `identity` (model_identity) names the model; without it the plan is what the
    scheduler knows before it has read the identity the worker published."""
    groups = side.group_layers or (side.num_layers,)
    tp = side.tp_size
    if side.world_size != tp or tp < 1:
        raise UnsupportedModelError(
            f"kvstrata's vLLM backend runs tensor parallel only; this engine has "
            f"{side.world_size} workers for tensor parallel {tp} (pipeline or context "
            "parallel): use vLLM's own offloading there"
        )
    if side.page_layout not in PAGE_LAYOUTS:
        raise ConfigError.field("page_layout", side.page_layout, f"one of {PAGE_LAYOUTS}")
    name, dtype = kv_cache_dtype(side.dtype)  # the model's dtype, or fp8
    # vLLM's per-worker heads (ModelConfig.get_num_kv_heads): split, or replicated
    heads, dim, n = max(1, geometry.num_kv_heads // tp), geometry.head_dim, side.tokens_per_block
    layers = max(groups)
    page_bytes = side.worker_kv_bytes_per_block // max(1, layers)
    if (
        sum(groups) != geometry.num_layers
        or layers != side.num_layers
        or (geometry.num_kv_heads % tp and tp % geometry.num_kv_heads)
        or geometry.v_head_dim != dim
        or page_bytes * layers != side.worker_kv_bytes_per_block
        or page_bytes
        != geometry.head_layout(n, dtype, num_layers=1, num_kv_heads=heads).raw_block_bytes
    ):
        raise UnsupportedModelError(
            f"{side.model_name}: vLLM's KV pages ({len(groups)} KV cache groups of "
            f"{'/'.join(map(str, groups))} layers, {side.worker_kv_bytes_per_block} bytes "
            f"per block and worker, tensor parallel {tp}) do not match the model's config "
            f"({geometry.num_layers} layers x {geometry.num_kv_heads} kv heads x {dim} "
            f"dims, {name}): kvstrata reads KV cache groups of one page shape (no MLA or "
            "mixed head sizes yet)"
        )
    if side.page_layout == "opaque":
        heads, dim = 1, heads * dim  # a page is [1, 2 * N, Hkv * D]: any view is lossless
    tokens = n * side.blocks_per_chunk
    layout = BlockLayout(layers, heads, dim, tokens, dtype)
    cache = options.cache
    host_codec = _codec(cache.host_codec, "host_codec", layout, side.page_layout)
    disk_codec = None
    if cache.disk_dir is not None:
        disk_codec = _codec(cache.disk_codec, "disk_codec", layout, side.page_layout)
    if cache.remote_url is not None:  # checked here, used by the scheduler (remote.py)
        if tp > 1:
            raise ConfigError.field(
                "remote_url", cache.remote_url, "a remote tier serves one worker per engine "
                f"(this engine runs tensor parallel {tp}): leave it out"
            )  # fmt: skip
        remote_codec(cache, layout, side.page_layout)
    host_slots = lower_slots(cache.host_budget, host_codec.block_nbytes(layout), "host_budget")
    disk_slots = 0
    if disk_codec is not None:
        disk_slots = lower_slots(cache.disk_budget, disk_codec.block_nbytes(layout), "disk_budget")
    namespace = {
        "backend": f"vllm/{NAMESPACE_VERSION}",
        "model": options.model_key or side.model_name,
        "dtype": name,
        "layout": [layout.num_layers, layout.num_kv_heads, layout.head_dim, tokens],
        "vllm_block": n,
        "page": side.page_layout,
        "host_codec": host_codec.name,
        "disk_codec": disk_codec.name if disk_codec else "",
        "disk_compress": cache.disk_compress,
    }
    if len(groups) > 1:  # named only when there is more than one: older namespaces hold
        namespace["groups"] = list(groups)
    if tp > 1:
        namespace["tp"] = tp
    arena_digest = _digest({**namespace, "slots": host_slots}, b"kvstrata.arena")
    plan = BackendPlan(
        layout=layout,
        page_shape=(heads, 2, n, dim),
        page_layout=side.page_layout,
        blocks_per_chunk=side.blocks_per_chunk,
        host_codec=host_codec,
        disk_codec=disk_codec,
        host_slots=host_slots,
        disk_slots=disk_slots,
        namespace=namespace,
        arena_digest=arena_digest,
        disk_root=cache.disk_dir if disk_codec is not None else None,
        region_path=region_path(side.engine_id, arena_digest),
        tp_size=tp,
        group_layers=tuple(groups),
    )
    return plan.named(identity or {})


def remote_codec(cache: Any, layout: BlockLayout, page_layout: str) -> Codec:
    """The remote tier's codec: remote_codec, else the disk codec (as KVStore's)."""
    if cache.remote_codec is not None:
        return _codec(cache.remote_codec, "remote_codec", layout, page_layout)
    return _codec(cache.disk_codec, "disk_codec", layout, page_layout)


def _digest(namespace: dict[str, Any], person: bytes) -> str:
    text = json.dumps(namespace, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=16, person=person).hexdigest()


def _codec(name: str, field: str, layout: BlockLayout, page_layout: str) -> Codec:
    codec = for_dtype(get_codec(name, field), layout.dtype)  # fp8 pages: quantized from fp8
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


# -- model identity -------------------------------------------------------------------------
def model_identity(options: VllmOptions, model_name: str, vllm_config: Any = None) -> dict:
    """What names the model's K and V beyond the arena's layout, computed by the worker
    (the process that has vLLM's config) and published to the scheduler in the host
    arena's header:

    - from vLLM's ModelConfig (when `vllm_config` is given): the revision, the
      quantization method and config, the model dtype, `hf_overrides`, and a digest of
      the resolved Hugging Face config (rope scaling / theta, overrides as applied,
      the config.json's quantization_config: anything there that changes K or V);
    - with a disk or a remote tier (blocks outlive the process, or other processes
      read them) and no `model_key`: the weights (`weights_identity`), so that new
      weights under the same name never meet the old blocks. Without either nothing
      outlives the engine, and the weights are not read.

    Raises:
        ConfigError: with a disk or remote tier, weights that cannot be identified (neither a
            local path nor in the Hugging Face cache): set model_key to name them.
    """
    identity: dict[str, Any] = {}
    revision = download_dir = None
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None:
        revision = getattr(model_config, "revision", None)
        download_dir = getattr(getattr(vllm_config, "load_config", None), "download_dir", None)
        identity.update(
            quantization=getattr(model_config, "quantization", None),
            # digests, not the values: a quantization config's module lists can be long,
            # and the identity must fit the arena header
            quantization_config=_value_digest(getattr(model_config, "quantization_config", None)),
            model_dtype=str(getattr(model_config, "dtype", "")).removeprefix("torch."),
            hf_overrides=_value_digest(getattr(model_config, "hf_overrides", None)),
            hf_config=config_digest(getattr(model_config, "hf_config", None)),
        )
    if options.model_key is not None:  # the user names the weights
        return identity
    if revision is not None:
        identity["revision"] = revision
    disk_dir = options.cache.disk_dir
    if disk_dir is not None or options.cache.remote_url is not None:
        cache_file = Path(disk_dir) / DIGEST_CACHE if disk_dir is not None else None
        weights = weights_identity(model_name, revision, download_dir, cache_file)
        if not weights:
            raise ConfigError.field(
                "model_key",
                None,
                f"kvstrata cannot identify the weights of {model_name!r} (not a local path, "
                "not in the Hugging Face cache), and blocks on disk or on a remote server "
                "must never outlive a change of weights: set model_key to a name that "
                "changes with the weights",
            )
        identity["weights"] = weights
    return identity


def config_digest(hf_config: Any) -> str:
    """A digest of a Hugging Face config as vLLM resolved it ("" for None), without
    the fields that name where it came from."""
    if hf_config is None:
        return ""
    data = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
    data = {
        k: v
        for k, v in data.items()
        if not k.startswith("_") and k not in ("transformers_version", "name_or_path")
    }
    return _digest(data, b"kvstrata.cfg")


def _value_digest(value: Any) -> str:
    """A digest of a config value's stable JSON form ("" for None)."""
    return "" if value is None else _digest(_jsonable(value), b"kvstrata.val")


def _jsonable(value: Any) -> Any:
    """A stable, JSON-able form of a config value (a callable by its qualified name)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def weights_identity(
    model_name: str,
    revision: str | None = None,
    download_dir: str | None = None,
    cache_file: Path | None = None,
) -> str:
    """What names the weights vLLM loads, "" when they cannot be found: a local
    directory (or one weight file) by its files' contents ("files:" +
    `core.fingerprint.files_digest`, cached in `cache_file`), a Hugging Face hub id by
    the commit of the cached snapshot for `revision` ("hub:" + `hub_commit`)."""
    path = Path(model_name)
    if path.is_dir() or path.is_file():
        files = [path] if path.is_file() else weight_files(path)
        return "files:" + files_digest(path, files, cache_file) if files else ""
    commit = hub_commit(model_name, revision, download_dir)
    return "hub:" + commit if commit else ""


def region_path(engine_id: str, digest: str) -> str:
    """The shared-memory file of an engine's host arena (RAM-backed where /dev/shm is)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(base, f"kvstrata-vllm-{_slug(engine_id)}-{digest[:16]}.host")


def _slug(text: str) -> str:
    """A file-name-safe short form of a model name or id (for people; the digest decides)."""
    tail = Path(str(text).rstrip("/")).name or "model"
    return re.sub(r"[^A-Za-z0-9._-]+", "_", tail)[:48]
