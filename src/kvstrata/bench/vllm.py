"""`kvstrata bench vllm`: vLLM's time to first token, cold vs KV loaded back from kvstrata.

Needs vLLM (`pip install 'kvstrata[vllm]'`; in a checkout `make venv-vllm`, then
`.venv-vllm/bin/kvstrata bench vllm`). One engine (the embedded model by default, fp32
on the CPU) with kvstrata as its offloading backend; its host tier holds exactly one
prompt, so storing a prompt pushes the previous one out to the disk tier. Every round
(one untimed warm-up round, then `--repeats`; medians) times `generate(max_tokens=1)`:

  cold          a new `--prompt-tokens` prompt of real text: computed in full
  vllm_prefix   the same prompt again: vLLM's own prefix cache holds it
  kvstrata_host after vLLM's prefix cache is reset: its blocks load from kvstrata's host tier
  kvstrata_disk the previous round's prompt, vLLM's cache reset: its blocks were pushed out
                of the host tier and load from disk: the whole prefix read back in
                one batch between two scheduler steps (vectored, checksummed,
                decompressed across threads), then loaded as host hits are

`--tp 2` runs the engine tensor parallel (each worker stores its heads' share, one CPU
per worker: VLLM_CPU_OMP_THREADS_BIND is set unless given); `--sliding-window W` runs
the model with a W-token window in every other layer (Gemma-2's pattern: vLLM's hybrid
allocator makes sliding and full KV cache groups) — the model's own weights under a
config.json that adds `layer_types` and `sliding_window` (a Llama's; vLLM reads them).

`--docqa` instead times the long-document QA rounds of `kvstrata bench peer` with
vLLM's KV holding a quarter of the working set (smollm2 by default; it runs from either
environment: vLLM's servers start from <repo>/.venv-vllm): vLLM alone against
vLLM with kvstrata as its backend — host tier lossless, int8, and a host tier as large
as vLLM's KV in front of a disk tier — each an OpenAI server driven over HTTP, with
kvstrata's hits by tier from its `/metrics`; `--repeats` (default 3) alternate them.

Each variant's token must equal the same prompt's cold token (lossless codecs; lossy
ones report it). Also reported: hits per tier, the batched disk reads that served them
(reads, blocks, and lookups answered RETRY meanwhile: the path that ran; a round whose
read landed within one step has one RETRY per block), the machine's load before and
after, and the
bytes of one block per codec (exact stored sizes; with --disk-compress the measured
average on disk).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstrata.bench import _timing

NAME = "vllm"
HELP = "vLLM time to first token: cold vs loaded from kvstrata host / disk vs vLLM prefix cache"
VARIANTS = ("cold", "vllm_prefix", "kvstrata_host", "kvstrata_disk")
DOCQA_VARIANTS = ("vllm", "vllm_kvstrata", "vllm_kvstrata_int8", "vllm_kvstrata_disk")
EXTRA_HINT = "pip install 'kvstrata[vllm]' (in a checkout: make venv-vllm)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="model (default: embedded; --docqa: smollm2 if installed)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=2048, help="tokens per prompt")
    parser.add_argument(
        "--repeats", type=int, default=None, help="interleaved timed rounds (5; --docqa 3)"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel workers (one CPU each)")
    parser.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="run the model with this window in every other layer (hybrid KV cache groups)",
    )
    parser.add_argument(
        "--docqa",
        action="store_true",
        help="long-document QA rounds, vLLM's KV a quarter of the working set: vLLM alone "
        "vs with kvstrata host / int8 host / disk (servers over HTTP)",
    )
    parser.add_argument("--block-size", type=int, default=32, help="vLLM KV block (x32 on CPU)")
    parser.add_argument("--host-codec", default="none", help="codec of the host tier")
    parser.add_argument("--disk-codec", default="none", help="codec of the disk tier")
    parser.add_argument("--disk-compress", action="store_true", help="zstd on the disk tier")
    parser.add_argument(
        "--disk-delta", action="store_true", help="with --disk-compress: delta-code the keys"
    )
    parser.add_argument("--dir", default=None, help="disk tier directory (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (512 tokens)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _prompts(model_dir: Path, count: int, num_tokens: int) -> list[list[int]]:
    """`count` prompts of `num_tokens` tokens of real text (stdlib sources), disjoint."""
    from transformers import AutoTokenizer

    from kvstrata.workload.zoo import heldout_files

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = []
    for path in heldout_files("default"):
        ids += tokenizer(path.read_text(errors="replace"), verbose=False)["input_ids"]
        if len(ids) >= count * num_tokens:
            break
    ids = (ids * (count * num_tokens // max(1, len(ids)) + 1))[: count * num_tokens]
    return [ids[i * num_tokens : (i + 1) * num_tokens] for i in range(count)]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    # vLLM logs INFO lines to stdout (in every process it starts): keep the report readable
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if args.json:
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm import LLM, SamplingParams

    from kvstrata.integrations.vllm import kv_transfer_config
    from kvstrata.workload.zoo import resolve_model_dir

    model_dir = resolve_model_dir(args.model or "default")
    warning = _timing.load_warning(os.cpu_count() or 1)  # vLLM uses every core
    load_before = _timing.machine_load()[0]
    rounds = args.repeats + 1  # + the warm-up round
    prompts = _prompts(model_dir, rounds, args.prompt_tokens)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvstrata-vllm-"))
    root.mkdir(parents=True, exist_ok=True)  # the stats file's directory must exist
    source_dir = model_dir
    if args.sliding_window:
        model_dir = windowed_model(model_dir, args.sliding_window, root / "model")
    groups = _groups(model_dir)
    engine_args: dict[str, Any] = {}
    if args.tp > 1:
        engine_args["tensor_parallel_size"] = args.tp
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", _threads_bind(args.tp))
    stats_file = root / "stats.json"
    block_tokens = args.block_size
    num_blocks = args.prompt_tokens // block_tokens
    # probe the block size with a tiny host tier, then size it to one prompt
    fields: dict[str, Any] = dict(
        host_codec=args.host_codec,
        disk_dir=str(root),
        disk_codec=args.disk_codec,
        disk_compress=args.disk_compress,
        disk_delta=args.disk_delta,
        stats_file=str(stats_file),
    )
    host_block = _host_block_bytes(model_dir, block_tokens, args.host_codec)
    per_prompt = _blocks_per_prompt(model_dir, num_blocks, block_tokens)
    fields["host_budget"] = per_prompt * host_block
    fields["disk_budget"] = 4 * rounds * per_prompt * _raw_block_bytes(model_dir, block_tokens)
    started = time.perf_counter()
    llm = LLM(
        model=str(model_dir),
        enforce_eager=True,
        dtype="float32",
        block_size=block_tokens,
        kv_cache_memory_bytes=max(256 << 20, 4 * num_blocks * _raw_block_bytes(model_dir, 32)),
        seed=0,
        kv_transfer_config=kv_transfer_config(**fields),
        **engine_args,
    )
    startup_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(prompt: list[int]) -> tuple[float, int, int]:
        t0 = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - t0, out.outputs[0].token_ids[0], out.num_cached_tokens or 0

    def stats() -> dict[str, Any]:
        return json.loads(stats_file.read_text())

    def settle() -> None:
        """Let the stores finish and reach the disk (untimed)."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            run(prompts[0][:3])
            s = stats()
            if s["disk_written"] >= s["stored"]:
                return
            time.sleep(0.1)

    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cached: dict[str, list[int]] = {v: [] for v in VARIANTS}
    hits: dict[str, dict[str, int]] = {v: {"host": 0, "disk": 0} for v in VARIANTS}
    reads = {v: {"batches": 0, "blocks": 0, "retries": 0} for v in VARIANTS}
    same: dict[str, bool] = dict.fromkeys(VARIANTS, True)
    first_token: list[int] = []
    for r, prompt in enumerate(prompts):
        timed = r > 0
        for variant in VARIANTS:
            if variant == "kvstrata_disk" and r == 0:
                continue
            target = prompts[r - 1] if variant == "kvstrata_disk" else prompt
            if variant in ("kvstrata_host", "kvstrata_disk"):
                llm.reset_prefix_cache()
            if variant == "kvstrata_disk":
                settle()
            before = stats() if stats_file.exists() else {}
            seconds, token, n_cached = run(target)
            if variant == "cold":
                first_token.append(token)
                settle()
            expected = first_token[r - 1] if variant == "kvstrata_disk" else first_token[r]
            same[variant] &= token == expected
            if timed:
                after = stats()
                times[variant].append(seconds)
                cached[variant].append(n_cached)
                for tier in ("host", "disk"):
                    key = f"hits_{tier}"
                    hits[variant][tier] += after[key] - before.get(key, 0)
                for what, key in (
                    ("batches", "disk_read_batches"),
                    ("blocks", "disk_read_blocks"),
                    ("retries", "disk_retries"),  # lookups answered RETRY: steps x blocks
                ):
                    reads[variant][what] += after.get(key, 0) - before.get(key, 0)
        llm.reset_prefix_cache()
    final = stats()
    load_after = _timing.machine_load()[0]
    llm.llm_engine.engine_core.shutdown()
    sizes = _codec_bytes(model_dir, block_tokens, final)
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    med = {v: _timing.median(t) for v, t in times.items()}
    return {
        "scenario": NAME,
        "model": str(source_dir),
        "sliding_window": args.sliding_window,
        "kv_cache_groups": groups,
        "tp": args.tp,
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND") if args.tp > 1 else None,
        "prompt_tokens": args.prompt_tokens,
        "vllm_block_tokens": block_tokens,
        "codecs": final["codecs"],
        "engine_startup_s": startup_s,
        "variants": [
            {
                "variant": v,
                "ttft_ms": 1000 * med[v],
                "spread": _timing.spread(times[v]),
                "cached_tokens": _timing.median(cached[v]),
                "kvstrata_hits": hits[v],
                "disk_reads": reads[v],
                "tokens_identical": same[v],
            }
            for v in VARIANTS
        ],
        "ratios": {f"cold/{v}": med["cold"] / med[v] for v in VARIANTS[1:]},
        "bytes_per_block": sizes,
        "load": {"before": load_before, "after": load_after, "cores": os.cpu_count() or 1},
        "machine_warning": warning,
    }


