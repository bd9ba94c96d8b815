"""`kvstrata bench serve`: the engine's output tokens/s under concurrency, against
one-at-a-time transformers `generate` with a `DynamicCache` on the same model.

Workload: `--requests` prompts of real text (the embedded model's held-out stdlib
files) of different lengths (`--prompt-tokens` spread 0.5x-1.5x), `--max-tokens`
new tokens each (end-of-sequence ignored, so every variant generates the same
number). Prefix caching is off: every round computes every prompt.

Variants, interleaved (one warm-up round, `--repeats` rounds, medians):
  baseline       transformers generate + DynamicCache, one request after another
  c1 / c4 / c8   kvstrata's engine with at most 1 / 4 / 8 requests running at once
                 (all requests submitted together)
  c8_dev25       c8 with a device budget that holds 25 % of the running requests'
                 KV (the rest on host, read in place) vs c8 (device unlimited); at
                 least the floor 8 running sequences pin, so that it runs as many at
                 once as c8 (the real share and the peak concurrency are reported)
Under load (c): the baseline and c4 again while a competing CPU-bound process
spins on one core, each in a fresh process: once with OpenMP's default wait policy
(idle worker threads spin) and once with OMP_WAIT_POLICY=PASSIVE (they sleep; what
`kvstrata serve` sets).
Reported: output tokens/s and ratios, TTFT and TPOT p50 / p99 per engine variant;
every engine output is checked against the baseline's greedy tokens.
Targets: c8 / baseline >= 3x; c8_dev25 / c8 >= 0.8x.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from kvstrata.bench import _timing

NAME = "serve"
HELP = "engine throughput at concurrency 1/4/8 vs one-at-a-time DynamicCache generate"

TARGET_C8 = 3.0
TARGET_DEV25 = 0.8
SPIN = "import time\nend = time.time() + 3600\nwhile time.time() < end:\n    pass\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=int, default=8, help="requests per round")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="mean prompt tokens")
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--block-size", type=int, default=32, help="tokens per KV block")
    parser.add_argument("--no-load", action="store_true", help="skip the competing-load part")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _prompts(tokenizer: Any, count: int, mean: int) -> list[list[int]]:
    from kvstrata.workload.zoo import heldout_files

    text = "".join(p.read_text(errors="replace") for p in heldout_files("default")[:4])
    ids = tokenizer(text, verbose=False)["input_ids"]
    out, at = [], 0
    for i in range(count):
        n = max(1, int(mean * (0.5 + i / max(1, count - 1))))  # 0.5x .. 1.5x
        out.append(ids[at : at + n])
        at += n
    return out


class _Run:
    """What one engine variant saw: latencies of every round, the last outputs."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.outputs: list[list[int]] = []


