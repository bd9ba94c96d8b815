"""`kvstrata generate`: generate text with the KV cache spread over tiers.

kvstrata generate --prompt 'Why is the sky blue?' --max-new-tokens 200
kvstrata generate --prompt-file notes.txt --resident-fraction 0.1 --host-codec int8 --stats
cat long.txt | kvstrata generate --prompt-file - --temperature 0
kvstrata generate --model tiny --prompt 'def fibonacci(n):' --block-size 16 --stats
kvstrata generate --model ./my-model --resident-fraction 0.1 --disk-dir /tmp/kv --stats

--model is a name (smollm2, the default; tiny, the embedded byte model) or a model
directory. A model with a chat template (smollm2) gets the prompt as a user message and
prints only its answer; --raw feeds the text as is and echoes it first. The placement
flags are CacheConfig fields. With an offloading placement and no --host-budget, the host
tier is sized to hold every block the generation can produce.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from kvstrata.cli._cache_flags import add_placement_flags, cache_fields
from kvstrata.config import BLOCK_SIZE_MAX
from kvstrata.core.errors import ConfigError
from kvstrata.core.units import (
    format_bytes,
    parse_float,
    parse_fraction,
    parse_int,
    parse_size,
    parse_tokens,
)
from kvstrata.workload.prompts import encode_prompt, read_prompt_file, uses_chat
from kvstrata.workload.zoo import quiet_transformers

DEFAULT_PROMPT = "def fibonacci(n):"  # a completion prompt (models without a chat template)
DEFAULT_CHAT_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


MAX_THREADS = 1024
MAX_SEED = 2**64 - 1  # what torch.manual_seed takes


def parse_threads(value: str) -> int | None:
    """'auto' -> None; '2' -> 2 (ConfigError otherwise)."""
    if str(value).strip().lower() == "auto":
        return None
    return parse_int(value, "threads", maximum=MAX_THREADS, what="'auto' or a whole thread count")


def check_positions(model: Any, prompt_tokens: int, max_new: int, new_field: str) -> None:
    """ConfigError unless the prompt plus `max_new` new tokens fit the model's positions
    (`max_position_embeddings`): beyond them RoPE / position embeddings run out.

    Args:
        model: The model (its config's max_position_embeddings; no limit when absent).
        prompt_tokens: Tokens of the prompt.
        max_new: Tokens to generate.
        new_field: The flag of `max_new`, named in the message.
    """
    limit = getattr(model.config, "max_position_embeddings", None)
    if not isinstance(limit, int) or prompt_tokens + max_new <= limit:
        return
    if prompt_tokens >= limit:
        raise ConfigError.field(
            "prompt",
            f"{prompt_tokens} tokens",
            f"the model's max_position_embeddings is {limit}: leave room for the new tokens",
        )
    raise ConfigError.field(
        new_field,
        max_new,
        f"the prompt ({prompt_tokens} tokens) + {new_field} must be <= the model's "
        f"max_position_embeddings ({limit}): at most {limit - prompt_tokens}",
    )


def apply_threads(model: Any, value: str) -> None:
    """Set torch's thread count: the given number, or kvstrata.quality.evaluate.auto_threads."""
    import torch

    from kvstrata.quality.evaluate import auto_threads

    threads = parse_threads(value)
    if threads is None:
        threads = auto_threads(model)
    if threads is not None:
        torch.set_num_threads(threads)


def _fraction(value: str | None) -> float | None:
    return None if value is None else parse_fraction(value, "resident_fraction")


def resolve_prompt(args: argparse.Namespace) -> None:
    """Settle args.prompt once: --prompt, or the text of --prompt-file (read here, once:
    standard input cannot be read twice), or None for the model's default prompt."""
    if getattr(args, "prompt_file", None) is None:
        return
    if args.prompt is not None:
        raise ConfigError.field(
            "prompt_file", args.prompt_file, "give --prompt or --prompt-file, not both"
        )
    args.prompt = read_prompt_file(args.prompt_file)
    args.prompt_file = None


def check_sampling(args: argparse.Namespace) -> None:
    """Validate the generation flags (before any model loads)."""
    parse_tokens(args.max_new_tokens, "max_new_tokens")
    _temperature(args)
    _top_k(args)
    resolve_prompt(args)
    if args.prompt is not None and not args.prompt:
        raise ConfigError.field("prompt", args.prompt, "a non-empty prompt")
    parse_threads(args.threads)
    _no_repeat_ngram(args)
    _seed(args)
    from kvstrata.codecs.registry import get_codec

    get_codec(args.host_codec, "host_codec")
    if args.disk_codec is not None:
        get_codec(args.disk_codec, "disk_codec")
    parse_tokens(args.block_size, "block_size", maximum=BLOCK_SIZE_MAX)
    _fraction(args.resident_fraction)
    if args.max_tokens is not None:
        parse_tokens(args.max_tokens, "max_tokens")
    parse_tokens(args.residual, "residual_tokens", allow_zero=True)
    parse_tokens(args.sinks, "sink_tokens", allow_zero=True)
    for name in ("device_budget", "host_budget", "disk_budget"):
        if getattr(args, name) is not None:
            parse_size(getattr(args, name), name, allow_zero=name == "host_budget")


def _temperature(args: argparse.Namespace) -> float:
    return parse_float(args.temperature, "temperature", minimum=0.0)


def _top_k(args: argparse.Namespace) -> int | None:
    return None if args.top_k is None else parse_int(args.top_k, "top_k")


def _no_repeat_ngram(args: argparse.Namespace) -> int:
    return parse_int(args.no_repeat_ngram, "no_repeat_ngram", minimum=0, what="an n-gram size")


def _seed(args: argparse.Namespace) -> int:
    return parse_int(args.seed, "seed", minimum=0, maximum=MAX_SEED, what="a seed")


def cache_kwargs(args: argparse.Namespace, model: Any, max_tokens: int) -> dict[str, Any]:
    """CacheConfig fields from the placement flags.

    Args:
        args: Parsed flags.
        model: The model (sizes the automatic host/disk budgets).
        max_tokens: Tokens the cache must hold (prompt + new tokens).

    Returns:
        Keyword fields for TieredCache.
    """
    from kvstrata.model.budgets import lower_tier_bytes

    block_size = parse_tokens(args.block_size, "block_size", maximum=BLOCK_SIZE_MAX)
    if args.max_tokens is not None and parse_tokens(args.max_tokens, "max_tokens") < max_tokens:
        raise ConfigError.field(
            "max_tokens",
            args.max_tokens,
            f"at least the prompt + max_new_tokens ({max_tokens} tokens), which the cache holds",
        )
    kw: dict[str, Any] = {
        "block_size": block_size,
        "max_tokens": parse_tokens(args.max_tokens, "max_tokens")
        if args.max_tokens
        else max_tokens,
        "host_codec": args.host_codec,
        "disk_codec": args.disk_codec or args.host_codec,
        "residual_tokens": parse_tokens(args.residual, "residual_tokens", allow_zero=True),
        "sink_tokens": parse_tokens(args.sinks, "sink_tokens", allow_zero=True),
        "cold_attention": args.cold_attention,
    }
    if args.staging_tokens is not None:
        kw["staging_tokens"] = parse_tokens(args.staging_tokens, "staging_tokens")
    if args.device_budget is not None:
        kw["device_budget"] = parse_size(args.device_budget, "device_budget")
    frac = _fraction(args.resident_fraction)
    if frac is not None:
        kw["resident_fraction"] = frac
    offloading = "device_budget" in kw or "resident_fraction" in kw

    # Enough lower-tier room for every block plus a spare (see budgets.placement).
    def room(codec_field: str) -> int:
        return lower_tier_bytes(model, kw[codec_field], kw["max_tokens"], block_size, codec_field)

    if args.host_budget is not None:
        kw["host_budget"] = parse_size(args.host_budget, "host_budget", allow_zero=True)
    elif offloading and args.disk_dir is None:
        kw["host_budget"] = room("host_codec")
    if args.disk_dir is not None:
        kw["disk_dir"] = args.disk_dir
        kw["disk_compress"] = args.disk_compress
        kw["disk_delta"] = args.disk_delta
        kw["disk_o_direct"] = args.disk_o_direct
        kw["disk_budget"] = (
            parse_size(args.disk_budget, "disk_budget") if args.disk_budget else room("disk_codec")
        )
    elif args.disk_budget:
        raise ConfigError.field("disk_budget", args.disk_budget, "set --disk-dir to add a disk")
    elif args.disk_compress or args.disk_delta or args.disk_o_direct:
        name = next(n for n in ("disk_compress", "disk_delta", "disk_o_direct") if getattr(args, n))
        raise ConfigError.field(name, True, "set --disk-dir to add a disk")
    kw.update(cache_fields(args))
    return kw


def generate_ids(
    model: Any,
    tokenizer: Any,
    prompt: Any,
    cache: Any,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    seed: int = 0,
    min_new_tokens: int | None = None,
    no_repeat_ngram_size: int = 0,
    streamer: Any = None,
) -> Any:
    """Generate from `prompt` with `cache` (greedy when temperature is 0).

    Args:
        model: A causal LM whose attention suits the cache (kvstrata.enable for a
            TieredCache, sdpa for DynamicCache).
        tokenizer: Its tokenizer.
        prompt: The prompt text (fed as is), or its token ids [1, n] (see encode_prompt).
        cache: An empty transformers Cache.
        max_new_tokens: Tokens to generate at most.
        temperature: 0 = greedy; > 0 samples.
        top_k: Sample among the k most likely tokens (None = all).
        seed: Sampling seed.
        min_new_tokens: Suppress <eos> until this many tokens (None = allow it).
        no_repeat_ngram_size: Forbid repeating any n-gram of this size (0 = off); keeps
            greedy decoding of a small model out of loops, and stays deterministic.
        streamer: A transformers streamer (e.g. TextStreamer) or None.

    Returns:
        The token ids [1, prompt + new].
    """
    import torch

    if isinstance(prompt, str):
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    else:
        input_ids = torch.as_tensor(prompt, dtype=torch.long).reshape(1, -1)
    kwargs: dict[str, Any] = {"max_new_tokens": max_new_tokens, "do_sample": temperature > 0}
    if temperature > 0:
        torch.manual_seed(seed)
        kwargs.update(temperature=temperature, top_k=top_k or 0)
    else:
        # Greedy: no sampling knobs, so transformers does not warn they are unused.
        kwargs.update(temperature=None, top_k=None, top_p=None)
    if min_new_tokens:
        kwargs["min_new_tokens"] = min_new_tokens
    if no_repeat_ngram_size:
        kwargs["no_repeat_ngram_size"] = no_repeat_ngram_size
    if tokenizer.pad_token_id is not None:
        kwargs["pad_token_id"] = tokenizer.pad_token_id
    with torch.inference_mode():
        return model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            cache=cache,
            streamer=streamer,
            **kwargs,
        )


