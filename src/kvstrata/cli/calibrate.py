"""`kvstrata calibrate`: the calibration file the calibrated codecs need.

kvstrata calibrate --model smollm2 --out smollm2.safetensors
kvstrata eval ppl --model smollm2 --codec int8,lowrank-pre-r29-int8+int8 \
    --calibration smollm2.safetensors

Runs the model over standard-library text that is not among the held-out files `kvstrata
eval` scores, and writes per layer and KV head the key / value bases and head-importance
rankings and the model's RoPE frame (see kvstrata/quality/calibrate.py). The file names
the model it was made from; using it with another model is an error.
"""

from __future__ import annotations

import argparse

from kvstrata.cli.generate import apply_threads, model_help
from kvstrata.core.units import parse_tokens
from kvstrata.workload.zoo import quiet_transformers


def run(args: argparse.Namespace) -> int:
    from kvstrata.codecs.calibration import load_calibration
    from kvstrata.quality.calibrate import write_calibration
    from kvstrata.workload.zoo import load_model

    tokens = parse_tokens(args.tokens, "tokens")
    context = parse_tokens(args.context, "context")
    quiet_transformers()
    model, tokenizer = load_model(args.model)
    apply_threads(model, args.threads)
    digest = write_calibration(
        model, tokenizer, args.out, model_name=args.model, tokens=tokens, context=context
    )
    cal = load_calibration(args.out)
    print(
        f"wrote {args.out} (digest {digest}): {cal.num_layers} layers x {cal.num_kv_heads} "
        f"kv heads, head dim {cal.head_dim}, {cal.meta.get('tokens')} calibration tokens"
    )
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `calibrate` subcommand."""
    from kvstrata.workload.zoo import CLI_DEFAULT_MODEL

    p = sub.add_parser(
        "calibrate",
        help="write the calibration file of the lowrank-* / heads* codecs for a model",
        description="Key/value bases and KV-head importance of a model, from text the "
        "quality harness does not evaluate on.",
    )
    p.add_argument("--model", default=CLI_DEFAULT_MODEL, help=model_help())
    p.add_argument("--out", required=True, help="the .safetensors file to write")
    p.add_argument("--tokens", default="8192", help="calibration tokens (default 8192)")
    p.add_argument("--context", default="2048", help="tokens per forward (default 2048)")
    p.add_argument(
        "--threads", default="auto", help="torch threads: N, or auto (1 for small models)"
    )
    p.set_defaults(func=run)
