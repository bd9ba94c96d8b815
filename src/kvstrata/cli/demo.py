"""`kvstrata demo` (what `make demo` runs): a real job through a tiered KV cache.

The demo is a list of sections (SECTIONS), run in order over one DemoState:

1. model: load the model (smollm2 by default: converted into the user's cache on first
   use, read from there afterwards) and say how long it took;
2. plan: a short memory plan of the model;
3. answer: a long document (Python's own LICENSE.txt, about 3,800 tokens) and a question
   about it, answered with 10 % of the KV on the device and the rest int8 on the host and
   on disk; the answer is streamed, then the tier occupancy and the memory saved against
   keeping the whole KV on the device;
4. exact: the same job with lossless codecs must give the tokens of transformers'
   DynamicCache (exit 1 otherwise).

A section is `fn(state) -> int` (an exit code; the worst one is the demo's). To add one,
write such a function and append `Section(title, fn)` to SECTIONS; what earlier sections
computed is in `state` (the model, the tokenizer, the job, and `state.results`).

With `--model tiny` (the embedded 3M-parameter byte model, no chat template) the job is a
code completion of 'def fibonacci(n):'. Without the embedded model it says so in one line
and prints the plan only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.cli.generate import (
    DEFAULT_PROMPT,
    apply_threads,
    check_positions,
    generate_ids,
    model_help,
    parse_threads,
    prompt_then_stream,
    render_stats,
)
from kvstrata.core.units import format_bytes, parse_tokens
from kvstrata.workload.zoo import quiet_transformers

PLAN_GPU = "l4"
PLAN_CONTEXT = 32 * 1024
RESIDENT_FRACTION = 0.1
ENGINE_REQUESTS, ENGINE_DOC_TOKENS, ENGINE_MAX_TOKENS = 3, 768, 40  # section_engine
LOWER_CODEC = "int8"
# Plain greedy decoding of the 3M-parameter embedded model falls into a run of spaces
# after 'def fibonacci(n):'; forbidding repeated 16-grams keeps it writing code-like text
# and is still deterministic, so the DynamicCache comparison stays exact.
DEMO_NO_REPEAT_NGRAM = 16
DEFAULT_ANSWER_TOKENS = 96


@dataclass
class DemoJob:
    """What the demo asks the model: the prompt's token ids and how to decode."""

    title: str  # one line: what the prompt is
    prompt_ids: Any  # LongTensor [1, n]
    echo: str  # printed before the streamed tokens ("" for a chat answer)
    block_size: int
    residual_tokens: int
    staging_tokens: int
    no_repeat_ngram: int = 0


@dataclass
class DemoState:
    """Shared by the sections, in order."""

    args: argparse.Namespace
    workdir: Path  # a temporary directory (disk tiers), removed after the demo
    model_name: str = ""
    model: Any = None
    tokenizer: Any = None
    job: DemoJob | None = None
    results: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Section:
    title: str
    run: Callable[[DemoState], int]


def print_plan(spec: str, name: str, context: int = PLAN_CONTEXT) -> None:
    """Print a few-line memory plan of a model (a preset name or a model directory).

    Args:
        spec: What kvstrata.workload.zoo.load_geometry accepts.
        name: The model's name to show.
        context: Tokens per request to plan for.
    """
    from kvstrata.platform.hardware import make_hardware
    from kvstrata.workload.memory_plan import Workload, plan
    from kvstrata.workload.zoo import load_geometry

    result = plan(load_geometry(spec), make_hardware(PLAN_GPU), Workload(context_tokens=context))
    row = next((r for r in result.table if r.context_tokens == context), None)
    shown = [c for c in ("int8", "int4") if row is not None and c in row.per_request]
    codecs = ""
    if shown:
        codecs = " (" + ", ".join(f"{c} {format_bytes(row.per_request[c])}" for c in shown) + ")"
    print(
        f"plan: {name}: {result.geometry.describe()}, {result.bytes_per_token:,.0f} B/token; "
        f"{context // 1024}k context = {format_bytes(result.kv_per_request_bytes)} "
        f"per request{codecs}"
    )
    tiers = result.tiers
    if tiers is not None:
        print(
            f"plan: offloaded on {PLAN_GPU}: newest {tiers.resident_tokens} tokens "
            f"({tiers.resident_fraction:.1%}) on the GPU = {format_bytes(tiers.device_bytes)}, "
            f"{format_bytes(tiers.host_bytes)} on the host, block size {result.block_size}"
        )
    reason = (result.reasons_against or result.reasons_for or [""])[0]
    print(f"plan: verdict {result.verdict}" + (f": {reason}" if reason else ""))


