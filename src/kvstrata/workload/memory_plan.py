"""Memory planner: model geometry + hardware + workload -> budgets, bounds and a verdict.

Pure maths, no I/O. The numbers follow the seed documents and are checked by tests:

    Llama-2-7B fp16: 524,288 B/token; 8k tokens = 4 GiB per request.
    Keep the newest 1k of 8k tokens resident: saves (4 - 0.5) / 4 = 87.5 % of device KV.
    int8 + 80 % offloaded: (4 - 0.4) / 4 = 90 % (89.7 % once int8's scales are counted).
    4 GiB over PCIe 4.0 (25 GB/s measured): >= 172 ms per decode step.

Tiers, per request (newest tokens on the right; CXL memory, a CPU-less NUMA node,
between host RAM and disk when the hardware has it):

    | cold: host RAM, then disk (oldest)          | hot: device (resident) |
    |<---------- context - resident ------------->|<---- resident ------->|

Decode-step lower bounds assume perfect overlap: every stored KV byte is read once from
device memory (HBM bound), and every cold byte crosses the host link once per step (the
staging path), disk bytes also crossing the disk link.

`plan` runs in stages that each return a value (GPU memory, tier plan, step bounds,
notes, the limit it hits); kvstrata.workload.memory_advice weighs the reasons into a verdict
and words what to change when a plan does not fit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from kvstrata.codecs.registry import codec_names
from kvstrata.core.errors import ConfigError
from kvstrata.core.units import MAX_TOKENS, format_bytes
from kvstrata.model.dtypes import DTYPES, dtype_name
from kvstrata.model.geometry import KVGeometry
from kvstrata.platform.hardware import Hardware
from kvstrata.workload import memory_advice

PRIORITIES = ("throughput", "latency")
PLAN_BLOCK_MIN, PLAN_BLOCK_MAX = 16, 512  # block sizes a plan models (the cache takes 1-4096)
TABLE_CONTEXTS = tuple(1024 * k for k in (1, 2, 4, 8, 16, 32, 64, 128))
TABLE_CODECS = ("fp16", "fp8", "int8", "int4")  # "fp16" stands for any 16-bit dtype
HOT_TOKENS = 1024  # the seed: "GPU keeps the most recent ~1k tokens"
RESIDENT_MIN, RESIDENT_MAX = 0.05, 0.20  # the seed: "keep 5-20 % on the GPU"
HOST_USABLE_FRACTION = 0.8  # leave host RAM for the OS, the process and pinned limits
STAGING_TOKENS = 4096  # per layer, double-buffered (CacheConfig.staging_tokens default)


@dataclass(frozen=True)
class Workload:
    """What the model must serve.

    Fields:
        context_tokens: tokens per request (prompt + generated).
        concurrency: requests decoded together.
        priority: "throughput" or "latency".
        weights_dtype: dtype of the weights (sizes them); None = the model's dtype.
        kv_dtype: dtype of the KV; None = the model's dtype.
        codec: codec of the stored KV in every tier ("none" = kv_dtype).
        block_size: tokens per block, 16-512 (the sizes whose per-block overhead and
            transfer granularity the planner's bounds model); None = chosen (64-256).
        params: parameter count; None = from the geometry.
        reserve_fraction / reserve_bytes: GPU memory kept for activations, the CUDA
            context and fragmentation (reserve_bytes wins when given).
        resident_fraction: fraction of each request kept on the device; None = the
            newest ~1k tokens, clamped to 5-20 % of the context.
    """

    context_tokens: int
    concurrency: int = 1
    priority: str = "throughput"
    weights_dtype: str | None = None
    kv_dtype: str | None = None
    codec: str = "none"
    block_size: int | None = None
    params: int | None = None
    reserve_fraction: float = 0.10
    reserve_bytes: int | None = None
    resident_fraction: float | None = None

    def __post_init__(self) -> None:
        for name in ("context_tokens", "concurrency"):
            value = getattr(self, name)
            if not _whole(value) or not 0 < value <= MAX_TOKENS:
                raise ConfigError.field(name, value, f"a whole number from 1 to {MAX_TOKENS:,}")
        if self.priority not in PRIORITIES:
            raise ConfigError.field("priority", self.priority, f"one of {', '.join(PRIORITIES)}")
        if self.block_size is not None and (
            not _whole(self.block_size) or not PLAN_BLOCK_MIN <= self.block_size <= PLAN_BLOCK_MAX
        ):
            raise ConfigError.field(
                "block_size",
                self.block_size,
                f"{PLAN_BLOCK_MIN}-{PLAN_BLOCK_MAX} tokens for a plan (64-256 typical)",
            )
        if not _real(self.reserve_fraction) or not 0 <= self.reserve_fraction < 1:
            raise ConfigError.field("reserve", self.reserve_fraction, "a fraction in [0, 1)")
        reserve = self.reserve_bytes
        if reserve is not None and (not _whole(reserve) or reserve < 0):
            raise ConfigError.field("reserve", self.reserve_bytes, "a whole number of bytes >= 0")
        frac = self.resident_fraction
        if frac is not None and (not _real(frac) or not 0 < frac <= 1):
            raise ConfigError.field("resident_fraction", frac, "a fraction in (0, 1]")
        if self.params is not None and (not _whole(self.params) or self.params <= 0):
            raise ConfigError.field("params", self.params, "a positive whole parameter count")


def _whole(value: object) -> bool:
    """An int (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: object) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class MemoryRow:
    """KV bytes at one context length: per request and for `concurrency` requests."""

    context_tokens: int
    per_request: dict[str, float]
    total: dict[str, float]


@dataclass(frozen=True)
class TierPlan:
    """Where the KV goes when it is offloaded (bytes are stored bytes, after the codec)."""

    resident_tokens: int
    resident_fraction: float
    device_bytes: int
    staging_bytes: int
    host_bytes: int
    disk_bytes: int
    host_capacity: int
    disk_capacity: int | None
    unplaced_bytes: int
    cxl_bytes: int = 0
    cxl_capacity: int = 0


@dataclass(frozen=True)
class StepBounds:
    """Decode-step lower bounds (seconds) for all requests, one token each."""

    all_on_gpu_s: float
    hbm_s: float
    host_link_s: float
    disk_link_s: float
    tiered_s: float
    cxl_link_s: float = 0.0

    @property
    def slowdown(self) -> float:
        """Tiered bound over the all-on-GPU bound."""
        return self.tiered_s / self.all_on_gpu_s


@dataclass(frozen=True)
class MemoryPlan:
    """The planner's answer (see `plan`). `to_dict()` is the JSON form."""

    model: str
    geometry: KVGeometry
    hardware: Hardware
    workload: Workload
    kv_dtype: str
    codec: str
    block_size: int
    bytes_per_token: float
    stored_bytes_per_token: float
    weights_bytes: int
    reserve_bytes: int
    kv_room_bytes: int
    kv_per_request_bytes: float
    kv_total_bytes: float
    stored_total_bytes: float
    fits_on_gpu: bool
    table: list[MemoryRow]
    tiers: TierPlan | None
    bounds: StepBounds | None
    memory_saved: float | None
    feasible: bool
    verdict: str
    reasons_for: list[str] = field(default_factory=list)
    reasons_against: list[str] = field(default_factory=list)
    raise_hint: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (bandwidths in bytes/s, sizes in bytes, times in s)."""
        data = asdict(self)
        if self.bounds is not None:
            data["bounds"]["slowdown"] = self.bounds.slowdown
        data["geometry"]["sliding_layers"] = list(self.geometry.sliding_layers)
        return data


def transfer_seconds(num_bytes: float, bandwidth: float) -> float:
    """Time to move `num_bytes` at `bandwidth` bytes/s (a lower bound, no latency)."""
    return num_bytes / bandwidth


def memory_saved(baseline_bytes: float, device_bytes: float) -> float:
    """Fraction of device KV memory saved: (baseline - device) / baseline.

    The seed's examples: memory_saved(4, 0.5) = 0.875; memory_saved(4, 0.4) = 0.9.
    """
    return (baseline_bytes - device_bytes) / baseline_bytes


def _round_up(value: float, multiple: int) -> int:
    return int(math.ceil(value / multiple)) * multiple


def choose_block_size(workload: Workload) -> int:
    """64-256 tokens (seed 4.2.3): small blocks waste less transfer on latency-bound
    work; large ones cut per-block overhead on long contexts."""
    if workload.block_size is not None:
        return workload.block_size
    if workload.priority == "latency":
        return 64
    return 256 if workload.context_tokens >= 32 * 1024 else 128


def resident_tokens(workload: Workload, block_size: int) -> int:
    """Tokens of each request kept on the device, in whole blocks, <= the context."""
    ctx = workload.context_tokens
    if workload.resident_fraction is not None:
        tokens = workload.resident_fraction * ctx
    else:
        tokens = min(max(HOT_TOKENS, RESIDENT_MIN * ctx), RESIDENT_MAX * ctx)
    return min(ctx, max(block_size, _round_up(tokens, block_size)))


def _memory_table(geometry: KVGeometry, workload: Workload, kv_dtype: str, block_size: int):
    """KV bytes at the table's context lengths, for the TABLE_CODECS that fit the geometry."""
    names = set(codec_names())
    codecs = []
    for codec in TABLE_CODECS:
        if codec in DTYPES:
            codecs.append(codec)
            continue
        try:  # a codec may not fit this geometry (int4 g64 on an 8-wide head): leave it out
            geometry.bytes_per_token(codec, kv_dtype, block_size)
        except ConfigError:
            continue
        if codec in names:
            codecs.append(codec)
    rows = []
    for ctx in TABLE_CONTEXTS:
        per = {
            c: geometry.bytes_for_context(ctx, c, kv_dtype if c not in DTYPES else None, block_size)
            for c in codecs
        }
        rows.append(MemoryRow(ctx, per, {c: v * workload.concurrency for c, v in per.items()}))
    return rows


def plan(geometry: KVGeometry, hardware: Hardware, workload: Workload) -> MemoryPlan:
    """Size the KV cache of `workload` on `hardware` and decide whether to offload.

    Args:
        geometry: the model's KV geometry (`kvstrata.workload.zoo.load_geometry`).
        hardware: GPU, links and host RAM (`kvstrata.platform.hardware.make_hardware`).
        workload: context, concurrency, priority, dtypes, codec.

    Returns:
        A `MemoryPlan`: memory table, fit, tier budgets, decode-step bounds, verdict + reasons.

    Raises:
        ConfigError: unknown codec/dtype, or no parameter count (pass `params`).
    """
    _check_hardware(hardware)
    kv_dtype = dtype_name(workload.kv_dtype or geometry.dtype, "kv_dtype")
    weights_dtype = dtype_name(workload.weights_dtype or geometry.dtype, "weights_dtype")
    codec = workload.codec
    block_size = choose_block_size(workload)
    params = workload.params if workload.params is not None else geometry.num_params
    if params is None:
        raise ConfigError.field("params", None, "unknown for this model: pass --params, e.g. 7e9")
    n, ctx = workload.concurrency, workload.context_tokens
    bpt = geometry.bytes_per_token(kv_dtype)
    stored_bpt = geometry.bytes_per_token(codec, kv_dtype, block_size)
    weights = params * DTYPES[weights_dtype][1]
    reserve = _reserve_bytes(workload, hardware)
    kv_room = hardware.gpu.memory_bytes - weights - reserve
    per_request = geometry.bytes_for_context(ctx, kv_dtype)
    kv_total = per_request * n
    stored_total = geometry.bytes_for_context(ctx, codec, kv_dtype, block_size) * n
    fits = stored_total <= kv_room

    # The tier plan (computed even when everything fits: it is what offload would cost).
    tiers, notes = _tier_plan(geometry, hardware, workload, kv_dtype, block_size, kv_room)
    bounds = _step_bounds(hardware, weights + stored_total, tiers)
    notes += _notes(geometry, hardware, kv_room, bounds)
    raise_hint = _raise_hint(
        hardware, workload, kv_room, tiers, weights, weights_dtype, reserve, block_size
    )
    reasons_for, reasons_against = memory_advice.offload_reasons(
        hardware,
        context_tokens=ctx,
        concurrency=n,
        priority=workload.priority,
        fits=fits,
        kv_room=kv_room,
        stored_total=stored_total,
        tiered_step_s=bounds.tiered_s,
    )
    return MemoryPlan(
        model=geometry.name,
        geometry=geometry,
        hardware=hardware,
        workload=workload,
        kv_dtype=kv_dtype,
        codec=codec,
        block_size=block_size,
        bytes_per_token=bpt,
        stored_bytes_per_token=stored_bpt,
        weights_bytes=weights,
        reserve_bytes=reserve,
        kv_room_bytes=kv_room,
        kv_per_request_bytes=per_request,
        kv_total_bytes=kv_total,
        stored_total_bytes=stored_total,
        fits_on_gpu=fits,
        table=_memory_table(geometry, workload, kv_dtype, block_size),
        tiers=tiers,
        bounds=bounds,
        memory_saved=memory_saved(kv_total, tiers.device_bytes),
        feasible=raise_hint is None,
        verdict=memory_advice.offload_verdict(kv_room, fits, reasons_for, reasons_against),
        reasons_for=reasons_for,
        reasons_against=reasons_against,
        raise_hint=raise_hint,
        notes=notes,
    )


def _reserve_bytes(workload: Workload, hardware: Hardware) -> int:
    """GPU memory kept back from weights and KV: `reserve_bytes`, else the fraction.

    Raises:
        ConfigError: a reserve of the GPU's whole memory or more.
    """
    gpu = hardware.gpu
    if workload.reserve_bytes is None:
        return int(workload.reserve_fraction * gpu.memory_bytes)
    reserve = workload.reserve_bytes
    if reserve >= gpu.memory_bytes:
        raise ConfigError.field(
            "reserve",
            format_bytes(reserve),
            f"must be less than the GPU's memory ({format_bytes(gpu.memory_bytes)}, "
            f"{gpu.name}): e.g. '10%' or '2GiB'",
        )
    return reserve


def _tier_plan(
    geometry: KVGeometry,
    hardware: Hardware,
    workload: Workload,
    kv_dtype: str,
    block_size: int,
    kv_room: int,
) -> tuple[TierPlan, list[str]]:
    """Where the KV goes offloaded: the newest tokens of each request on the device (cut
    to what `kv_room` holds beside the staging buffer), the rest on the host, then on disk;
    with a note when the resident tokens were cut."""
    n, ctx, codec = workload.concurrency, workload.context_tokens, workload.codec

    def stored(tokens: int) -> float:
        return geometry.bytes_for_context(tokens, codec, kv_dtype, block_size)

    notes = []
    res_tokens = resident_tokens(workload, block_size)
    # Cold blocks stream through a device buffer one layer at a time, double-buffered.
    staging_tokens = min(STAGING_TOKENS, n * ctx)
    staging = int(math.ceil(geometry.layer_bytes(2 * staging_tokens, codec, kv_dtype, block_size)))
    if kv_room > 0 and n * stored(res_tokens) + staging > kv_room:
        stored_bpt = geometry.bytes_per_token(codec, kv_dtype, block_size)
        fit_tokens = (kv_room - staging) / n / stored_bpt
        cut = max(block_size, int(fit_tokens // block_size) * block_size)
        if cut < res_tokens:
            notes.append(
                f"resident tokens cut from {res_tokens} to {cut} per request to fit the GPU"
            )
            res_tokens = min(res_tokens, cut)
    device = int(math.ceil(n * stored(res_tokens)))
    cold = int(math.ceil(stored(ctx) * n - device))
    host_cap = int(hardware.host_memory * HOST_USABLE_FRACTION)
    host = min(cold, host_cap)
    cxl_cap = int(hardware.cxl_memory * HOST_USABLE_FRACTION) if hardware.cxl else 0
    cxl = min(cold - host, cxl_cap)
    disk = 0
    if hardware.disk is not None:
        disk = cold - host - cxl
        if hardware.disk_capacity is not None:
            disk = min(disk, hardware.disk_capacity)
    tiers = TierPlan(
        resident_tokens=res_tokens,
        resident_fraction=res_tokens / ctx,
        device_bytes=device,
        staging_bytes=staging,
        host_bytes=host,
        disk_bytes=disk,
        host_capacity=host_cap,
        disk_capacity=hardware.disk_capacity,
        unplaced_bytes=cold - host - cxl - disk,
        cxl_bytes=cxl,
        cxl_capacity=cxl_cap,
    )
    return tiers, notes


def _step_bounds(hardware: Hardware, hbm_bytes: float, tiers: TierPlan) -> StepBounds:
    """Decode-step lower bounds: `hbm_bytes` (weights + stored KV) read from device
    memory, the cold bytes over the host link, the CXL and disk bytes over theirs."""
    hbm = transfer_seconds(hbm_bytes, hardware.gpu.bandwidth)
    cold = tiers.host_bytes + tiers.cxl_bytes + tiers.disk_bytes
    host_link = transfer_seconds(cold, hardware.link.bandwidth)
    disk_link = (
        transfer_seconds(tiers.disk_bytes, hardware.disk.bandwidth) if hardware.disk else 0.0
    )
    cxl_link = transfer_seconds(tiers.cxl_bytes, hardware.cxl.bandwidth) if hardware.cxl else 0.0
    return StepBounds(
        all_on_gpu_s=hbm,
        hbm_s=hbm,
        host_link_s=host_link,
        disk_link_s=disk_link,
        tiered_s=max(hbm, host_link, disk_link, cxl_link),
        cxl_link_s=cxl_link,
    )


def _notes(geometry: KVGeometry, hardware: Hardware, kv_room: int, bounds: StepBounds) -> list[str]:
    """What a plan's numbers leave unsaid: a slow cold path, MLA's latent sizes."""
    notes = []
    if kv_room > 0 and bounds.slowdown > 2:
        notes.append(
            f"streaming every cold byte over {hardware.link.name} each step is "
            f"{bounds.slowdown:.1f}x the all-on-GPU bound; attending cold blocks where they "
            "live (cold_attention='local') or fetching only selected blocks avoids that traffic"
        )
    if geometry.is_mla:
        notes.append("MLA: sizes are the compressed latent, as MLA-aware attention caches it")
    return notes


def _raise_hint(
    hardware: Hardware,
    workload: Workload,
    kv_room: int,
    tiers: TierPlan,
    weights: int,
    weights_dtype: str,
    reserve: int,
    block_size: int,
) -> str | None:
    """What to change when the plan does not fit, for the first limit it hits (no room
    for KV, not one resident block, cold KV with nowhere to go); None when it fits."""
    if kv_room <= 0:
        return memory_advice.no_kv_room_hint(weights, weights_dtype, reserve)
    if tiers.device_bytes + tiers.staging_bytes > kv_room:
        return memory_advice.no_resident_block_hint(block_size, kv_room)
    if tiers.unplaced_bytes > 0:
        cold = tiers.host_bytes + tiers.disk_bytes + tiers.unplaced_bytes  # beside any CXL
        need_host = int(math.ceil(cold / HOST_USABLE_FRACTION))
        has_disk = hardware.disk is not None
        return memory_advice.unplaced_hint(
            tiers.unplaced_bytes, need_host, has_disk, workload.codec
        )
    return None


def _check_hardware(hardware: Hardware) -> None:
    """ConfigError for a bandwidth or size that is not a finite positive number (an
    infinite bandwidth would make every bound 0 and the slowdown 0/0)."""
    values = {
        "gpu_memory": hardware.gpu.memory_bytes,
        "gpu_bandwidth": hardware.gpu.bandwidth,
        "link_bandwidth": hardware.link.bandwidth,
        "disk_bandwidth": hardware.disk.bandwidth if hardware.disk is not None else 1.0,
        "cxl_bandwidth": hardware.cxl.bandwidth if hardware.cxl is not None else 1.0,
    }
    for name, value in values.items():
        if not _real(value) or value <= 0:
            raise ConfigError.field(name, value, "a finite number > 0")
    if not _real(hardware.host_memory) or hardware.host_memory < 0:
        raise ConfigError.field("host_memory", hardware.host_memory, "a byte count >= 0")
