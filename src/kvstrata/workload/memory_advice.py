"""The planner's advice: the reasons for and against offloading (the seed's decision
guide, section 5, with the numbers) and the verdict they add up to; and, when a plan
does not fit, what to change, in words naming the `kvstrata plan` flags that change it
(--concurrency, --gpu-memory, --host-memory, --disk-link, --disk-capacity, --codec).
The planner computes the numbers and decides which limit a plan hits; this module
weighs and words them (`MemoryPlan.reasons_for / reasons_against / verdict / raise_hint`)."""

from __future__ import annotations

from kvstrata.platform.hardware import GIB, SLOW_LINK_BANDWIDTH, Hardware

# The seed's decision guide (section 5), as thresholds.
SMALL_GPU, LARGE_GPU = 32 * GIB, 80 * GIB
LONG_CONTEXT, SHORT_CONTEXT = 8 * 1024, 2 * 1024
MANY_REQUESTS = 4
PLENTY_HOST_RAM, PLENTY_DISK = 64 * GIB, 10**12


def offload_reasons(
    hardware: Hardware,
    *,
    context_tokens: int,
    concurrency: int,
    priority: str,
    fits: bool,
    kv_room: float,
    stored_total: float,
    tiered_step_s: float,
) -> tuple[list[str], list[str]]:
    """The seed's decision guide (5.1 recommend / 5.2 advise against), with the numbers:
    (reasons for offloading, reasons against).

    Args:
        hardware: the GPU, its host link, host RAM and disk.
        context_tokens / concurrency / priority: what the model must serve.
        fits: whether all stored KV fits in `kv_room` (bytes free for KV on the GPU).
        stored_total: stored KV bytes of all requests.
        tiered_step_s: the offloaded decode step's lower bound (seconds).
    """
    pro: list[str] = []
    con: list[str] = []
    gpu, link = hardware.gpu, hardware.link
    mem, ctx, n = gpu.memory_bytes / GIB, context_tokens, concurrency
    if kv_room <= 0:
        con.append(f"the weights do not leave room for KV on a {mem:.0f} GiB GPU")
    elif fits:
        con.append(
            f"all KV ({stored_total / GIB:.2f} GiB) fits in the {kv_room / GIB:.2f} GiB free "
            "on the GPU: offload would only add transfers"
        )
    else:
        pro.append(
            f"KV needs {stored_total / GIB:.2f} GiB but only {kv_room / GIB:.2f} GiB is free "
            "on the GPU after weights and reserve"
        )
    if gpu.memory_bytes <= SMALL_GPU:
        pro.append(f"GPU memory {mem:.0f} GiB <= 32 GiB")
    if gpu.memory_bytes >= LARGE_GPU:
        con.append(f"GPU memory {mem:.0f} GiB >= 80 GiB")
    if hardware.host_memory >= PLENTY_HOST_RAM:
        pro.append(f"host RAM {hardware.host_memory / GIB:.0f} GiB >= 64 GiB for cold blocks")
    if hardware.disk is not None and (
        hardware.disk_capacity is None or hardware.disk_capacity >= PLENTY_DISK
    ):
        pro.append(f"fast NVMe tier available ({hardware.disk.name})")
    if ctx >= LONG_CONTEXT:
        pro.append(f"context {ctx} tokens >= 8k")
    if ctx <= SHORT_CONTEXT:
        con.append(f"context {ctx} tokens <= 2k: little history to offload")
    if n >= MANY_REQUESTS:
        pro.append(f"{n} concurrent requests >= 4")
    if priority == "throughput":
        pro.append("throughput matters more than single-request latency")
    else:
        step = tiered_step_s * 1e3
        con.append(f"latency-sensitive: offloaded decode step >= {step:.1f} ms (bandwidth bound)")
    if link.bandwidth <= SLOW_LINK_BANDWIDTH:
        con.append(f"host link {link.bandwidth / 1e9:.0f} GB/s ({link.name}) is PCIe 3.0 x8 class")
    return pro, con


def offload_verdict(
    kv_room: float, fits: bool, reasons_for: list[str], reasons_against: list[str]
) -> str:
    """Offload "recommend", "neutral" or "advise against": the reasons' balance, with
    no room for KV always against and KV that fits at best neutral."""
    score = len(reasons_for) - len(reasons_against)
    if kv_room <= 0:
        return "advise against"
    if fits:
        return "neutral" if score > 0 else "advise against"
    # Any of the seed's "not recommended" conditions (5.2) rules out a plain
    # recommendation: offload is then the price of fitting, not a win.
    if not reasons_against and score >= 1:
        return "recommend"
    return "neutral" if score >= 0 else "advise against"


# -- what to change when a plan does not fit ------------------------------------------------


def no_kv_room_hint(weights_bytes: int, weights_dtype: str, reserve_bytes: int) -> str:
    """The weights and the reserve leave no GPU memory for KV."""
    return (
        f"the weights ({weights_bytes / GIB:.2f} GiB {weights_dtype}) plus the reserve "
        f"({reserve_bytes / GIB:.2f} GiB) leave no GPU memory for KV: use a larger GPU or "
        "quantized weights (KV offloading keeps the weights resident)"
    )


def no_resident_block_hint(block_size: int, kv_room_bytes: float) -> str:
    """Not even one block per request (plus the staging buffer) fits the KV room."""
    return (
        f"even one {block_size}-token block per request does not fit the "
        f"{max(kv_room_bytes, 0) / GIB:.2f} GiB left for KV: lower --concurrency or raise "
        "--gpu-memory"
    )


def unplaced_hint(unplaced_bytes: int, need_host_bytes: int, has_disk: bool, codec: str) -> str:
    """Cold KV that neither the host nor the disk tier can hold: raise the host memory to
    `need_host_bytes`, add (or grow) a disk tier, or compress (when `codec` is "none")."""
    hint = (
        f"{unplaced_bytes / GIB:.2f} GiB of cold KV has nowhere to go: raise --host-memory to "
        f">= {need_host_bytes / GIB:.1f} GiB"
    )
    if not has_disk:
        hint += f" or add a disk tier (--disk-link nvme-gen4, >= {unplaced_bytes / GIB:.1f} GiB)"
    else:
        hint += f" or --disk-capacity by {unplaced_bytes / GIB:.1f} GiB"
    if codec == "none":
        hint += ", or store KV compressed (--codec int8 / int4)"
    return hint