def _first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


# -- the job -------------------------------------------------------------------------------
DOCUMENT_QUESTION = "Which organization owns the copyright of Python today? Answer in one sentence."
TOPICS_QUESTION = "According to the text, what does the finally clause of a try statement do?"
TOPICS = ("try", "with", "for", "while", "if", "function", "class", "raise", "return", "import")


def demo_document() -> tuple[str, str, str]:
    """A few thousand tokens of real text that ships with Python, and a question on it.

    Returns:
        (where it comes from, the text, the question): the interpreter's LICENSE.txt
        (the history of Python and its licenses); where a distribution leaves it out,
        sections of the language reference from pydoc_data.
    """
    import sysconfig

    license_txt = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if license_txt.is_file():
        text = license_txt.read_text(encoding="utf-8", errors="replace")
        return f"{license_txt} ({len(text.encode()):,} bytes)", text, DOCUMENT_QUESTION
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[t].strip() for t in TOPICS if t in topics)[:14000]
    where = f"pydoc_data.topics: the language reference on {', '.join(TOPICS)}"
    return f"{where} ({len(text.encode()):,} bytes)", text, TOPICS_QUESTION


def make_job(tokenizer: Any, args: argparse.Namespace) -> DemoJob:
    """The document question for an instruct model; a code completion otherwise."""
    from kvstrata.workload.prompts import encode_prompt, uses_chat

    if uses_chat(tokenizer):
        where, text, question = demo_document()
        if args.question:
            question = args.question
        ids = encode_prompt(tokenizer, f"{text}\n\n{question}", chat=True)
        title = f"document: {where}\nquestion: {question}"
        return DemoJob(title, ids, "", block_size=64, residual_tokens=128, staging_tokens=512)
    prompt = args.question or DEFAULT_PROMPT
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    # Small blocks and a small residual window so a short generation spans many blocks.
    return DemoJob(
        f"prompt: {prompt!r} (greedy, no repeated {DEMO_NO_REPEAT_NGRAM}-grams)",
        ids,
        prompt,
        block_size=16,
        residual_tokens=16,
        staging_tokens=64,
        no_repeat_ngram=DEMO_NO_REPEAT_NGRAM,
    )


def _max_new(state: DemoState) -> int:
    return parse_tokens(state.args.max_new_tokens, "max_new_tokens")


def _tiered_cache(state: DemoState, codec: str, subdir: str) -> Any:
    """A TieredCache for the job: 10 % of the KV on the device, half of the rest on the
    host and half on disk, both in `codec`."""
    from kvstrata.integrations.hf.cache import TieredCache
    from kvstrata.model.budgets import placement

    job = state.job
    assert job is not None
    tokens = job.prompt_ids.shape[1] + _max_new(state)
    kwargs = placement(
        state.model,
        tokens,
        codec=codec,
        resident=RESIDENT_FRACTION,
        block_size=job.block_size,
        residual_tokens=job.residual_tokens,
        disk_dir=str(state.workdir / subdir),
    )
    return TieredCache(state.model.config, staging_tokens=job.staging_tokens, **kwargs)


def _generate(state: DemoState, cache: Any, streamer: Any = None) -> list[int]:
    job = state.job
    assert job is not None
    out = generate_ids(
        state.model,
        state.tokenizer,
        job.prompt_ids,
        cache,
        _max_new(state),
        no_repeat_ngram_size=job.no_repeat_ngram,
        streamer=streamer,
    )
    return out[0, job.prompt_ids.shape[1] :].tolist()


