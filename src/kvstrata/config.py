"""Frozen configuration, validated at construction: the one place a bad field is refused.

Every way in (keyword arguments, `from_dict`, `replace`, `TieredCache(**fields)`, the
CLI flags) ends in `CacheConfig.__post_init__`, which refuses wrong types, bools where
numbers are meant, NaN and infinities, fractions where bytes or tokens are meant,
out-of-range values, unknown codec names, a CUDA device on a machine without one and
budgets larger than the machine, with one line: `<field>=<value> is invalid: <accepted>`.
An unknown keyword is a `ConfigError` too, suggesting the closest field name.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvstrata.codecs.calibration import FIELD, FIX, load_calibration, split_name
from kvstrata.codecs.registry import calibrated_codec, get_codec, is_calibrated
from kvstrata.core.errors import ConfigError
from kvstrata.core.selection import (
    ATTENTION_PREFETCH,
    check_budget,
    check_channels,
    check_choice,
    check_selection,
    check_two_level,
)
from kvstrata.core.units import (
    MAX_TOKENS,
    format_bytes,
    parse_float,
    parse_fraction,
    parse_int,
    parse_size,
    parse_tokens,
)
from kvstrata.platform.hardware import device_memory, machine_ram
from kvstrata.platform.numa import check_numa, cxl_memory, read_topology

POLICIES = ("window", "lru", "lfu")
COLD_ATTENTION = ("auto", "local", "stage")
HOST_PRESSURE = ("off", "auto")
# Tokens per block the cache accepts (generation through host and disk tiers with the
# none/int8/fp8 codecs matches DynamicCache at 1, 3, 64 and 4096; int4 further needs a
# multiple of its group size and says so; 64-256 is the usual choice).
BLOCK_SIZE_MIN, BLOCK_SIZE_MAX = 1, 4096
BLOCK_SIZE_HELP = f"{BLOCK_SIZE_MIN}-{BLOCK_SIZE_MAX} tokens per block (64-256 typical)"
DEVICE_HELP = "'auto', 'cpu', 'cuda' or 'cuda:N'"
REMOTE_SCHEMES = ("redis", "rediss")
REMOTE_URL_HELP = (
    "redis://[:password@]host[:port][/db] or rediss://... (TLS); the password may also "
    "come from $KVSTRATA_REMOTE_PASSWORD"
)


@dataclass(frozen=True)
class CacheConfig:
    """How a TieredCache lays out and places KV blocks.

    Budgets are bytes of *stored* KV (after the tier's codec): an int number of bytes
    or a string such as "512MiB" / "4GB"; a number below 1 is refused, never read as
    a fraction (the only fraction is `resident_fraction`). The device tier is sized
    either by `device_budget` or by `resident_fraction` of `max_tokens` (the seed's
    "keep 5-20 % resident"); `None` for both means "everything on the device" (sized
    to `max_tokens`).

    Fields:
        block_size: tokens per block (all layers, K and V): 1-4096, 64-256 typical.
        max_tokens: total tokens the cache must hold across all sequences; sizes
            the device tier when no budget is given and `resident_fraction`.
        device_budget: device-tier size in bytes ("2GiB"); None: sized by
            `resident_fraction`, else to hold `max_tokens`.
        resident_fraction: device-tier size as a fraction in (0, 1] of `max_tokens`
            ("10%", 0.1); below 1 needs a host or disk tier for the rest.
        host_budget: host-tier size in bytes (0 = no host tier; pinned with CUDA).
        disk_dir: directory of the durable, checksummed disk tier (None: no disk tier);
            a restarted store on the same directory finds its blocks again.
        disk_budget: disk-tier size in bytes (needs `disk_dir`).
        *_codec: codec name per tier ("none", "fp8", "int8", "int4", "int4-g32" ...;
            calibrated, lossy and opt-in: "lowrank-pre-r29-int8+int8", "heads33-int8-int4").
        codec_calibration: calibration file of the model (``kvstrata calibrate``) that
            the calibrated codecs need; their names then get its digest appended
            ("lowrank-r32+int8@1a2b3c4d5e6f").
        disk_compress: also compress each disk block layer losslessly (byte planes
            + zstd, the `compress` extra): e.g. disk_codec="int4" + disk_compress.
        disk_delta: with disk_compress, first code each key block as differences
            between neighbouring tokens (lossless, bit-exact). On real K/V it shrinks
            compressed keys (int8 most) for more codec CPU time (docs/MEASUREMENTS.md);
            values are left as they are (it grows them). Frames record it: either
            setting reads both.
        disk_o_direct: disk I/O with O_DIRECT (bypasses the page cache).
        residual_tokens: newest tokens kept in full precision (lossy codecs only).
        sink_tokens: first tokens of each sequence kept on the device (they must fit
            there: checked with the model's block bytes when the tiers are built).
        policy: device eviction policy: "window" (newest + sinks), "lru", "lfu".
        staging_tokens: size of the device staging buffer for cold blocks.
        cold_attention: "local" attends cold host blocks where they live (CPU),
            "stage" copies them through the staging buffer, "auto" = local on a
            CPU-only machine, stage with CUDA.
        device: compute device ("auto" = cuda when present, else cpu); "cuda" and
            "cuda:N" are refused when that device is not there.
        remote_url: a Redis / Valkey server shared by many stores (the remote tier,
            the `remote` extra): "redis://host:6379/0", "rediss://" for TLS; a password
            in the URL or in $KVSTRATA_REMOTE_PASSWORD. None: no remote tier.
        remote_codec: codec of remote blocks (None: the disk codec).
        remote_ttl: seconds a remote block lives after it is written (None: until
            the server evicts it).
        remote_timeout: the shortest deadline of a remote read, seconds (a PING's, and
            a small read's): a read of many blocks gets 8x what the link model predicts
            for its bytes, at least a quarter of what recomputing its tokens is
            predicted to cost and never more than all of it. Past its deadline a read
            is abandoned and the blocks are recomputed.
        attention_budget: query-aware block selection (Quest; lossy, opt-in): each
            decode step attends at most this many of a sequence's keys — a token
            count, or a fraction of its context — chosen per layer from the query and
            a per-block key summary; the sink blocks and the newest keys are always
            attended, and only the chosen blocks are read. None: exact attention.
        attention_summary: the per-block key summary scored against the query:
            "minmax" (per-channel min and max, Quest's upper bound) or "mean".
        attention_dense_layers: with a budget, the first this many model layers still
            attend every key (as Quest's: their attention is spread too evenly to select).
        attention_page: keys per summary (a page): fewer choose more precisely for
            more summary bytes scored per step.
        attention_score: how a KV head scores a page from its query heads' scores —
            "max" (its best query head's) or "sum".
        attention_coarse: pages per group summary — two-level scoring: a KV head
            scores the groups' summaries first, then only the pages of its best
            groups (fewer summary bytes a step); 0 scores every page.
        attention_refine: with attention_coarse, the groups a head refines, as a
            multiple of the pages it chooses (>= 1; ceil(refine * chosen / coarse)).
        attention_channels: each query row scores pages over its this many
            largest-|q| channels only (SparQ's approximation; their summary rows are
            all it reads); 0 scores every channel.
        attention_prefetch: with a budget, the next decode step's (block, layer)
            units in staged tiers (disk, remote, a lossy host tier) predicted and held
            or fetched ahead on the compute device: "last" (the units this step read),
            "learned" (an online recency / frequency score per unit; units read
            before and predicted again are fetched ahead), "off" (every step reads
            its units again). Tokens are the same either way.
        attention_prefetch_budget: bytes the prediction may hold ("1GiB").
        host_pressure: "auto" lets the host tier yield to memory pressure (its cgroup's
            limit, MemAvailable, PSI): its coldest blocks move to disk before the
            kernel's OOM killer acts, and it takes memory back when memory frees (up
            to host_budget); needs host_budget and disk_dir. "off": a fixed budget.
        host_headroom: with host_pressure="auto", the memory kept free: below it the
            host tier shrinks, above twice it the tier grows back ("256MiB").
        numa: where the arenas in host RAM and the thread that builds the store go on
            a multi-socket machine: "auto" (the GPU's node; CPU-only: the node the
            process runs on, else pages interleaved), "off", or a node id (a CPU-less
            CXL node too); read from sysfs, a no-op that says so on one node.
        cxl_budget: size in bytes of the "cxl" tier: KV on CXL memory (the CPU-less
            NUMA node nearest the host tier, read from sysfs) below the host tier and
            above disk, in host_codec; 0 = none. Needs host_budget and such a node.
    """

    block_size: int = 64
    max_tokens: int = 32768
    device_budget: int | None = None
    resident_fraction: float | None = None
    host_budget: int = 0
    disk_dir: str | None = None
    disk_budget: int = 0
    device_codec: str = "none"
    host_codec: str = "none"
    disk_codec: str = "none"
    disk_compress: bool = False
    disk_o_direct: bool = False
    residual_tokens: int = 128
    sink_tokens: int = 4
    policy: str = "window"
    staging_tokens: int = 16384
    cold_attention: str = "auto"
    device: str = "auto"
    remote_url: str | None = dataclasses.field(default=None, repr=False)  # may hold a password
    remote_codec: str | None = None
    remote_ttl: int | None = None
    remote_timeout: float = 0.5
    disk_delta: bool = False  # from here on: the positional order of the fields above stays
    attention_budget: int | float | str | None = None
    attention_summary: str = "minmax"
    codec_calibration: str | None = None
    attention_dense_layers: int = 0
    attention_page: int = 4
    attention_score: str = "max"
    attention_coarse: int = 0
    attention_refine: float = 2.0
    attention_channels: int = 16
    host_pressure: str = "off"
    host_headroom: int | str = "256MiB"
    numa: str | int = "auto"
    cxl_budget: int = 0
    attention_prefetch: str = "off"
    attention_prefetch_budget: int | str = "1GiB"

    def __post_init__(self) -> None:
        given = dict(self.__dict__)  # the values as written, for the messages

        def put(name: str, value: object) -> None:
            object.__setattr__(self, name, value)

        put("block_size", parse_tokens(self.block_size, "block_size", maximum=BLOCK_SIZE_MAX))
        if not BLOCK_SIZE_MIN <= self.block_size <= BLOCK_SIZE_MAX:
            raise ConfigError.field("block_size", self.block_size, BLOCK_SIZE_HELP)
        put("max_tokens", parse_tokens(self.max_tokens, "max_tokens"))
        if self.device_budget is not None:
            put(
                "device_budget",
                parse_size(
                    self.device_budget,
                    "device_budget",
                    fraction_hint="for a share of max_tokens use resident_fraction",
                ),
            )
        put("host_budget", parse_size(self.host_budget, "host_budget", allow_zero=True))
        put("disk_budget", parse_size(self.disk_budget, "disk_budget", allow_zero=True))
        lower_tier = self.disk_dir is not None or self.host_budget > 0
        if self.resident_fraction is not None:
            frac = parse_fraction(self.resident_fraction, "resident_fraction")
            if self.device_budget is not None:
                raise ConfigError.field(
                    "resident_fraction",
                    self.resident_fraction,
                    "give either device_budget or resident_fraction, not both",
                )
            if frac < 1 and not lower_tier:
                raise ConfigError.field(
                    "resident_fraction",
                    self.resident_fraction,
                    "below 1 the rest of the KV needs a host or disk tier: set host_budget "
                    "(e.g. '4GiB') or disk_dir + disk_budget, or use resident_fraction=1",
                )
            put("resident_fraction", frac)
        if self.disk_dir is not None:
            put("disk_dir", check_disk_dir(self.disk_dir))
            if self.disk_budget == 0:
                raise ConfigError.field("disk_budget", 0, "a disk tier needs a budget, e.g. '8GiB'")
        elif self.disk_budget:
            raise ConfigError.field("disk_dir", None, "set disk_dir to use disk_budget")
        for name in ("residual_tokens", "sink_tokens"):
            put(name, parse_tokens(getattr(self, name), name, allow_zero=True))
        put("staging_tokens", parse_tokens(self.staging_tokens, "staging_tokens"))
        check_choice("policy", self.policy, POLICIES)
        check_choice("cold_attention", self.cold_attention, COLD_ATTENTION)
        put("device", _check_device(self.device))
        for name in ("disk_compress", "disk_delta", "disk_o_direct"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError.field(name, getattr(self, name), "True or False")
        if self.disk_delta and not self.disk_compress:
            raise ConfigError.field(
                "disk_delta",
                True,
                "it codes blocks for disk compression: set disk_compress=True too",
            )
        if self.disk_compress and self.disk_o_direct:
            raise ConfigError.field(
                "disk_o_direct", True, "O_DIRECT cannot be combined with disk_compress; drop one"
            )
        for name in ("disk_compress", "disk_o_direct"):
            if getattr(self, name) and self.disk_dir is None:
                raise ConfigError.field(name, True, "set disk_dir (and disk_budget) to add a disk")
        put("attention_budget", check_budget(self.attention_budget))
        check_selection(
            self.attention_summary,
            self.attention_score,
            self.attention_page,
            self.attention_dense_layers,
        )
        put("attention_refine", check_two_level(self.attention_coarse, self.attention_refine))
        check_channels(self.attention_channels)
        check_choice("attention_prefetch", self.attention_prefetch, ATTENTION_PREFETCH)
        budget = parse_size(self.attention_prefetch_budget, "attention_prefetch_budget")
        put("attention_prefetch_budget", budget)
        put("numa", check_numa(self.numa))
        _check_cxl(self, put)
        _check_pressure(self, put)
        _bind_calibrated(self, put)
        _check_codecs(self)
        _check_remote(self, put)
        _check_machine(self, given)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheConfig:
        """Build from a plain dict (YAML/JSON); an unknown key is an error naming it and
        suggesting the closest field."""
        if not isinstance(data, Mapping):
            raise ConfigError.field("cache_config", data, "a dict of CacheConfig fields")
        check_field_names(data)
        return cls(**data)

    def replace(self, **changes: Any) -> CacheConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CacheConfig))


def check_field_names(fields: Mapping[str, Any], extra: Iterable[str] = ()) -> None:
    """ConfigError for the first name in `fields` that is neither a CacheConfig field
    nor in `extra` (other keywords the caller accepts), suggesting the closest one."""
    known = [*FIELD_NAMES, *extra]
    for name, value in fields.items():
        if name not in known:
            raise ConfigError.unknown(str(name), value, known)


def check_cache_config(value: Any, field: str = "cache_config") -> CacheConfig | None:
    """`value` if it is a CacheConfig or None, else a ConfigError saying how to make one."""
    if value is None or isinstance(value, CacheConfig):
        return value
    raise ConfigError.field(
        field,
        value,
        "a kvstrata CacheConfig (CacheConfig.from_dict(d) for a dict), or give its fields "
        "as keyword arguments",
    )


_dataclass_init = CacheConfig.__init__


@functools.wraps(_dataclass_init)
def _init_checking_names(self: CacheConfig, *args: Any, **kwargs: Any) -> None:
    # The generated __init__ would raise TypeError for a misspelled keyword; make it the
    # same ConfigError as from_dict, with the closest field name.
    if len(args) > len(FIELD_NAMES):
        raise ConfigError.field(
            "CacheConfig", args, f"at most {len(FIELD_NAMES)} fields; give them by name"
        )
    check_field_names(kwargs)
    _dataclass_init(self, *args, **kwargs)


CacheConfig.__init__ = _init_checking_names  # type: ignore[method-assign]


def check_disk_dir(value: Any) -> str:
    """A usable directory path as a str: not '', not a file, not bytes."""
    if isinstance(value, bytes) or not isinstance(value, str | os.PathLike):
        raise ConfigError.field("disk_dir", value, "a directory path (str or Path)")
    text = os.fspath(value)
    if not isinstance(text, str) or not text.strip():
        raise ConfigError.field(
            "disk_dir",
            value,
            "a directory path such as '/var/tmp/kvstrata' ('' would write into the current "
            "directory; use '.' to mean it)",
        )
    if "\0" in text:
        raise ConfigError.field("disk_dir", value, "a directory path without NUL bytes")
    path = Path(text).expanduser()
    try:
        is_file = path.exists() and not path.is_dir()
    except OSError as exc:  # a name too long, a parent it may not look into
        raise ConfigError.field("disk_dir", value, f"cannot access it ({exc.strerror})") from None
    if is_file:
        raise ConfigError.field("disk_dir", value, "exists and is not a directory")
    return str(path)


def redact_url(url: str) -> str:
    """The URL with its password (if any) replaced by '***', for messages and logs."""
    try:
        parts = urllib.parse.urlsplit(url)
        if parts.password is None:
            return url
        user = parts.username or ""
        host = parts.netloc.rpartition("@")[2]
        return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))
    except ValueError:
        return "<unparseable URL>"


def check_remote_url(value: Any) -> urllib.parse.SplitResult:
    """The parts of a redis:// or rediss:// URL (ConfigError naming remote_url otherwise;
    the password never appears in the message)."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError.field("remote_url", value, REMOTE_URL_HELP)
    shown = redact_url(value)
    try:
        parts = urllib.parse.urlsplit(value)
        port = parts.port  # raises for a port that is not a number or out of range
    except ValueError as exc:
        raise ConfigError.field("remote_url", shown, f"{exc}; {REMOTE_URL_HELP}") from None
    if parts.scheme not in REMOTE_SCHEMES:
        raise ConfigError.field(
            "remote_url", shown, f"the scheme must be redis or rediss, not {parts.scheme!r}"
        )
    if not parts.hostname or any(c.isspace() for c in value):
        raise ConfigError.field("remote_url", shown, f"no host name; {REMOTE_URL_HELP}")
    if port == 0:
        raise ConfigError.field("remote_url", shown, "port 0 is not a server port")
    db = parts.path.strip("/")
    if db and not db.isdigit():
        raise ConfigError.field("remote_url", shown, f"the database /{db} must be a number")
    if parts.query or parts.fragment:
        raise ConfigError.field("remote_url", shown, f"no ?query or #fragment; {REMOTE_URL_HELP}")
    return parts


def _check_remote(config: CacheConfig, put: Any) -> None:
    if config.remote_url is None:
        for name in ("remote_codec", "remote_ttl"):
            if getattr(config, name) is not None:
                raise ConfigError.field(
                    name, getattr(config, name), "set remote_url to add a remote tier"
                )
    else:
        check_remote_url(config.remote_url)
    if config.remote_codec is not None:
        if not isinstance(config.remote_codec, str) or not config.remote_codec:
            raise ConfigError.field(
                "remote_codec", config.remote_codec, "a codec name, e.g. 'int4'"
            )
        get_codec(config.remote_codec, "remote_codec")
    if config.remote_ttl is not None:
        put(
            "remote_ttl",
            parse_int(config.remote_ttl, "remote_ttl", maximum=10**9, what="seconds (>= 1)"),
        )
    put(
        "remote_timeout",
        parse_float(
            config.remote_timeout, "remote_timeout", minimum=0.001, maximum=600, what="seconds"
        ),
    )


def _check_pressure(config: CacheConfig, put: Any) -> None:
    check_choice("host_pressure", config.host_pressure, HOST_PRESSURE)
    put("host_headroom", parse_size(config.host_headroom, "host_headroom"))
    if config.host_pressure == "auto" and (config.host_budget == 0 or config.disk_dir is None):
        raise ConfigError.field(
            "host_pressure",
            "auto",
            "the host tier yields its blocks to disk: set host_budget and disk_dir",
        )


def _check_cxl(config: CacheConfig, put: Any) -> None:
    """cxl_budget: bytes, below a host tier, on a CPU-less NUMA node of this machine
    that holds it (the tier is allocated up front, bound to that node)."""
    given = config.cxl_budget
    put("cxl_budget", parse_size(given, "cxl_budget", allow_zero=True))
    if not config.cxl_budget:
        return
    if config.host_budget == 0:
        raise ConfigError.field(
            "cxl_budget", given, "the cxl tier sits below the host tier: set host_budget too"
        )
    if config.numa == "off":
        raise ConfigError.field(
            "cxl_budget",
            given,
            "the cxl tier is bound to its NUMA node: numa='off' cannot place it",
        )
    found = cxl_memory(read_topology())
    if found is None:
        raise ConfigError.field(
            "cxl_budget", given, "this machine has no CPU-less NUMA node (CXL memory): leave it 0"
        )
    if config.cxl_budget > found[0]:
        raise ConfigError.field(
            "cxl_budget", given, f"larger than the {format_bytes(found[0])} of CXL memory here"
        )


def _check_device(value: Any) -> str:
    """'auto', 'cpu', 'cuda' or 'cuda:N' (also a torch.device), present on this machine."""
    if type(value).__module__ == "torch" and type(value).__name__ == "device":
        value = str(value)
    if not isinstance(value, str):
        raise ConfigError.field("device", value, DEVICE_HELP)
    if value in ("auto", "cpu"):
        return value
    index = 0
    if value != "cuda":
        head, _, tail = value.partition(":")
        if head != "cuda" or not tail.isdigit():
            raise ConfigError.field("device", value, DEVICE_HELP)
        index = int(tail)
    if not torch.cuda.is_available():
        raise ConfigError.field(
            "device",
            value,
            "CUDA is not available here (torch.cuda.is_available() is False): use 'cpu' or 'auto'",
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise ConfigError.field("device", value, f"this machine has cuda:0 to cuda:{count - 1}")
    return value


def _bind_calibrated(config: CacheConfig, put: Any) -> None:
    """Calibrated codec names (lowrank-*, heads*) get the digest of `codec_calibration`;
    one without a calibration is an error naming the field and the fix."""
    path = config.codec_calibration
    if path is not None and (not isinstance(path, str) or not path):
        raise ConfigError.field(FIELD, path, f"the path of a calibration file; {FIX}")
    cal = None
    for name in ("device_codec", "host_codec", "disk_codec", "remote_codec"):
        value = getattr(config, name)
        if not isinstance(value, str) or not value:
            continue
        base, digest = split_name(value)
        if not is_calibrated(base):
            continue
        if path is None:
            if digest is None:
                raise ConfigError.field(
                    name,
                    value,
                    f"a calibrated codec: set {FIELD} to the model's calibration file ({FIX})",
                )
            continue  # "@digest": a calibration loaded earlier in this process
        cal = cal or load_calibration(path)
        if digest is not None and digest != cal.digest:
            raise ConfigError.field(
                name, value, f"made with calibration {digest}, but {FIELD} is {cal.digest}"
            )
        calibrated_codec(base, name, cal)  # checks the file has what the codec needs
        put(name, f"{base}@{cal.digest}")


def _check_codecs(config: CacheConfig) -> None:
    for name in ("device_codec", "host_codec", "disk_codec"):
        value = getattr(config, name)
        if not isinstance(value, str) or not value:
            raise ConfigError.field(name, value, "a codec name such as 'none', 'int8', 'int4'")
        codec = get_codec(value, name)
        if name == "device_codec" and not codec.lossless:
            raise ConfigError.field(
                name,
                value,
                "the device tier keeps full precision (it is the residual window); put "
                "lossy codecs on host_codec / disk_codec",
            )


def _check_machine(config: CacheConfig, given: dict[str, Any]) -> None:
    """Budgets this machine cannot hold: the tiers allocate them up front."""
    ram = machine_ram()
    if ram and config.host_budget > ram:
        raise ConfigError.field(
            "host_budget",
            given["host_budget"],
            f"larger than {format_bytes(ram)} of RAM here (the host tier is allocated up "
            "front): lower it or put the rest on disk (disk_dir + disk_budget)",
        )
    if config.device_budget is not None:
        what, memory = device_memory(config.device)
        if memory and config.device_budget > memory:
            raise ConfigError.field(
                "device_budget",
                given["device_budget"],
                f"larger than the {format_bytes(memory)} of {what}: lower it and offload "
                "the rest (host_budget / disk_dir)",
            )


__all__ = [
    "BLOCK_SIZE_MAX",
    "BLOCK_SIZE_MIN",
    "COLD_ATTENTION",
    "HOST_PRESSURE",
    "FIELD_NAMES",
    "MAX_TOKENS",
    "POLICIES",
    "CacheConfig",
    "check_cache_config",
    "check_field_names",
    "check_remote_url",
    "redact_url",
]
