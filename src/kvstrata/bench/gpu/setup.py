"""The harness of `kvstrata bench gpu` (kvstrata.bench.gpu): its settings (full and
--quick sizes), the device check, the toy Llama it measures, exact prefill, replay
into a cache and timed greedy decode, the wall-clock budget and the section runner
that keeps one broken section from losing the others' numbers.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from kvstrata.bench import _timing
from kvstrata.core.errors import ConfigError

MIB = 1 << 20
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FULL = dict(
    layers=8,
    hidden=2048,
    heads=16,
    kv_heads=8,
    head_dim=128,
    intermediate=5632,
    block_size=64,
    contexts="8k,32k,64k",
    memory_contexts="4k,16k,64k",
    codecs="none,int4",
    steps=24,
    repeats=3,
    copy_mib=256,
    memory_budget_tokens=4096,
    residual_tokens=128,
    memory_staging_tokens=4096,
)
QUICK = dict(
    layers=2,
    hidden=128,
    heads=2,
    kv_heads=2,
    head_dim=64,
    intermediate=256,
    block_size=64,
    contexts="256,512",
    memory_contexts="256,1024",
    codecs="none,int4",
    steps=4,
    repeats=1,
    copy_mib=4,
    memory_budget_tokens=128,
    residual_tokens=32,
    memory_staging_tokens=128,
)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's sizes (QUICK or FULL, overridden by the options given), contexts,
    codecs and fractions parsed, the dtype resolved; ConfigError for a bad value."""
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


def checked_device(args: argparse.Namespace) -> torch.device:
    """`--device`, refused (ConfigError) without CUDA, or on the CPU without --quick."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError.field(
            "device",
            args.device,
            "CUDA is not available here: run on a GPU machine, or "
            "`--quick --device cpu` for a smoke run of the harness",
        )
    if device.type == "cpu" and not args.quick:
        raise ConfigError.field("device", "cpu", "the full run needs a GPU; add --quick")
    return device


def build_model(s: dict[str, Any], device: torch.device) -> torch.nn.Module:
    """The measured model: a random-init Llama slice of the settings' sizes, on sdpa."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=259,
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        max_position_embeddings=max(s["contexts"] + s["memory_contexts"]) + 4096,
        initializer_range=0.3,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device, s["dtype"]).eval()


def sync(device: torch.device) -> None:
    """Wait for the device's work (CUDA only), so that host timers measure it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of K and V per token over all layers, in the model's dtype."""
    cfg = model.config
    elem = torch.empty((), dtype=model.dtype).element_size()
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * elem


@torch.no_grad()
def prefill(model: torch.nn.Module, context: int) -> tuple[list, torch.Tensor]:
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
def replay(cache: Any, kv: list, device: torch.device) -> Any:
    """`cache` with the prefill's per-layer K/V `kv` written into it, on `device`."""
    for layer, (k, v) in enumerate(kv):
        cache.update(k.to(device), v.to(device), layer)
    return cache


@torch.no_grad()
def greedy_decode(model: Any, cache: Any, first: torch.Tensor, steps: int, device: torch.device):
    """`steps` greedy single-token forwards. Returns (tokens [steps], seconds)."""
    tok = first.view(1, 1).to(device)
    tokens = []
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        tok = model(input_ids=tok, cache=cache).logits[0, -1].argmax().view(1, 1)
        tokens.append(tok)
    sync(device)
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


def run_section(report: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    """report[name] = fn(), or the error (printed to stderr) when it raises."""
    try:
        report[name] = fn()
    except Exception as err:  # one broken section must not lose the others' numbers
        tb = traceback.format_exc()
        print(f"kvstrata bench gpu: section {name!r} failed:\n{tb}", file=sys.stderr)
        report[name] = {"error": f"{type(err).__name__}: {err}", "traceback": tb[-4000:]}
        report["ok"] = False
