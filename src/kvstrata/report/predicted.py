"""`kvstrata plan` next to the measurement: for every cache the strategy and context
sections ran, the planner's device / staging / host / disk bytes and decode-step bound
against the bytes the cache held and the step time measured.

The planner is given this machine as it was measured: "device" bandwidth = a raw
`copy_` in memory, host link = the host tier's read rate, disk link = the disk tier's
read rate (bench tiers, page cache warm), memory = this machine's RAM. Of each cache it is
given the tokens, the block size and the device share the section asked for — not the
cache's device budget — raised to the placement floor where the host codec is lossy (the
sinks', the residual window's and the open block's blocks, which such a cache keeps on
the device whatever the share: shown as its own column). With a disk tier it is also
given the host tier's capacity from the cache's host_budget (it fills the host first,
the cache splits the cold blocks half and half), so the host / disk split is the cache's
and their sum the planner's. It applies one codec to every tier while the caches keep
the device tier exact: it is asked once with codec "none" (device and staging bytes) and
once with the lower tiers' codec (host / disk bytes, step bound). Bytes must agree to
within one block per sequence per layer group; a step-time bound off by more than 2x is
flagged. Measured (`section`) and rendered (`render`, its part of report.md) here.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from kvstrata.report.session import Session
from kvstrata.report.tables import mib, table

STEP_TOLERANCE = 2.0  # measured / predicted outside [1/2, 2]: flagged


def case(
    section: str,
    label: str,
    geometry: dict[str, Any],
    variant: Any,
    cache_kwargs: dict[str, Any] | None,
    step_s: float,
    asked: float,
) -> dict[str, Any]:
    """What the planner needs about one measured cache, and what was measured.

    Args:
        section: the section that measured it.
        label: the case's name.
        geometry: `quality.geometry_of(model)`.
        variant: the timed `kvstrata.bench.decode.Variant` (its last cache's bytes).
        cache_kwargs: the TieredCache's CacheConfig fields; None for a DynamicCache.
        step_s: median seconds per decode step.
        asked: the device share the section asked `kvstrata.model.budgets.placement` for
            (1.0: everything on the device).

    Returns:
        A JSON-able dict.
    """
    tokens = variant.context + len(variant.results[-1].tokens)
    held = dict(variant.held or {})
    kwargs = cache_kwargs or {}
    stats = variant.stats or {}
    groups = len(stats.get("groups", [])) or 1
    return {
        "section": section,
        "case": label,
        "geometry": geometry,
        "tokens": tokens,
        "tiered": cache_kwargs is not None,
        "block_size": kwargs.get("block_size"),
        "asked_resident": asked,
        "floor_tokens": floor_tokens(kwargs) if asked < 1.0 else 0,
        "lower_codec": kwargs.get("host_codec", "none"),
        "host_budget": kwargs.get("host_budget", 0),
        "disk": kwargs.get("disk_dir") is not None,
        "groups": groups,
        "measured": {
            "device": held.get("device", 0),
            "host": held.get("host", 0),
            "disk": held.get("disk", 0),
            "staging": held.get("staging", 0),
            "step_s": step_s,
        },
    }


def floor_tokens(cache_kwargs: dict[str, Any]) -> int:
    """Tokens per layer group an offloaded cache keeps on the device whatever the asked
    share (`kvstrata.model.budgets.placement`'s rule, from the cache's config): with a lossy
    host codec the sinks', the residual window's and the open block's blocks, else one
    block."""
    from kvstrata.codecs.registry import get_codec

    if not cache_kwargs:
        return 0
    bs = cache_kwargs["block_size"]
    codec = cache_kwargs.get("host_codec", "none")
    if get_codec(codec).lossless:
        return bs
    sinks, residual = cache_kwargs["sink_tokens"], cache_kwargs["residual_tokens"]
    return bs * (1 + -(-residual // bs) + -(-sinks // bs))


def _hardware(bandwidth: dict[str, float], host_memory: int) -> Any:
    from kvstrata.platform.hardware import GPUSpec, Hardware, LinkSpec, machine_ram

    return Hardware(
        gpu=GPUSpec(
            "this machine (device tier = RAM)", machine_ram() or 2**40, bandwidth["device"]
        ),
        link=LinkSpec("host tier read (measured)", bandwidth["link"]),
        disk=LinkSpec("disk tier read (measured)", bandwidth["disk"]),
        host_memory=host_memory,
    )


def compare_case(c: dict[str, Any], bandwidth: dict[str, float], block_size: int) -> dict:
    """The planner's prediction for one case next to its measurement.

    Args:
        c: a `case()` dict.
        bandwidth: bytes/s of "device", "link" and "disk" (see `system.bandwidths`).
        block_size: block size for a DynamicCache case (its bytes do not depend on it).

    Returns:
        predicted / measured bytes per tier, the tolerance, step seconds and ratio.
    """
    from kvstrata.model.geometry import KVGeometry
    from kvstrata.platform.hardware import machine_ram
    from kvstrata.workload.memory_plan import HOST_USABLE_FRACTION, Workload, plan

    geometry = KVGeometry(
        **{**c["geometry"], "sliding_layers": tuple(c["geometry"]["sliding_layers"])}
    )
    tokens, bs = c["tokens"], c["block_size"] or block_size
    asked, floor = c["asked_resident"], c["floor_tokens"]
    resident = min(1.0, asked)
    if floor >= resident * tokens:  # the floor, a whole number of blocks, wins:
        # a share just under it, which the planner rounds up to exactly its blocks
        resident = min(1.0, (floor - 0.5) / tokens)
    host_memory = machine_ram()
    if c["disk"]:  # the planner fills the host up to 80 % of its RAM, then the disk
        host_memory = math.ceil(c["host_budget"] / HOST_USABLE_FRACTION)
    hardware = _hardware(bandwidth, host_memory)
    exact = Workload(
        context_tokens=tokens, block_size=bs, reserve_bytes=0, resident_fraction=resident
    )
    on_device = plan(geometry, hardware, exact)
    lower = c["lower_codec"]
    below = on_device if lower == "none" else plan(geometry, hardware, replace(exact, codec=lower))
    offloaded = on_device.tiers.resident_tokens < tokens
    predicted = {
        "device": on_device.tiers.device_bytes,
        "host": below.tiers.host_bytes if offloaded else 0,
        "disk": below.tiers.disk_bytes if offloaded else 0,
        "staging": on_device.tiers.staging_bytes if offloaded else 0,
        "step_s": below.bounds.tiered_s if offloaded else on_device.bounds.all_on_gpu_s,
    }
    measured = c["measured"]
    # one block per sequence (one here) per layer group: a group's block spans its
    # layers, so one block of every group is block_size tokens of all layers
    tolerance = {
        tier: bs * geometry.bytes_per_token(codec, None, bs)
        for tier, codec in (("device", "none"), ("host", lower), ("disk", lower))
    }
    within = {t: abs(predicted[t] - measured[t]) <= tolerance[t] for t in tolerance}
    ratio = measured["step_s"] / predicted["step_s"]
    return {
        "section": c["section"],
        "case": c["case"],
        "tokens": tokens,
        "asked_resident": asked,
        "floor_tokens": floor,
        "resident_fraction": on_device.tiers.resident_fraction,
        "host_capacity_from_cache": c["disk"],
        "lower_codec": lower,
        "disk": c["disk"],
        "predicted": predicted,
        "measured": measured,
        "tolerance": tolerance,
        "bytes_within_one_block": within,
        "step_ratio": ratio,
        "step_off_by_more_than_2x": not 1 / STEP_TOLERANCE <= ratio <= STEP_TOLERANCE,
        "step_bound": "max(HBM, host link, disk link)" if offloaded else "HBM (all on device)",
    }


def section(session: Session) -> dict[str, Any]:
    """The planner next to every case the strategy and context sections measured."""
    from kvstrata.report.system import bandwidths

    cases = [
        c for name in ("strategy", "context") for c in session.data.get(name, {}).get("cases", [])
    ]
    if not cases:
        failed = [n for n in ("strategy", "context") if "error" in session.data.get(n, {})]
        why = f"{' and '.join(failed)} failed" if failed else "neither strategy nor context ran"
        raise RuntimeError(f"no measured cache to compare ({why})")
    bandwidth = bandwidths(session)
    rows = [compare_case(c, bandwidth, session.scale.block_size) for c in cases]
    session.tick("planner: predicted vs measured")
    off = [r["case"] for r in rows if r["step_off_by_more_than_2x"]]
    mismatched = [r["case"] for r in rows if not all(r["bytes_within_one_block"].values())]
    ratios = sorted(r["step_ratio"] for r in rows)
    return {
        "bandwidth": bandwidth,
        "rows": rows,
        "summary": {
            "cases": len(rows),
            "bytes_mismatched": mismatched,
            "step_off_by_more_than_2x": off,
            "step_ratio_min": ratios[0] if ratios else None,
            "step_ratio_max": ratios[-1] if ratios else None,
        },
        "command": session.section_command("planner"),
    }


def _floor(r: dict[str, Any]) -> str:
    floor = r.get("floor_tokens", 0)
    if not floor:
        return "–"
    binds = floor >= r["asked_resident"] * r["tokens"]
    return f"{floor} tokens" + (" (used)" if binds else "")


def step_reason(r: dict[str, Any]) -> str:
    """Why one case's step is off the planner's bound: what that case does that the bound
    (bytes moved at the measured bandwidths) does not count."""
    if r["step_ratio"] < 1 / STEP_TOLERANCE:
        return "the bound assumes traffic this cache avoids"
    why = []
    if r["lower_codec"] != "none" and r["measured"]["host"] + r["measured"]["disk"] > 0:
        why.append(f"decoding {r['lower_codec']} blocks is compute the bound does not count")
    if r["disk"]:
        why.append("per-block disk reads and checksums")
    if not why:
        what = "per-block host reads, " if r["measured"]["host"] else ""
        why.append(f"{what}attention compute over {r['tokens']} tokens / timing noise")
    return "; ".join(why)


def render(d: dict[str, Any]) -> str:
    """The planner part of report.md: the table of cases, what the planner was given, and
    the bytes and step-time verdicts."""
    rows = []
    for r in d["rows"]:
        p, m, ok = r["predicted"], r["measured"], r["bytes_within_one_block"]
        bytes_cells = [
            f"{mib(p[t])} / {mib(m[t])}" + ("" if ok.get(t, True) else " **✗**")
            for t in ("device", "staging", "host", "disk")
        ]
        flag = " **off > 2x**" if r["step_off_by_more_than_2x"] else ""
        rows.append(
            [
                f"{r['section']}: {r['case']}",
                r["tokens"],
                f"{100 * r['asked_resident']:.0f} %",
                _floor(r),
                *bytes_cells,
                f"{1e3 * p['step_s']:.3f}",
                f"{1e3 * m['step_s']:.2f}",
                f"{r['step_ratio']:.1f}x{flag}",
            ]
        )
    text = ""
    if d.get("stale"):
        text += f"> **Stale:** {d['stale']}.\n\n"
    text += table(
        [
            "case",
            "tokens",
            "asked device share",
            "floor (sinks + residual + open block)",
            "device excl. staging: plan / cache",
            "staging: plan / cache",
            "host: plan / cache",
            "disk: plan / cache",
            "step bound ms",
            "measured ms",
            "measured / bound",
        ],
        rows,
    )
    s, bw = d["summary"], d["bandwidth"]
    disk_cases = [r["case"] for r in d["rows"] if r.get("host_capacity_from_cache")]
    text += (
        f"\n\nThe planner was given this machine as measured: memory copy "
        f"{bw['device'] / 1e9:.2f} GB/s as the device bandwidth, host tier reads "
        f"{bw['link'] / 1e9:.2f} GB/s as the link, disk tier reads {bw['disk'] / 1e9:.2f} GB/s "
        "(page cache warm). Of each cache it was given the tokens, the block size and the "
        "device share the section asked for (not the cache's device budget), raised to the "
        'placement floor where that column says "used": a lossy host tier keeps the '
        "sinks, the residual window and the open block on the device whatever the share. "
    )
    if disk_cases:
        text += (
            f"For {', '.join(disk_cases)} it was also given the host tier's capacity from the "
            "cache's host_budget, so the host / disk split is the cache's; only their sum is "
            "the planner's. "
        )
    text += (
        "It applies one codec to every tier; the caches keep the device exact, so it is asked "
        "with codec none for the device and staging bytes and with the lower tiers' codec for "
        "the host / disk bytes and the step bound. The device column excludes the staging "
        "buffer (the strategy and context tables' device KV includes it). The planner sizes "
        "a staging buffer for every offloaded cache (a GPU streams cold blocks through it); "
        "on this machine a cache stages only the lossy blocks it decodes and reads a "
        "lossless host tier in place, so there the cache's staging is 0.\n\n"
    )
    if s["bytes_mismatched"]:
        text += (
            f"**Bytes:** {len(s['bytes_mismatched'])} of {s['cases']} cases differ by more than "
            f"one block per sequence per layer group: {', '.join(s['bytes_mismatched'])}.\n\n"
        )
    else:
        text += (
            f"**Bytes:** in all {s['cases']} cases the planner's device, host and disk bytes "
            "match the cache's to within one block per sequence per layer group.\n\n"
        )
    off = s["step_off_by_more_than_2x"]
    if off:
        text += (
            f"**Step time: the planner's bound is off by more than 2x in {len(off)} of "
            f"{s['cases']} cases** (measured / bound over all cases {s['step_ratio_min']:.1f}x "
            f"to {s['step_ratio_max']:.1f}x). The bound counts only bytes moved — weights and "
            "stored KV at the measured bandwidths — so a step it undercounts spends its time "
            "on work it does not model; per case:\n\n"
        )
        for r in d["rows"]:
            if r["step_off_by_more_than_2x"]:
                case = f"{r['section']}: {r['case']}"
                text += f"- {case} ({r['step_ratio']:.1f}x): {step_reason(r)}\n"
        text += "\nRead the bound as a floor, not a forecast, for those cases.\n"
    else:
        text += (
            f"**Step time:** the planner's bound is within 2x of the measured step in all "
            f"{s['cases']} cases (measured / bound {s['step_ratio_min']:.1f}x to "
            f"{s['step_ratio_max']:.1f}x).\n"
        )
    return text