class _Bench:
    """The workload, the baseline and the engines of one run."""

    def __init__(self, args: argparse.Namespace) -> None:
        from kvstrata.engine import SamplingParams
        from kvstrata.workload.zoo import load_model

        torch.set_num_threads(args.threads)
        self.args = args
        self.base_model, self.tok = load_model("default")
        self.base_model.generation_config.eos_token_id = None
        self.prompts = _prompts(self.tok, args.requests, args.prompt_tokens)
        self.params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        self.expected: list[list[int]] = []
        self.block_bytes: int | None = None
        self.engines: dict[str, Any] = {}
        self.runs: dict[str, _Run] = {}
        self.device_share = 1.0

    def baseline(self) -> float:
        """transformers generate + DynamicCache, one request after another."""
        from transformers import DynamicCache

        args, model = self.args, self.base_model
        outs = []
        t0 = time.perf_counter()
        with torch.inference_mode():
            for p in self.prompts:
                out = model.generate(
                    torch.tensor([p]),
                    max_new_tokens=args.max_tokens,
                    min_new_tokens=args.max_tokens,
                    do_sample=False,
                    cache=DynamicCache(config=model.config),
                )
                outs.append(out[0, len(p) :].tolist())
        seconds = time.perf_counter() - t0
        self.expected[:] = outs
        return seconds

    def engine(self, name: str, seqs: int, device_fraction: float | None = None) -> Any:
        from kvstrata.engine import Engine, EngineConfig
        from kvstrata.workload.zoo import load_model

        args = self.args
        model, _ = load_model("default")
        kwargs: dict[str, Any] = {"block_size": args.block_size}
        if device_fraction is not None:
            assert self.block_bytes is not None, "build an unlimited engine first"
            running = sum(
                -(-(len(p) + args.max_tokens) // args.block_size) for p in self.prompts[-seqs:]
            )
            # at least what the scheduler lets 8 sequences pin (sinks, open block, one
            # more), so the variant runs as many at once as c8; the real share is reported
            floor = next(iter(self.engines.values())).sched.floor_blocks
            slots = max(int(device_fraction * running), seqs * floor)
            self.device_share = slots / running
            kwargs.update(device_budget=slots * self.block_bytes, host_budget="1GiB")
        eng = Engine(
            model,
            self.tok,
            prefix_caching=False,
            **kwargs,
            config=EngineConfig(
                max_num_seqs=seqs,
                max_batched_tokens=max(512, args.prompt_tokens * 2),
                preemption="off",
                threads=args.threads,
            ),
        )
        if self.block_bytes is None:
            stats = eng.stats()["store"]["tiers"]
            self.block_bytes = next(iter(stats.values()))["block_bytes"]
        self.engines[name] = eng
        return eng

    def engine_variant(self, name: str, eng: Any) -> Any:
        """A callable that submits every request at once and returns the seconds until
        the last finished; latencies and outputs are recorded in `self.runs[name]`."""
        run = self.runs[name] = _Run()
        prompts, params = self.prompts, self.params
        calls = [0]

        def once() -> float:
            calls[0] += 1
            record = calls[0] > 1  # the first call is the warm-up round
            done = threading.Event()
            left = [len(prompts)]
            outs: dict[int, list[int]] = {}
            lock = threading.Lock()

            def watcher(i: int, submitted: float):
                last = [None]

                def on_output(out: Any) -> None:
                    now = time.perf_counter()
                    if out.token_ids:
                        if last[0] is None:
                            record and run.ttft.append(now - submitted)
                        else:
                            record and run.tpot.append((now - last[0]) / len(out.token_ids))
                        last[0] = now
                    outs.setdefault(i, []).extend(out.token_ids)
                    if out.finished:
                        with lock:
                            left[0] -= 1
                            if left[0] == 0:
                                done.set()

                return on_output

            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                eng.submit(p, params, on_output=watcher(i, time.perf_counter()))
            done.wait()
            seconds = time.perf_counter() - t0
            run.outputs = [outs.get(i, []) for i in range(len(prompts))]
            return seconds

        return once

    def close(self) -> None:
        for eng in self.engines.values():
            eng.shutdown()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    bench = _Bench(args)
    new_tokens = args.requests * args.max_tokens
    variants: dict[str, Any] = {"baseline": bench.baseline}
    try:
        for c in (1, 4, 8):
            variants[f"c{c}"] = bench.engine_variant(f"c{c}", bench.engine(f"c{c}", c))
        dev25 = bench.engine("c8_dev25", 8, 0.25)
        variants["c8_dev25"] = bench.engine_variant("c8_dev25", dev25)
        times, warning = _timing.timed_with_load_check(variants, args.repeats, args.threads)
        latency = {name: _latency(run) for name, run in bench.runs.items()}
        exact = {name: run.outputs == bench.expected for name, run in bench.runs.items()}
        dev25_stats = dev25.stats()["store"]
        peak = {name: eng.stats()["peak_running"] for name, eng in bench.engines.items()}
    finally:
        bench.close()
    loaded = None if args.no_load else _under_load(args)
    med = {name: _timing.median(t) for name, t in times.items()}
    tps = {name: new_tokens / s for name, s in med.items()}
    return {
        "scenario": NAME,
        "requests": args.requests,
        "prompt_tokens": [len(p) for p in bench.prompts],
        "max_tokens": args.max_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "warning": warning,
        "variants": {
            name: {
                "median_s": med[name],
                "tokens_per_s": tps[name],
                "spread": _timing.spread(times[name]),
                **(
                    {"exact_vs_baseline": exact[name], **latency[name]}
                    if name in bench.runs
                    else {}
                ),
            }
            for name in med
        },
        "ratios": {
            "c1/baseline": tps["c1"] / tps["baseline"],
            "c4/baseline": tps["c4"] / tps["baseline"],
            "c8/baseline": tps["c8"] / tps["baseline"],
            "c8_dev25/c8": tps["c8_dev25"] / tps["c8"],
        },
        "targets": {"c8/baseline": TARGET_C8, "c8_dev25/c8": TARGET_DEV25},
        "dev25_tiers": {t: o["peak_used_blocks"] for t, o in dev25_stats["tiers"].items()},
        "dev25_device_share": bench.device_share,
        "peak_running": peak,
        "under_load": loaded,
    }


def _latency(run: _Run) -> dict[str, float]:
    """TTFT / TPOT p50 and p99 over every request of every round (seconds)."""
    return {
        f"{key}_p{int(q * 100)}_s": _timing.percentile(values, q)
        for key, values in (("ttft", run.ttft), ("tpot", run.tpot))
        for q in (0.5, 0.99)
    }


def load_child(argv_json: str) -> None:
    """In a fresh process (its OpenMP wait policy set by the parent before torch
    loads): the baseline and c4 interleaved while a CPU-bound process spins; prints
    the medians as JSON."""
    args = argparse.Namespace(**json.loads(argv_json))
    bench = _Bench(args)
    fns = {"baseline": bench.baseline}
    spinner = None
    try:
        fns["c4"] = bench.engine_variant("c4", bench.engine("c4", 4))
        fns["baseline"]()  # warm-up before the competitor starts
        fns["c4"]()
        spinner = subprocess.Popen([sys.executable, "-c", SPIN])
        time.sleep(0.5)
        times = _timing.interleaved(fns, args.repeats, warmup=0)
        exact = bench.runs["c4"].outputs == bench.expected
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
        bench.close()
    med = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({"median_s": med, "exact": exact}))