def render_stats(stats: dict[str, Any]) -> None:
    """Print TieredCache.stats() as small tables: tier occupancy, links, device peak."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 120, soft_wrap=False)
    if not stats.get("initialized"):
        console.print("cache stats: the cache was never used")
        return
    bs = stats["block_size"]
    tiers = Table(title=f"KV cache tiers (block size {bs} tokens)")
    for col in ("tier", "blocks used", "peak blocks", "budget blocks", "bytes used"):
        tiers.add_column(col, justify="left" if col == "tier" else "right")
    for name, occ in stats["tiers"].items():
        tiers.add_row(
            name,
            str(occ["used_blocks"]),
            str(occ["peak_used_blocks"]),
            str(occ["budget_blocks"]),
            format_bytes(occ["used_bytes"]),
        )
    console.print(tiers)
    moved = stats["bytes_moved"]
    if moved:
        links = Table(title=f"bytes moved ({stats['blocks_moved']} block moves)")
        links.add_column("link")
        links.add_column("bytes", justify="right")
        for link, num in moved.items():
            links.add_row(link, format_bytes(num))
        console.print(links)
    else:
        console.print("bytes moved: none (every block stayed where it was written)")
    console.print(
        f"peak device bytes: {format_bytes(stats['peak_device_bytes'])} "
        f"(device budget {format_bytes(stats['device_budget_bytes'])} + staging "
        f"{format_bytes(stats['staging_bytes'])}); tokens cached: "
        f"{sum(stats['tokens'].values())}",
        highlight=False,
    )
    if stats.get("numa"):  # what NUMA placement did (on one node: that it is a no-op)
        console.print(f"NUMA: {stats['numa']['notice']}", highlight=False)
    prefix = stats.get("prefix") or {}
    if prefix.get("lookups"):
        where = ", ".join(f"{t} {n}" for t, n in prefix["hit_tokens_by_tier"].items())
        console.print(
            f"prefix cache: {prefix['hit_tokens']} of {prefix['lookup_tokens']} prompt tokens "
            f"reused{f' ({where})' if where else ''}",
            highlight=False,
        )


def prompt_then_stream(
    tokenizer: Any, prompt: str, on_first: Callable[[], None] | None = None
) -> Any:
    """A TextStreamer that echoes the prompt (may be "") only once the first new token is
    out, so an error in the first forward (e.g. a budget the cache refuses) leaves stdout
    empty and stderr with its one line. `on_first` runs just before (e.g. to end a
    status line)."""
    from transformers import TextStreamer

    class PromptThenStream(TextStreamer):
        def __init__(self) -> None:
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.pending_prompt: str | None = prompt

        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            if self.pending_prompt is not None:
                if on_first is not None:
                    on_first()
                print(self.pending_prompt, end="", flush=True)
                self.pending_prompt = None
            super().on_finalized_text(text, stream_end)

    return PromptThenStream()


class _NoStatus:
    def stop(self) -> None:
        pass


def live_status(text: str) -> Any:
    """A live one-line status on stderr (rich spinner + elapsed seconds) while long work
    runs, when stderr is a terminal; `.stop()` ends it (idempotent)."""
    if not sys.stderr.isatty():
        return _NoStatus()
    from rich.console import Console

    status = Console(stderr=True).status(f"kvstrata: {text}")
    status.start()
    return status


def run(args: argparse.Namespace) -> int:
    """Run `kvstrata generate`; exit code 0."""
    check_sampling(args)  # before the slow imports: bad flags answer at once
    from kvstrata.integrations.hf import TieredCache, enable
    from kvstrata.workload.zoo import load_model

    max_new = parse_tokens(args.max_new_tokens, "max_new_tokens")
    quiet_transformers()
    model, tokenizer = load_model(args.model)
    apply_threads(model, args.threads)
    chat = uses_chat(tokenizer, args.raw)
    prompt = args.prompt
    if prompt is None:
        prompt = DEFAULT_CHAT_PROMPT if chat else DEFAULT_PROMPT
    prompt_ids = encode_prompt(tokenizer, prompt, chat)
    check_positions(model, prompt_ids.shape[1], max_new, "max_new_tokens")
    kwargs = cache_kwargs(args, model, prompt_ids.shape[1] + max_new)
    # With a disk tier, the prompt's longest prefix an earlier run left there is reused
    # (only the rest is prefilled), and this run's blocks are kept for the next one.
    dtype = next(model.parameters()).dtype
    cache = TieredCache(model.config, prompt_ids=prompt_ids, dtype=dtype, **kwargs)
    enable(model)
    # A chat answer is printed alone; a completion follows its prompt.
    echo = "" if chat else prompt
    todo = prompt_ids.shape[1] - cache.matched_tokens
    status = live_status(f"prefilling {todo} prompt tokens ({cache.matched_tokens} cached)")
    streamer = None if args.no_stream else prompt_then_stream(tokenizer, echo, status.stop)
    try:
        out = generate_ids(
            model,
            tokenizer,
            prompt_ids,
            cache,
            max_new,
            temperature=_temperature(args),
            top_k=_top_k(args),
            seed=_seed(args),
            no_repeat_ngram_size=_no_repeat_ngram(args),
            streamer=streamer,
        )
    finally:
        status.stop()
    if streamer is None:
        new = tokenizer.decode(out[0, prompt_ids.shape[1] :], skip_special_tokens=True)
        print(echo + new)
    if args.stats:
        render_stats(cache.stats())
    cache.close()
    return 0


def model_help() -> str:
    """The --model help text: the names, then a model directory or a GGUF file."""
    from kvstrata.workload.zoo import CLI_DEFAULT_MODEL

    return (
        f"{CLI_DEFAULT_MODEL} (default: SmolLM2-135M-Instruct, extra 'model'), tiny (the "
        "embedded byte model; 'default' is its old name), a model directory, or a .gguf "
        "file (converted once into the cache)"
    )


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `generate` subcommand."""
    p = sub.add_parser(
        "generate",
        help="generate text with the KV cache spread over device, host and disk",
        description="Generate text with a kvstrata TieredCache (transformers generate).",
    )
    from kvstrata.workload.zoo import CLI_DEFAULT_MODEL

    p.add_argument("--model", default=CLI_DEFAULT_MODEL, help=model_help())
    p.add_argument(
        "--prompt",
        default=None,
        help=f"prompt (default {DEFAULT_CHAT_PROMPT!r}; {DEFAULT_PROMPT!r} for a model "
        "without a chat template)",
    )
    p.add_argument(
        "--prompt-file", default=None, help="read the prompt from a file ('-': standard input)"
    )
    p.add_argument(
        "--raw", action="store_true", help="feed the prompt as is, without the chat template"
    )
    p.add_argument("--max-new-tokens", default="200", help="tokens to generate (default 200)")
    # The 3M-parameter embedded model falls into runs of spaces when decoded greedily;
    # light sampling (seeded, so runs repeat) gives readable text.
    p.add_argument("--temperature", default="0.7", help="0 = greedy; > 0 samples (default 0.7)")
    p.add_argument(
        "--top-k", default="40", help="sample among the k most likely tokens (default 40)"
    )
    p.add_argument(
        "--no-repeat-ngram", default="0", help="forbid repeating n-grams of this size (0 = off)"
    )
    p.add_argument("--seed", default="0", help="sampling seed (default 0)")
    p.add_argument("--stats", action="store_true", help="print the cache statistics")
    p.add_argument("--no-stream", action="store_true", help="print the text at the end")
    p.add_argument(
        "--threads", default="auto", help="torch threads: N, or auto (1 for small models)"
    )
    add_placement_flags(p)
    p.set_defaults(func=run)
