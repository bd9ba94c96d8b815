"""`kvstrata bench gpu`: the CUDA path measured on one GPU, one JSON report.

Run by scripts/gpu_check.sh (which first runs the gpu-marked tests and passes their
JUnit XML in with --tests-junit). Sections, each isolated (an error is reported in
its section and fails the run, the others still run):

1. links: host<->device copy GB/s, pinned and pageable, both directions (medians of
   CUDA-synchronised copies of --copy-mib), next to the `--link` preset of
   kvstrata.platform.hardware the planner and the LinkModel assume.
2. memory: peak `torch.cuda.max_memory_allocated` during decode above what was
   allocated before the cache existed — the KV working set: device tier + staging +
   transients — at each --memory-contexts with a fixed device budget and staging
   size; it must be flat (and close to budget + staging), where DynamicCache grows
   with the context.
3. decode: tok/s at each --contexts with --fractions of the context resident on the
   device and the rest on the (pinned) host, raw and through each --codecs over the
   link, next to DynamicCache at the same context; per variant the bytes that
   crossed PCIe per step, the step time against its PCIe bound (those bytes /
   the measured pinned H2D GB/s), the stall / hidden fractions of the staging loads,
   the attention kernel and how many times the fused Triton dequant ran
   (`fused_dequant`: kernel launches, counted). Greedy tokens are
   compared with DynamicCache's: the share that agree and the length of the equal
   prefix (once they diverge the rest differs; bf16 and int4 need not be identical —
   exactness in fp32 is what the gpu-marked tests check).

On CUDA the run is not ok unless the fused dequant was usable throughout: Triton
installed, the kernel never disabled, its gpu-marked tests not skipped, and every
variant with an int8 / int4 / fp8 host codec decoded by it at least once.

Model: a Llama slice (8 layers, hidden 2048, 16 query / 8 KV heads of 128, vocab 259:
32 KiB of bf16 KV per token, 2 GiB at 64k), random init. --budget-s bounds the run:
measurements not started by then are listed as skipped. With --out the report is
rewritten (temporary file, then rename) after every section and every measured row,
so a run killed by a timeout keeps what it measured (scripts/gpu_check.sh then marks
it with `mark_timed_out`). `--quick --device cpu` runs the whole harness at toy sizes
on the CPU (the tests do, to keep it working).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvstrata.bench import _timing
from kvstrata.bench._gpu_report import junit_summary, print_summary
from kvstrata.core.errors import ConfigError

NAME = "gpu"
HELP = (
    "CUDA: pinned/pageable link GB/s, flat device KV peak, decode tok/s at 8k-64k "
    "(100/25/10 % resident, raw and int4 over the link) vs the PCIe bound"
)
IN_ALL = False  # needs a GPU (`bench all` runs on CPU machines)

_MIB = 1 << 20
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FULL = dict(
    layers=8, hidden=2048, heads=16, kv_heads=8, head_dim=128, intermediate=5632,
    block_size=64, contexts="8k,32k,64k", memory_contexts="4k,16k,64k",
    codecs="none,int4", steps=24, repeats=3, copy_mib=256, memory_budget_tokens=4096,
    residual_tokens=128, memory_staging_tokens=4096,
)  # fmt: skip
QUICK = dict(
    layers=2, hidden=128, heads=2, kv_heads=2, head_dim=64, intermediate=256,
    block_size=64, contexts="256,512", memory_contexts="256,1024",
    codecs="none,int4", steps=4, repeats=1, copy_mib=4, memory_budget_tokens=128,
    residual_tokens=32, memory_staging_tokens=128,
)  # fmt: skip
FLAT_TOLERANCE_BYTES = 2 * _MIB  # peak KV may move this much (allocator rounding)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", default="cuda", help="cuda (default), cuda:N, or cpu (a --quick smoke run)"
    )
    parser.add_argument("--quick", action="store_true", help="toy sizes (CPU smoke runs)")
    parser.add_argument("--contexts", default=None, help="decode contexts (8k,32k,64k)")
    parser.add_argument("--fractions", default="1,0.25,0.1", help="resident fractions")
    parser.add_argument("--codecs", default=None, help="host codecs over the link (none,int4)")
    parser.add_argument("--memory-contexts", default=None, help="peak-memory contexts")
    parser.add_argument("--steps", type=int, default=None, help="decode steps per repeat (24)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (3)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="model dtype")
    parser.add_argument("--link", default="pcie5", help="link preset to compare with (pcie5)")
    parser.add_argument("--copy-mib", type=int, default=None, help="MiB per copy (256)")
    parser.add_argument(
        "--budget-s", type=float, default=300.0, help="start no measurement after this many s"
    )
    parser.add_argument("--tests-junit", default=None, help="pytest JUnit XML to include")
    parser.add_argument("--out", default=None, help="write the JSON report to this file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a summary")


# -- set-up ------------------------------------------------------------------------------------
def _settings(args: argparse.Namespace) -> dict[str, Any]:
    s = dict(QUICK if args.quick else FULL)
    for key in ("contexts", "memory_contexts", "codecs", "steps", "repeats", "copy_mib"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    s["contexts"] = _timing.parse_contexts(s["contexts"])
    s["memory_contexts"] = _timing.parse_contexts(s["memory_contexts"])
    s["codecs"] = [c.strip() for c in str(s["codecs"]).split(",") if c.strip()]
    _timing.check_positive(argparse.Namespace(**s), "steps", "repeats", "copy_mib")
    try:
        s["fractions"] = [float(f) for f in str(args.fractions).split(",") if f.strip()]
    except ValueError:
        s["fractions"] = []
    if not s["fractions"] or not all(0 < f <= 1 for f in s["fractions"]):
        raise ConfigError.field("fractions", args.fractions, "fractions in (0, 1], e.g. 1,0.25,0.1")
    s["dtype"] = DTYPES[args.dtype]
    return s


def _device(args: argparse.Namespace) -> torch.device:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError.field(
            "device", args.device, "CUDA is not available here: run on a GPU machine, or "
            "`--quick --device cpu` for a smoke run of the harness",
        )  # fmt: skip
    if device.type == "cpu" and not args.quick:
        raise ConfigError.field("device", "cpu", "the full run needs a GPU; add --quick")
    return device


def _model(s: dict[str, Any], device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=259, hidden_size=s["hidden"], intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
        max_position_embeddings=max(s["contexts"] + s["memory_contexts"]) + 4096,
        initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device, s["dtype"]).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _kv_bytes_per_token(model: torch.nn.Module) -> int:
    cfg = model.config
    elem = torch.empty((), dtype=model.dtype).element_size()
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * elem


@torch.no_grad()
def _prefill(model: torch.nn.Module, context: int) -> tuple[list, torch.Tensor]:
    """Exact prefill (DynamicCache + sdpa); its per-layer K/V kept on the CPU."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(context)
    ids = torch.randint(3, model.config.vocab_size, (1, context), generator=gen).to(device)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=ids, cache=cache, logits_to_keep=1).logits
    kv = [(layer.keys.cpu(), layer.values.cpu()) for layer in cache.layers]
    return kv, logits[0, -1].argmax()


