"""The measured sections of `kvstrata bench gpu` (kvstrata.bench.gpu, whose docstring
says what each measures): 0. environment, 1. links (host<->device GB/s),
2. memory (the device KV peak, flat across contexts), 3. decode (tok/s per placement
and host codec, next to DynamicCache). Each returns its part of the JSON report.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvstrata.bench.gpu.setup import (
    MIB,
    Budget,
    greedy_decode,
    kv_bytes_per_token,
    replay,
    sync,
)

FLAT_TOLERANCE_BYTES = 2 * MIB  # peak KV may move this much (allocator rounding)


# -- 0. environment -----------------------------------------------------------------------------
def environment(device: torch.device, s: dict[str, Any]) -> dict[str, Any]:
    from kvstrata.attention.device import installed_kernels, kernel_name
    from kvstrata.codecs import triton_dequant

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device": str(device),
        "triton_installed": triton_dequant.available(),
        "attention_kernels": list(installed_kernels()),
        "attention_kernel": kernel_name(device, s["dtype"], s["head_dim"], s["head_dim"]),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_memory_bytes=props.total_memory,
        )
    if triton_dequant.available():
        import triton

        env["triton"] = triton.__version__
    return env


# -- 1. links -----------------------------------------------------------------------------------
def links(device: torch.device, s: dict[str, Any], link: str) -> dict[str, Any]:
    from kvstrata.attention.transfer import LinkModel

    nbytes = s["copy_mib"] * MIB
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    preset = LinkModel.preset(link).bandwidth_bytes_per_s
    out: dict[str, Any] = {"bytes_per_copy": nbytes, "link": link, "link_preset_gbs": preset / 1e9}
    for pinned in (True, False):
        kind = "pinned" if pinned else "pageable"
        if pinned and device.type != "cuda":
            out[kind] = {"skipped": "pinned memory needs CUDA"}
            continue
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        rates = {}
        for direction in ("h2d", "d2h"):
            dst, src = (dev, host) if direction == "h2d" else (host, dev)
            seconds = []
            for _ in range(s["repeats"] + 2):
                sync(device)
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=pinned)
                sync(device)
                seconds.append(time.perf_counter() - t0)
            gbs = nbytes / statistics.median(seconds[1:]) / 1e9
            rates[direction] = {"gbs": gbs, "vs_preset": gbs * 1e9 / preset}
        out[kind] = rates
        del host
    return out


# -- 2. memory ----------------------------------------------------------------------------------
class CudaMemory:
    """The allocator statistics `memory` reads (a stand-in runs it on the CPU in tests)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def release(self) -> None:
        torch.cuda.empty_cache()


def memory(
    model: Any,
    device: torch.device,
    s: dict[str, Any],
    prefills: Callable,
    budget: Budget,
    probe: Any = None,
    on_row: Callable[[list], None] | None = None,
) -> dict[str, Any]:
    from kvstrata.integrations.hf import TieredCache, enable

    if probe is None:
        if device.type != "cuda":
            return {"skipped": "needs CUDA memory statistics"}
        probe = CudaMemory(device)
    per_token = kv_bytes_per_token(model)
    bs = s["block_size"]
    resident = s["memory_budget_tokens"]
    rows = []
    for ctx in s["memory_contexts"]:
        if not budget.allows(f"memory @ {ctx}"):
            continue
        kv, first = prefills(ctx)  # with sdpa attention, before `enable`
        enable(model)
        try:
            sync(device)
            base = probe.allocated()
            cache = TieredCache(
                model.config,
                block_size=bs,
                max_tokens=ctx + s["steps"] + 2 * bs,
                device_budget=resident * per_token,
                host_budget=(ctx + 4 * bs) * per_token,
                staging_tokens=s["memory_staging_tokens"],
                dtype=model.dtype,
                device=str(device),
            )
            replay(cache, kv, device)
            sync(device)
            probe.reset_peak()
            greedy_decode(model, cache, first, s["steps"], device)
            peak = probe.peak() - base
            stats = cache.stats()
        finally:
            model.set_attn_implementation("sdpa")
        rows.append(
            {
                "context": ctx,
                "peak_kv_bytes": peak,
                "device_budget_bytes": stats["device_budget_bytes"],
                "staging_bytes": stats["staging_bytes"],
                "budget_plus_staging_bytes": stats["device_budget_bytes"] + stats["staging_bytes"],
                "host_blocks": stats["tiers"]["host"]["used_blocks"],
                "dynamic_cache_kv_bytes": ctx * per_token,
            }
        )
        del cache
        probe.release()
        if on_row is not None:
            on_row(rows)
    peaks = [r["peak_kv_bytes"] for r in rows]
    flat = bool(peaks) and max(peaks) - min(peaks) <= FLAT_TOLERANCE_BYTES
    return {
        "resident_tokens": resident,
        "rows": rows,
        "flat": flat,
        "flat_tolerance_bytes": FLAT_TOLERANCE_BYTES,
    }


# -- 3. decode ----------------------------------------------------------------------------------
def _transfer_totals(cache: Any) -> tuple[int, dict[str, Any]]:
    stats = cache.stats() if hasattr(cache, "stats") else {}
    t = stats.get("transfers") or {}
    return sum((t.get("bytes_per_link") or {}).values()), t