# -- the sections ----------------------------------------------------------------------------
def section_model(state: DemoState) -> int:
    """Load the model (converting it first if it is not in the cache yet)."""
    from kvstrata.workload.zoo import load_model

    quiet_transformers()
    start = time.perf_counter()
    state.model, state.tokenizer = load_model(state.model_name)
    seconds = time.perf_counter() - start
    apply_threads(state.model, state.args.threads)
    params = sum(p.numel() for p in state.model.parameters())
    print(f"model: {state.model_name}: {params / 1e6:.1f}M parameters, loaded in {seconds:.1f} s")
    state.results["load_seconds"] = seconds
    state.job = make_job(state.tokenizer, state.args)
    check_positions(state.model, state.job.prompt_ids.shape[1], _max_new(state), "max_new_tokens")
    return 0


def section_plan(state: DemoState) -> int:
    """A memory plan of the model on a small GPU, at its context length."""
    from kvstrata.workload.zoo import resolve_model_dir

    limit = getattr(state.model.config, "max_position_embeddings", None)
    context = min(PLAN_CONTEXT, limit) if isinstance(limit, int) else PLAN_CONTEXT
    model_dir = resolve_model_dir(state.model_name)
    print_plan(str(model_dir), state.model_name, context)
    return 0


def section_answer(state: DemoState) -> int:
    """The job with 10 % of the KV on the device, the rest int8 on host and disk."""
    from kvstrata.integrations.hf import enable

    job = state.job
    assert job is not None
    print(job.title)
    print(
        f"placement: {job.prompt_ids.shape[1]} prompt tokens + up to {_max_new(state)} new; "
        f"{RESIDENT_FRACTION:.0%} of the KV on the device (newest + sinks), the rest "
        f"{LOWER_CODEC} on the host and on disk (half each), blocks of {job.block_size} tokens"
    )
    cache = _tiered_cache(state, LOWER_CODEC, "answer")
    enable(state.model)
    print("-" * 72)
    tokens = _generate(state, cache, prompt_then_stream(state.tokenizer, job.echo))
    print("-" * 72)
    stats = cache.stats()
    cache.close()
    render_stats(stats)
    print_savings(state, stats)
    state.results["answer_tokens"] = tokens
    return 0


def print_savings(state: DemoState, stats: dict[str, Any]) -> None:
    """Memory against keeping the whole KV on the device: the same blocks (of every
    layer group) raw on the device, as the cache holds them there."""
    tiers = stats["tiers"]
    tokens = sum(stats["tokens"].values())
    resident = sum(t["used_blocks"] for t in tiers.values()) * tiers["device"]["block_bytes"]
    device = stats["peak_device_bytes"]
    held = sum(t["used_bytes"] for t in tiers.values())
    if device < resident:
        saved = f"{1 - device / resident:.0%} saved on the device"
    else:  # a short job: the device budget's minimum (a block per group) is the KV itself
        saved = f"no saving at {tokens} tokens: the device budget alone is that large"
    print(
        f"memory: all-resident KV {format_bytes(resident)} ({tokens} tokens); device peak "
        f"{format_bytes(device)} incl. staging = {saved}; all tiers together hold "
        f"{format_bytes(held)} ({1 - held / resident:.0%} less: {LOWER_CODEC} below the device)"
    )
    state.results["memory"] = {"resident": resident, "device_peak": device, "held": held}