@torch.no_grad()
def _replay(cache: Any, kv: list, device: torch.device) -> Any:
    for layer, (k, v) in enumerate(kv):
        cache.update(k.to(device), v.to(device), layer)
    return cache


@torch.no_grad()
def _decode(model: Any, cache: Any, first: torch.Tensor, steps: int, device: torch.device):
    """`steps` greedy single-token forwards. Returns (tokens [steps], seconds)."""
    tok = first.view(1, 1).to(device)
    tokens = []
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        tok = model(input_ids=tok, cache=cache).logits[0, -1].argmax().view(1, 1)
        tokens.append(tok)
    _sync(device)
    return torch.cat(tokens).view(-1).cpu(), time.perf_counter() - start


class Budget:
    """Wall-clock budget: measurements not started in time are listed as skipped."""

    def __init__(self, seconds: float) -> None:
        self.start = time.monotonic()
        self.seconds = seconds
        self.skipped: list[str] = []

    def allows(self, what: str) -> bool:
        if time.monotonic() - self.start <= self.seconds:
            return True
        self.skipped.append(what)
        return False

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start


def _section(report: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """report[name] = fn(), or the error (printed to stderr) when it raises."""
    try:
        report[name] = fn()
    except Exception as err:  # one broken section must not lose the others' numbers
        tb = traceback.format_exc()
        print(f"kvstrata bench gpu: section {name!r} failed:\n{tb}", file=sys.stderr)
        report[name] = {"error": f"{type(err).__name__}: {err}", "traceback": tb[-4000:]}
        report["ok"] = False


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

    nbytes = s["copy_mib"] * _MIB
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
                _sync(device)
                t0 = time.perf_counter()
                dst.copy_(src, non_blocking=pinned)
                _sync(device)
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
    from kvstrata.integrations.hf.cache import TieredCache, enable

    if probe is None:
        if device.type != "cuda":
            return {"skipped": "needs CUDA memory statistics"}
        probe = CudaMemory(device)
    per_token = _kv_bytes_per_token(model)
    bs = s["block_size"]
    resident = s["memory_budget_tokens"]
    rows = []
    for ctx in s["memory_contexts"]:
        if not budget.allows(f"memory @ {ctx}"):
            continue
        kv, first = prefills(ctx)  # with sdpa attention, before `enable`
        enable(model)
        try:
            _sync(device)
            base = probe.allocated()
            cache = TieredCache(
                model.config, block_size=bs, max_tokens=ctx + s["steps"] + 2 * bs,
                device_budget=resident * per_token, host_budget=(ctx + 4 * bs) * per_token,
                staging_tokens=s["memory_staging_tokens"], dtype=model.dtype, device=str(device),
            )  # fmt: skip
            _replay(cache, kv, device)
            _sync(device)
            probe.reset_peak()
            _decode(model, cache, first, s["steps"], device)
            peak = probe.peak() - base
            stats = cache.stats()
        finally:
            model.set_attn_implementation("sdpa")
        rows.append({
            "context": ctx,
            "peak_kv_bytes": peak,
            "device_budget_bytes": stats["device_budget_bytes"],
            "staging_bytes": stats["staging_bytes"],
            "budget_plus_staging_bytes": stats["device_budget_bytes"] + stats["staging_bytes"],
            "host_blocks": stats["tiers"]["host"]["used_blocks"],
            "dynamic_cache_kv_bytes": ctx * per_token,
        })  # fmt: skip
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
    from kvstrata.integrations.hf.cache import TieredCache, enable

    sdpa = model
    per_token = _kv_bytes_per_token(model)
    bs, steps, repeats = s["block_size"], s["steps"], s["repeats"]
    rows: list[dict[str, Any]] = []
    for ctx in s["contexts"]:
        if not budget.allows(f"decode @ {ctx}"):
            continue
        kv, first = prefills(ctx)

        def timed(make_cache: Callable[[], Any], model: Any, kv=kv, first=first) -> dict:
            cache = _replay(make_cache(), kv, device)
            warm, _ = _decode(model, cache, first, steps, device)  # warm-up window
            bytes0, t0 = _transfer_totals(cache)
            windows, tokens = [], [warm]
            for _ in range(repeats):
                toks, secs = _decode(model, cache, tokens[-1][-1], steps, device)
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

        ref = timed(lambda: DynamicCache(config=sdpa.config), sdpa)
        rows.append({
            "context": ctx, "variant": "DynamicCache", "resident_fraction": 1.0,
            "codec": None, "tok_per_s": ref["tok_per_s"], "step_s": ref["step_s"],
        })  # fmt: skip
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
                        block_size=bs, max_tokens=ctx + steps * (repeats + 1) + 2 * bs,
                        dtype=model.dtype, device=str(device), cold_attention="stage",
                        residual_tokens=s["residual_tokens"],
                    )  # fmt: skip
                    if resident is not None:
                        kw.update(
                            device_budget=-(-resident // bs) * bs * per_token,
                            host_budget=(ctx + 4 * bs) * per_token, host_codec=codec,
                        )  # fmt: skip
                    runs0 = triton_dequant.runs
                    r = timed(lambda kw=kw: TieredCache(sdpa.config, **kw), tiered)
                    fused_runs = triton_dequant.runs - runs0
                    same = r.pop("tokens") == ref["tokens"]
                    row = {
                        "context": ctx, "variant": "TieredCache", "resident_fraction": frac,
                        "codec": codec, "tokens_agree": float(same.float().mean()),
                        "tokens_equal_prefix": int(same.long().cumprod(0).sum()),
                        "vs_dynamic": r["tok_per_s"] / ref["tok_per_s"], **r,
                    }  # fmt: skip
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


# -- the report ---------------------------------------------------------------------------------
def measure(
    args: argparse.Namespace, save: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Run every section; see the module docstring. `save(report)` is called after
    every section and measured row (the report so far)."""
    device = _device(args)
    s = _settings(args)
    budget = Budget(args.budget_s)
    report: dict[str, Any] = {"scenario": NAME, "ok": True, "quick": args.quick}
    report["settings"] = {k: (str(v) if k == "dtype" else v) for k, v in s.items()}

    def checkpoint() -> None:
        report["skipped"] = list(budget.skipped)
        report["elapsed_s"] = budget.elapsed
        if save is not None:
            save(report)

    measured: dict[str, list] = {}  # a section's rows so far

    def rows_so_far(name: str) -> Callable[[list], None]:
        def on_row(rows: list) -> None:
            measured[name] = list(rows)
            report[name] = {"rows": measured[name], "partial": True}
            checkpoint()

        return on_row

    def section(name: str, fn: Callable[[], Any]) -> None:
        _section(report, name, fn)
        if "error" in report[name] and measured.get(name):  # keep what it measured
            report[name]["rows"] = measured[name]
        checkpoint()

    if args.tests_junit:
        section("tests", lambda: junit_summary(args.tests_junit))
        tests = report["tests"]
        if "error" in tests or tests["failures"] or tests["errors"] or not tests["tests"]:
            report["ok"] = False
        elif tests["skipped"] == tests["tests"] and device.type == "cuda":
            report["ok"] = False  # nothing ran: e.g. the tests' process saw no GPU
            report["tests"]["note"] = "every test was skipped"
    section("environment", lambda: environment(device, s))
    section("links", lambda: links(device, s, args.link))
    pinned = (report["links"].get("pinned") or {}) if "error" not in report["links"] else {}
    pageable = report["links"].get("pageable") or {}
    h2d = (pinned.get("h2d") or pageable.get("h2d") or {}).get("gbs", 0.0)
    model = _model(s, device)
    cached: dict[int, tuple] = {}

    def prefills(ctx: int) -> tuple:
        if ctx not in cached:
            cached.clear()  # one context's K/V at a time in host RAM
            cached[ctx] = _prefill(model, ctx)
        return cached[ctx]

    section(
        "memory", lambda: memory(model, device, s, prefills, budget, None, rows_so_far("memory"))
    )
    mem = report["memory"]
    if "rows" in mem and not mem["flat"]:
        report["ok"] = False
    section(
        "decode", lambda: decode(model, device, s, prefills, h2d, budget, rows_so_far("decode"))
    )
    from kvstrata.attention import device as device_attention
    from kvstrata.codecs import triton_dequant

    if "error" not in report["environment"]:  # a kernel that failed during the run
        report["environment"]["fused_dequant_disabled"] = triton_dequant.disabled
        report["environment"]["fused_dequant_runs"] = triton_dequant.runs
        report["environment"]["attention_fallbacks"] = dict(device_attention.fallbacks)
    problems = fused_dequant_problems(device, report)
    if problems:
        report["ok"] = False
        report["fused_dequant_problems"] = problems
    checkpoint()
    return report


def fused_dequant_problems(device: torch.device, report: dict[str, Any]) -> list[str]:
    """On CUDA, why the fused Triton dequant did not cover the run (empty: it did):
    not installed, disabled after a failure, its tests skipped, or a variant with a
    quantized host codec that never launched it."""
    from kvstrata.codecs import triton_dequant
    from kvstrata.codecs.registry import get_codec

    if device.type != "cuda":
        return []
    problems = []
    if not triton_dequant.available():
        problems.append("Triton is not installed (pip install 'kvstrata[cuda]')")
    if triton_dequant.disabled:
        problems.append(f"the kernel was disabled: {triton_dequant.disabled}")
    tests = report.get("tests") or {}
    skipped = [
        t["test"]
        for t in tests.get("skipped_tests", [])
        if "fused" in t["test"] or "triton" in t["test"]
    ]
    if skipped:
        problems.append(f"{len(skipped)} fused dequant tests skipped, e.g. {skipped[0]}")
    for row in (report.get("decode") or {}).get("rows", []):
        codec = row.get("codec")
        if codec in (None, "none") or row.get("fused_dequant", 0) > 0:
            continue
        if triton_dequant.kernel_codec(get_codec(codec)):
            problems.append(
                f"decode @ {row['context']}, {row['resident_fraction']:.0%} resident, {codec}: "
                "the fused kernel never ran"
            )
    return problems


def write_report(path: str | Path, report: dict[str, Any]) -> None:
    """Write the JSON report atomically: a temporary file next to it, then a rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def mark_timed_out(out: str, junit: str | None = None, *parts: str) -> None:
    """What scripts/gpu_check.sh runs when a timeout killed the tests or the benchmark
    (`parts`: "tests", "bench"): the report as last saved (every finished section and
    measured row), or a new one, with the tests' summary, "timed_out": true and
    "ok": false."""
    try:
        report = json.loads(Path(out).read_text())
    except (OSError, ValueError):
        report = {"scenario": NAME}
    if junit and "tests" not in report:
        try:
            report["tests"] = junit_summary(junit)
        except Exception as err:  # killed before pytest wrote it
            report["tests"] = {"error": f"{type(err).__name__}: {err}"}
    report.update(ok=False, timed_out=True, timed_out_in=list(parts) or ["bench"])
    write_report(out, report)


def run(args: argparse.Namespace) -> int:
    """Measure, write/print the report. Exit 1 when a section failed, a test failed,
    the device KV peak was not flat or (on CUDA) the fused dequant did not cover the
    run."""
    save = (lambda report: write_report(args.out, report)) if args.out else None
    report = measure(args, save)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_summary(report)
    for problem in report.get("fused_dequant_problems", []):
        print(f"kvstrata bench gpu: fused dequant: {problem}", file=sys.stderr)
    return 0 if report["ok"] else 1