def _timed_decode(
    make_cache: Callable[[], Any],
    model: Any,
    kv: list,
    first: torch.Tensor,
    steps: int,
    repeats: int,
    device: torch.device,
) -> dict[str, Any]:
    """A new cache (`make_cache()`) with the prefill `kv` replayed into it, one warm-up
    window of `steps` greedy steps from `first`, then `repeats` timed windows: tok/s,
    step time, every token, and (a TieredCache) its link bytes, stalls and blocks."""
    cache = replay(make_cache(), kv, device)
    warm, _ = greedy_decode(model, cache, first, steps, device)  # warm-up window
    bytes0, t0 = _transfer_totals(cache)
    windows, tokens = [], [warm]
    for _ in range(repeats):
        toks, secs = greedy_decode(model, cache, tokens[-1][-1], steps, device)
        tokens.append(toks)
        windows.append(secs)
    bytes1, t1 = _transfer_totals(cache)
    step_s = statistics.median(windows) / steps
    out = {"tok_per_s": 1.0 / step_s, "step_s": step_s, "tokens": torch.cat(tokens)}
    if t1:
        n = steps * repeats
        waits = t1["num_waits"] - t0["num_waits"]
        stalled = t1.get("num_stalled", 0) - t0.get("num_stalled", 0)
        out.update(
            link_bytes_per_step=(bytes1 - bytes0) / n,
            stall_s_per_step=(t1["stall_s"] - t0["stall_s"]) / n,
            hidden_fraction=1.0 - stalled / waits if waits else 1.0,
            overlap_ratio=t1["overlap_ratio"],
        )
    stats = cache.stats() if hasattr(cache, "stats") else {}
    if stats.get("initialized"):
        host = stats["tiers"].get("host") or {}
        out["host_blocks"] = host.get("used_blocks", 0)
        out["device_blocks"] = stats["tiers"]["device"]["used_blocks"]
        out["peak_device_bytes"] = stats["peak_device_bytes"]
    del cache
    return out


def decode(
    model: Any,
    device: torch.device,
    s: dict[str, Any],
    prefills: Callable,
    h2d_gbs: float,
    budget: Budget,
    on_row: Callable[[list], None] | None = None,
) -> dict[str, Any]:
    from transformers import DynamicCache

    from kvstrata.codecs import triton_dequant
    from kvstrata.codecs.registry import get_codec
    from kvstrata.integrations.hf import TieredCache, enable

    sdpa = model
    per_token = kv_bytes_per_token(model)
    bs, steps, repeats = s["block_size"], s["steps"], s["repeats"]
    rows: list[dict[str, Any]] = []
    for ctx in s["contexts"]:
        if not budget.allows(f"decode @ {ctx}"):
            continue
        kv, first = prefills(ctx)
        ref = _timed_decode(
            lambda: DynamicCache(config=sdpa.config), sdpa, kv, first, steps, repeats, device
        )
        rows.append(
            {
                "context": ctx,
                "variant": "DynamicCache",
                "resident_fraction": 1.0,
                "codec": None,
                "tok_per_s": ref["tok_per_s"],
                "step_s": ref["step_s"],
            }
        )
        if on_row is not None:
            on_row(rows)
        tiered = enable(sdpa)  # the same module, now on "kvstrata" attention
        try:
            for frac in s["fractions"]:
                for codec in s["codecs"] if frac < 1 else ["none"]:
                    what = f"decode @ {ctx}, {frac:.0%} resident, {codec}"
                    if not budget.allows(what):
                        continue
                    lossy = not get_codec(codec).lossless
                    floor = (s["residual_tokens"] if lossy else 0) + 4 + 2 * bs
                    resident = max(int(frac * ctx), floor) if frac < 1 else None
                    kw: dict[str, Any] = dict(
                        block_size=bs,
                        max_tokens=ctx + steps * (repeats + 1) + 2 * bs,
                        dtype=model.dtype,
                        device=str(device),
                        cold_attention="stage",
                        residual_tokens=s["residual_tokens"],
                    )
                    if resident is not None:
                        kw.update(
                            device_budget=-(-resident // bs) * bs * per_token,
                            host_budget=(ctx + 4 * bs) * per_token,
                            host_codec=codec,
                        )
                    runs0 = triton_dequant.runs
                    r = _timed_decode(
                        lambda kw=kw: TieredCache(sdpa.config, **kw),
                        tiered,
                        kv,
                        first,
                        steps,
                        repeats,
                        device,
                    )
                    fused_runs = triton_dequant.runs - runs0
                    same = r.pop("tokens") == ref["tokens"]
                    row = {
                        "context": ctx,
                        "variant": "TieredCache",
                        "resident_fraction": frac,
                        "codec": codec,
                        "tokens_agree": float(same.float().mean()),
                        "tokens_equal_prefix": int(same.long().cumprod(0).sum()),
                        "vs_dynamic": r["tok_per_s"] / ref["tok_per_s"],
                        **r,
                    }
                    if "link_bytes_per_step" in r and h2d_gbs > 0:
                        bound = r["link_bytes_per_step"] / (h2d_gbs * 1e9)
                        row["pcie_bound_s"] = bound
                        row["link_efficiency"] = bound / r["step_s"]
                    row["fused_dequant"] = fused_runs  # kernel launches during this variant
                    rows.append(row)
                    if on_row is not None:
                        on_row(rows)
        finally:
            sdpa.set_attn_implementation("sdpa")
    return {"rows": rows}