def _layout(model_dir: Path, block_tokens: int) -> Any:
    import torch

    from kvstrata.core.layout import BlockLayout

    g = _geometry(model_dir)
    layers = max(_groups(model_dir)["layers"])  # kvstrata's blocks: one group's layers
    return BlockLayout(layers, g.num_kv_heads, g.head_dim, block_tokens, torch.float32)


def windowed_model(model_dir: Path, window: int, dest: Path) -> Path:
    """`model_dir` with a `window`-token sliding window in every other layer (0, 2, ...:
    Gemma-2's pattern) at `dest`: its files linked, config.json with `layer_types` and
    `sliding_window` added. A Llama's only (vLLM's Llama reads both); ConfigError else."""
    from kvstrata.core.errors import ConfigError

    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "llama" or config.get("layer_types"):
        what = repr(config.get("model_type")) + (
            " with layer_types" * bool(config.get("layer_types"))
        )
        raise ConfigError.field(
            "sliding_window",
            window,
            f"--sliding-window rewrites a Llama model's config (this one is {what}); pass a "
            "sliding-window model with --model instead",
        )
    layers = int(config["num_hidden_layers"])
    if layers < 2:
        raise ConfigError.field("sliding_window", window, "needs a model of 2 layers or more")
    dest.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.name != "config.json" and not (dest / path.name).exists():
            (dest / path.name).symlink_to(path.resolve())
    kinds = ("sliding_attention", "full_attention")
    config.update(layer_types=[kinds[i % 2] for i in range(layers)], sliding_window=window)
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    return dest