def section_exact(state: DemoState) -> int:
    """Lossless codecs over the same placement give DynamicCache's tokens."""
    from transformers import DynamicCache

    from kvstrata.integrations.hf import enable

    cache = _tiered_cache(state, "none", "exact")
    enable(state.model)
    tiered = _generate(state, cache)
    cache.close()
    state.model.set_attn_implementation("sdpa")
    reference = _generate(state, DynamicCache(config=state.model.config))
    prompt_len = state.job.prompt_ids.shape[1] if state.job is not None else 0
    answer = state.results.get("answer_tokens")
    if answer is not None:
        if answer == reference:
            print(f"the {LOWER_CODEC} answer above: the exact tokens ({len(answer)} new tokens)")
        else:
            at = _first_difference(answer, reference)
            print(
                f"the {LOWER_CODEC} answer above: differs from the exact tokens from new "
                f"token {at} on (lossy codec)"
            )
    total = prompt_len + len(tiered)
    print(
        "check: the same job with lossless codecs (none) over the same placement, against "
        "transformers' DynamicCache (sdpa)"
    )
    if tiered == reference:
        print(f"tokens identical to DynamicCache: yes ({total} tokens)")
        return 0
    at = prompt_len + _first_difference(tiered, reference)
    print(f"tokens identical to DynamicCache: NO (first difference at token {at})")
    return 1


def section_engine(state: DemoState) -> int:
    """The serving engine: several long-context requests at once over one store whose
    device budget holds a quarter of their KV (kvstrata.cli.demo_engine)."""
    from kvstrata.cli import demo_engine as engine_demo

    exact = engine_demo.run(
        state.model_name,
        requests=ENGINE_REQUESTS,
        doc_tokens=ENGINE_DOC_TOKENS,
        max_tokens=ENGINE_MAX_TOKENS,
    )
    print(f"every answer identical to its own DynamicCache run: {'yes' if exact else 'NO'}")
    return 0 if exact else 1


SECTIONS: list[Section] = [
    Section("model", section_model),
    Section("plan", section_plan),
    Section(f"the job, {RESIDENT_FRACTION:.0%} of its KV on the device", section_answer),
    Section("exactness", section_exact),
    Section(
        "serving: several long-context requests at once, 25 % of their KV on the device",
        section_engine,
    ),
]


def run(args: argparse.Namespace) -> int:
    """Run `kvstrata demo`: every section in order; the worst exit code."""
    from kvstrata.workload.zoo import (
        DEFAULT_MODEL_NAME,
        EMBEDDED_NAMES,
        default_model_dir,
        resolve_model_dir,
    )

    parse_threads(args.threads)
    parse_tokens(args.max_new_tokens, "max_new_tokens")
    name = args.model
    if name in EMBEDDED_NAMES and not (default_model_dir() / "model.safetensors").is_file():
        print(
            f"kvstrata demo: the embedded model {DEFAULT_MODEL_NAME} is not installed at "
            f"{default_model_dir()}; showing its memory plan only"
        )
        print_plan(DEFAULT_MODEL_NAME, DEFAULT_MODEL_NAME)
        return 0
    # Resolve the name first (converting a named model on first use, with its status on
    # stderr), so a missing extra or a bad name is one line on stderr and nothing else.
    resolve_model_dir(name)
    code = 0
    with tempfile.TemporaryDirectory(prefix="kvstrata-demo-") as tmp:
        state = DemoState(args, Path(tmp), model_name=name)
        for number, section in enumerate(SECTIONS, 1):
            print(f"\n== {number}. {section.title} ==", flush=True)
            code = max(code, section.run(state))
            sys.stdout.flush()
    return code


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `demo` subcommand."""
    from kvstrata.workload.zoo import CLI_DEFAULT_MODEL

    p = sub.add_parser(
        "demo",
        help="a long document answered with 10 %% of its KV on the device + exactness check",
        description="Show kvstrata on a real model: a long document and a question, the KV "
        "spread over device, host and disk, and a check against DynamicCache.",
    )
    p.add_argument("--model", default=CLI_DEFAULT_MODEL, help=model_help())
    p.add_argument(
        "--question",
        default=None,
        help="the question on the document (a chat model) or the prompt (tiny)",
    )
    p.add_argument(
        "--max-new-tokens",
        default=str(DEFAULT_ANSWER_TOKENS),
        help=f"tokens to generate at most (default {DEFAULT_ANSWER_TOKENS})",
    )
    p.add_argument(
        "--threads", default="auto", help="torch threads: N, or auto (1 for small models)"
    )
    p.set_defaults(func=run)