def _under_load(args: argparse.Namespace) -> dict[str, Any]:
    """(c): the baseline and c4 under a competing CPU-bound process, once with
    OpenMP's default wait policy (idle workers spin) and once with PASSIVE (they
    sleep; what `kvstrata serve` sets), each in its own process."""
    out: dict[str, Any] = {}
    for policy in ("default", "PASSIVE"):
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if policy == "PASSIVE":
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        # torch first: `import kvstrata` then leaves the policy the environment gives
        code = (
            "import sys, torch; from kvstrata.bench.serve import load_child; "
            "load_child(sys.argv[1])"
        )
        fields = {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))}
        done = subprocess.run(
            [sys.executable, "-c", code, json.dumps(fields)],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        child = json.loads(done.stdout.strip().splitlines()[-1])
        med = child["median_s"]
        out[policy] = {
            "median_s": med,
            "exact": child["exact"],
            "c4/baseline": med["baseline"] / med["c4"],
        }
    return out


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.requests, args.prompt_tokens, args.max_tokens, args.repeats = 8, 48, 8, 1
    _timing.check_positive(args, "requests", "prompt_tokens", "max_tokens", "repeats", "threads")
    report = measure(args)
    if args.json:
        _timing.print_json(report)
        return 0
    rows = [
        [name, f"{v['tokens_per_s']:.1f}", f"{v['median_s']:.2f}", v.get("exact_vs_baseline", "-")]
        + [f"{v.get(k, float('nan')) * 1e3:.0f}" for k in ("ttft_p50_s", "tpot_p50_s")]
        for name, v in report["variants"].items()
    ]
    notes = [
        f"{k}: {v:.2f}x (target {report['targets'].get(k, '-')})"
        for k, v in report["ratios"].items()
    ]
    for policy, res in (report["under_load"] or {}).items():
        notes.append(
            f"under a competing CPU-bound process, OpenMP wait policy {policy}: c4/baseline "
            f"{res['c4/baseline']:.2f}x (c4 {res['median_s']['c4']:.2f} s, baseline "
            f"{res['median_s']['baseline']:.2f} s, exact {res['exact']})"
        )
    if report["warning"]:
        notes.append(f"[yellow]{report['warning']}[/yellow]")
    _timing.print_table(
        f"engine output tokens/s ({report['requests']} requests x {report['max_tokens']} tokens)",
        ["variant", "tok/s", "median s", "exact", "TTFT p50 ms", "TPOT p50 ms"],
        rows,
        notes,
    )
    return 0