def _geometry(model_dir: Path) -> Any:
    from kvstrata.model.geometry import KVGeometry
    from kvstrata.model.hf_config import read_config_file

    path, data = read_config_file(model_dir)
    return KVGeometry.from_hf_config(data, name=str(path))


def _groups(model_dir: Path) -> dict[str, Any]:
    """The KV cache groups vLLM's hybrid allocator makes of the model's layers (which
    slide as `KVGeometry` reads them: layer_types, max_window_layers, Mistral's all):
    groups of the smaller kind's count, each kind's layers split into them (one group
    when every layer is alike) — their layers and whether they slide."""
    g = _geometry(model_dir)
    sliding = set(g.sliding_layers)
    kinds = [i in sliding for i in range(g.num_layers)]
    counts = {k: kinds.count(k) for k in dict.fromkeys(kinds)}  # layer 0's kind first
    size = min(counts.values())
    layers, slides = [], []
    for kind, count in counts.items():
        for start in range(0, count, size):
            layers.append(min(size, count - start))
            slides.append(kind)
    return {"layers": layers, "sliding": slides, "window": g.sliding_window}


def _blocks_per_prompt(model_dir: Path, num_blocks: int, block_tokens: int) -> int:
    """kvstrata blocks one prompt of `num_blocks` vLLM blocks stores: every block of a
    full group, those a sliding layer still sees of a sliding one (the store's own rule,
    `KVGeometry.kv_tokens_for_layer`)."""
    g = _geometry(model_dir)
    context = num_blocks * block_tokens
    kept = num_blocks
    if g.sliding_layers:
        kept = -(-g.kv_tokens_for_layer(g.sliding_layers[0], context, block_tokens) // block_tokens)
    return sum(kept if s else num_blocks for s in _groups(model_dir)["sliding"])


def _threads_bind(tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `tp` workers: this process's CPUs split evenly
    ("0|1" on two; vLLM's "auto" wants a NUMA node per worker)."""
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // tp
    return "|".join(",".join(map(str, cpus[i * share : (i + 1) * share])) for i in range(tp))


def _raw_block_bytes(model_dir: Path, block_tokens: int) -> int:
    return _layout(model_dir, block_tokens).raw_block_bytes


def _host_block_bytes(model_dir: Path, block_tokens: int, codec: str) -> int:
    from kvstrata.codecs.registry import get_codec

    return get_codec(codec, "host_codec").block_nbytes(_layout(model_dir, block_tokens))


def _codec_bytes(model_dir: Path, block_tokens: int, final: dict[str, Any]) -> dict[str, Any]:
    """Stored bytes of one block per codec (exact), plus what this run measured."""
    from kvstrata.codecs.registry import codec_names, get_codec
    from kvstrata.core.errors import ConfigError

    layout = _layout(model_dir, block_tokens)
    out: dict[str, Any] = {}
    for name in codec_names():
        codec = get_codec(name)
        try:
            codec.validate(layout)
        except ConfigError:
            continue  # e.g. int4-g128 needs 128-token blocks
        out[name] = codec.block_nbytes(layout)
    out["measured"] = final["bytes_per_block"]
    return out


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; exit 1 if a lossless variant's token differs from cold."""
    if getattr(args, "docqa", False):  # vLLM runs in its servers (vLLM's own python)
        return _docqa(_settle(args))
    if importlib.util.find_spec("vllm") is None:
        if getattr(args, "scenario", None) == "all":
            print(f"skipped: vLLM is not installed ({EXTRA_HINT})")
            return 0
        print(f"kvstrata bench vllm needs vLLM, which is not installed: {EXTRA_HINT}")
        return 2
    args = _settle(args)
    report = measure(args)
    if args.json:
        _timing.print_json(report)
    else:
        _print(report)
    lossless = report["codecs"]["host"] == "none" and report["codecs"]["disk"] in (None, "none")
    return 0 if not lossless or all(v["tokens_identical"] for v in report["variants"]) else 1


def _settle(args: argparse.Namespace) -> argparse.Namespace:
    """The flags checked (ConfigError: exit 2, one line) and defaults filled in."""
    from kvstrata.core.errors import ConfigError

    args = argparse.Namespace(**vars(args))
    if args.repeats is None:
        args.repeats = 3 if args.docqa else 5
    if args.quick and not args.docqa:
        args.prompt_tokens, args.repeats = 512, 2
    _timing.check_positive(args, "prompt_tokens", "repeats", "block_size", "tp")
    if args.sliding_window is not None:
        _timing.check_positive(args, "sliding_window")
    cpus = len(os.sched_getaffinity(0))
    if args.tp > cpus:
        raise ConfigError.field("tp", args.tp, f"vLLM-CPU runs one worker per CPU: at most {cpus}")
    if args.docqa:
        defaults = {"tp": 1, "sliding_window": None, "json": False}
        ignored = [f"--{n.replace('_', '-')}" for n, d in defaults.items() if getattr(args, n) != d]
        if ignored:
            raise ConfigError.field(
                "docqa",
                True,
                f"takes none of {', '.join(ignored)} (its servers are "
                "`kvstrata bench peer`'s; its --json PATH keeps the raw numbers)",
            )
    return args


def _docqa(args: argparse.Namespace) -> int:
    """`kvstrata bench peer`'s docqa rounds at a quarter-size vLLM KV, vLLM alone and with
    kvstrata as its backend (host / int8 host / disk)."""
    from kvstrata.bench import peer

    argv = ["--sizes", "quarter", "--only", "docqa", "--variants", ",".join(DOCQA_VARIANTS)]
    argv += ["--repeats", str(args.repeats)]
    if args.model:
        argv += ["--model", args.model]
    if args.quick:
        argv.append("--quick")
    parser = argparse.ArgumentParser(prog="kvstrata bench vllm --docqa")
    peer.add_arguments(parser)
    return peer.run(parser.parse_args(argv))


def _hits(variant: dict[str, Any]) -> str:
    text = ", ".join(f"{t}={n}" for t, n in variant["kvstrata_hits"].items() if n) or "-"
    reads = variant.get("disk_reads", {})
    if reads.get("batches"):
        text += f" in {reads['batches']} batched reads"
    return text


def _print(report: dict[str, Any]) -> None:
    rows = [
        (
            v["variant"],
            f"{v['ttft_ms']:.1f}",
            f"{100 * v['spread']:.0f} %",
            f"{v['cached_tokens']:.0f}",
            _hits(v),
            "✓" if v["tokens_identical"] else "✗",
        )
        for v in report["variants"]
    ]
    notes = [f"{k} = {x:.2f}x" for k, x in report["ratios"].items()]
    sizes = report["bytes_per_block"]
    measured = sizes["measured"]
    notes.append(
        "bytes per block ("
        + ", ".join(f"{k} {n}" for k, n in sizes.items() if k != "measured")
        + f"); this run: host {measured['host']}, disk {measured['disk']:.0f}"
    )
    notes.append(f"engine start-up {report['engine_startup_s']:.0f} s (not in the figures)")
    load = report["load"]
    notes.append(
        f"load average {load['before']:.2f} before, {load['after']:.2f} after "
        f"({load['cores']} cores)"
    )
    if report["machine_warning"]:
        notes.append(report["machine_warning"])
    c = report["codecs"]
    setup = ""
    if report["tp"] > 1:
        setup += f", tensor parallel {report['tp']} (CPUs {report['threads_bind']})"
        notes.append("tensor parallel: hits count each worker's share of a block")
    if report["sliding_window"]:
        g = report["kv_cache_groups"]
        setup += f", {report['sliding_window']}-token window in every other layer"
        pairs = zip(g["layers"], g["sliding"], strict=True)
        kinds = [f"{n} {'sliding' if s else 'full'}" for n, s in pairs]
        notes.append("KV cache groups (layers): " + ", ".join(kinds))
    _timing.print_table(
        f"vLLM time to first token, {report['prompt_tokens']}-token prompt{setup}, kvstrata "
        f"host {c['host']} / disk {c['disk']} (medians)",
        ("variant", "TTFT ms", "spread", "cached tokens", "kvstrata hits (blocks)", "token"),
        rows,
        notes,
    )
