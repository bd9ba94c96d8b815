"""`kvstrata bench blend`: documents' KV reused at any position (CacheBlend) against a
full prefill and against prefix caching, on a retrieval workload.

Workload (seeded): a pool of `--pool` documents cut from held-out text (the embedded
model's held-out stdlib sources), each 500-1,500 tokens with one "needle" line
naming a project's five-digit access code; every request puts `--docs` of them, in a
fresh random order, between a fixed system prompt and a question about one of their
codes (the assistant's turn opened with "The access code of project X is").

TTFT (`generate` with max_tokens 1, one request at a time, through the engine that
`kvstrata serve` runs; three engines over one model, requests interleaved):
  full      prefix caching off: every prompt computed in full
  prefix    prefix caching on, warmed with the same documents in other orders: the
            system prompt is found, the shuffled documents mostly are not
  blend@r   the documents found wherever they sit (warmed the same way), r of their
            reused tokens recomputed in context

Quality against a full prefill (TieredCache path, the same requests): retrieval
accuracy (the code in the greedy answer), greedy agreement (the same `--answer-tokens`
tokens), and the perplexity of the reference answer (the code) given the prompt.
The recommended r is the smallest whose accuracy is within 2 points of the full
prefill's and whose answer perplexity is within 2 % (else: none is, said so).
"""

from __future__ import annotations

import argparse
import math
import random
import time
from typing import Any

import torch

from kvstrata.bench import _timing
from kvstrata.bench._models import bench_model, heldout_ids

NAME = "blend"
HELP = "documents reused at any position (CacheBlend) vs full prefill and prefix caching"
IN_ALL = False  # minutes on the real model; run it on its own
RATIOS = (0.0, 0.05, 0.15, 0.3, 0.5)  # the issue asks the first four; 0.5 shows the curve
SYSTEM = "You answer questions about the documents below."
TARGET_TTFT = 2.5  # prefix / blend at the recommended r (issue #52)
MAX_ACCURACY_DROP = 0.02
MAX_PPL_RISE = 0.02


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model (default: smollm2, else tiny)")
    parser.add_argument("--docs", type=int, default=4, help="documents per request")
    parser.add_argument("--pool", type=int, default=8, help="documents in the pool")
    parser.add_argument("--requests", type=int, default=8, help="timed requests")
    parser.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="blend r values")
    parser.add_argument("--answer-tokens", type=int, default=8, help="greedy tokens compared")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--json", default=None, help="write the report as JSON to this file")


def _say(text: str) -> None:
    import sys

    print(f"[bench blend] {text}", file=sys.stderr, flush=True)


def workload(tokenizer: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The requests: text, documents, the asked project and its code (seeded)."""
    rng = random.Random(args.seed)
    lo, hi = (60, 120) if args.quick else (500, 1500)
    ids = heldout_ids(tokenizer, args.pool * hi + 1000)
    pool, off = [], 0
    for i in range(args.pool):
        n = rng.randint(lo, hi)
        body = tokenizer.decode(ids[off : off + n])
        off += n
        code = str(rng.randint(10000, 99999))
        name = f"p{i:02d}{rng.choice('kmrstvxz')}"
        cut = body.find("\n", len(body) // 3) + 1 or len(body) // 2
        needle = f"# The access code of project {name} is {code}.\n"
        pool.append((name, code, body[:cut] + needle + body[cut:]))
    chat = bool(getattr(tokenizer, "chat_template", None))
    reqs = []
    for _ in range(args.requests * 2):  # the first half warms the stores
        docs = rng.sample(pool, args.docs)
        name, code, _ = rng.choice(docs)
        question = f"Question: what is the access code of project {name}?"
        opener = f"The access code of project {name} is"
        if chat:
            head = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nDocuments:\n"
            tail = f"{question}<|im_end|>\n<|im_start|>assistant\n{opener}"
        else:
            head, tail = f"{SYSTEM}\nDocuments:\n", f"{question}\n{opener}"
        text = head + "".join(d[2] + "\n\n" for d in docs) + tail
        reqs.append({"text": text, "docs": [d[2] for d in docs], "code": code})
    return reqs


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from kvstrata.engine import Engine, EngineConfig, SamplingParams
    from kvstrata.workload.chunks import Chunks
    from kvstrata.workload.zoo import load_model, quiet_transformers

    quiet_transformers()
    torch.set_num_threads(args.threads)
    name, path = bench_model(args.model, _say)
    model, tok = load_model(path)
    ratios = _ratios(args.ratios)
    reqs = workload(tok, args)
    timed = reqs[args.requests :]  # the first half warms the stores
    prompts = [Chunks.of(r["text"], r["docs"]) for r in reqs]
    encoded = [p.encode(tok) for p in prompts]
    longest = max(len(ids) for ids, _ in encoded)
    _say(f"{name}: {len(timed)} requests of {args.docs} documents, up to {longest} tokens")
    quality = _quality(
        model, tok, [encoded[args.requests + i] for i in range(len(timed))], timed, ratios, args
    )
    cfg = EngineConfig(max_num_seqs=1, threads=args.threads, native_linear=False)
    budget = dict(device_budget="2GiB", max_tokens=2 * longest + 64)
    engines = {
        "full": Engine(model, tok, config=cfg, prefix_caching=False, **budget),
        "prefix": Engine(model, tok, config=cfg, **budget),
        "blend": Engine(model, tok, config=cfg, **budget),
    }
    one = SamplingParams(max_tokens=1, temperature=0)

    def call(engine: str, i: int, r: float | None = None) -> float:
        eng = engines[engine]
        prompt = prompts[i] if engine == "blend" else encoded[i][0]
        t0 = time.perf_counter()
        res = _generate_one(eng, prompt, one, r)
        seconds = time.perf_counter() - t0
        if res.error:
            raise RuntimeError(f"{engine} request failed: {res.error}")
        return seconds

    try:
        _say("warming the prefix and blend stores with the documents in other orders")
        for i in range(args.requests):
            call("prefix", i)
            call("blend", i, ratios[0])
        times: dict[str, list[float]] = {"full": [], "prefix": []}
        times.update({f"blend@{r:g}": [] for r in ratios})
        for j in range(len(timed)):
            i = args.requests + j
            _say(f"timed request {j + 1}/{len(timed)}")
            times["full"].append(call("full", i))
            times["prefix"].append(call("prefix", i))
            for r in ratios:
                times[f"blend@{r:g}"].append(call("blend", i, r))
        blend_metrics = engines["blend"].metrics
        reused = blend_metrics.value("kvstrata_blend_tokens_total", kind="reused")
        recomputed = blend_metrics.value("kvstrata_blend_tokens_total", kind="recomputed")
    finally:
        for eng in engines.values():
            eng.shutdown()
    med = {k: _timing.median(v) for k, v in times.items()}
    ttft = [
        {
            "variant": k,
            "ttft_s": med[k],
            "spread": _timing.spread(times[k]),
            "prefix/this": med["prefix"] / med[k],
            "full/this": med["full"] / med[k],
        }
        for k in times
    ]
    pick = _recommend(quality)
    return {
        "scenario": NAME,
        "model": name,
        "docs": args.docs,
        "pool": args.pool,
        "requests": len(timed),
        "max_prompt_tokens": longest,
        "threads": args.threads,
        "ttft": ttft,
        "quality": quality,
        "blend_tokens": {"reused": reused, "recomputed": recomputed},
        "recommended_r": pick,
        "targets": {
            "prefix/blend": TARGET_TTFT,
            "accuracy_drop": MAX_ACCURACY_DROP,
            "ppl_rise": MAX_PPL_RISE,
        },
        "machine_warning": _timing.load_warning(args.threads),
    }


def _generate_one(eng: Any, prompt: Any, params: Any, r: float | None) -> Any:
    """One request to its end through `submit` (generate has no per-request r)."""
    import threading

    from kvstrata.engine.params import RequestOutput

    done, result = threading.Event(), RequestOutput(request_id="")

    def on_output(out: Any) -> None:
        result.token_ids += out.token_ids
        result.error = out.error
        if out.finished:
            done.set()

    kwargs = {} if r is None else {"blend_recompute": r}
    eng.submit(prompt, params, on_output=on_output, **kwargs)
    done.wait()
    return result


def _quality(
    model: Any, tok: Any, encoded: list, reqs: list, ratios: list[float], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Accuracy, agreement and answer perplexity of a full prefill and of each r."""
    from kvstrata.integrations.hf import TieredCache, enable
    from kvstrata.integrations.hf.blend_store import blend_prompt
    from kvstrata.store.kvstore import KVStore

    enable(model)
    longest = max(len(ids) for ids, _ in encoded)
    store = KVStore(model.config, device_budget="2GiB", max_tokens=4 * longest)
    rows: dict[str, dict[str, float]] = {}
    full_out: list[list[int]] = []
    try:
        for r in [None, *ratios]:
            key = "full" if r is None else f"blend@{r:g}"
            _say(f"quality: {key}")
            ok = agree = 0
            nll = tokens = 0.0
            for i, ((ids, spans), req) in enumerate(zip(encoded, reqs, strict=True)):
                cache = TieredCache.from_store(store) if r is not None else None
                if r is None:  # a store of its own: nothing reused
                    fresh = KVStore(model.config, device_budget="2GiB", max_tokens=2 * longest)
                    cache = TieredCache.from_store(fresh)
                    rows_ids = torch.tensor([ids])
                else:
                    rows_ids = blend_prompt(model, cache, (ids, spans), recompute=r)
                held = len(ids) - 1
                out = model.generate(
                    rows_ids, cache=cache, max_new_tokens=args.answer_tokens, do_sample=False
                )[0, len(ids) :].tolist()
                cache.crop(held - cache.get_seq_length())
                answer = tok(" " + req["code"], add_special_tokens=False)["input_ids"]
                x = torch.tensor([[ids[-1], *answer]])
                with torch.inference_mode():
                    logits = model(x, cache=cache).logits[0, :-1].float()
                lp = torch.log_softmax(logits, -1)[torch.arange(len(answer)), torch.tensor(answer)]
                nll -= float(lp.sum())
                tokens += len(answer)
                ok += req["code"] in tok.decode(out)
                if r is None:
                    full_out.append(out)
                else:
                    agree += out == full_out[i]
                cache.close()
                if r is None:
                    fresh.close()
            rows[key] = {
                "accuracy": ok / len(reqs),
                "agreement": 1.0 if r is None else agree / len(reqs),
                "answer_ppl": math.exp(nll / max(tokens, 1)),
            }
    finally:
        store.close()
    base = rows["full"]
    return [
        {
            "variant": k,
            **v,
            "accuracy_drop": base["accuracy"] - v["accuracy"],
            "ppl_rise": v["answer_ppl"] / base["answer_ppl"] - 1,
        }
        for k, v in rows.items()
    ]


def _ratios(text: str) -> list[float]:
    """--ratios: comma-separated shares in [0, 1] (one-line ConfigError otherwise)."""
    from kvstrata.core.blending import check_recompute
    from kvstrata.core.errors import ConfigError
    from kvstrata.core.units import parse_float

    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    if not parts:
        raise ConfigError.field("ratios", text, "comma-separated shares such as 0,0.15,0.3")
    return [check_recompute(parse_float(p, "ratios"), "ratios") for p in parts]


def _recommend(quality: list[dict[str, Any]]) -> float | None:
    """The smallest r within the quality bounds, None when no r is."""
    for row in quality:
        if row["variant"] == "full":
            continue
        if row["accuracy_drop"] <= MAX_ACCURACY_DROP and row["ppl_rise"] <= MAX_PPL_RISE:
            return float(row["variant"].split("@")[1])
    return None


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args = argparse.Namespace(**vars(args))
        args.docs, args.pool, args.requests, args.answer_tokens = 2, 3, 2, 4
        args.model = args.model or "tiny"
    _timing.check_positive(args, "docs", "pool", "requests", "answer_tokens", "threads")
    _ratios(args.ratios)
    if args.docs > args.pool:
        from kvstrata.core.errors import ConfigError

        raise ConfigError.field("docs", args.docs, f"at most --pool ({args.pool})")
    report = measure(args)
    if args.json:
        import json
        from pathlib import Path

        Path(args.json).write_text(json.dumps(_timing.plain(report), indent=2) + "\n")
    rows = [
        (
            v["variant"],
            f"{v['ttft_s']:.2f}",
            f"{100 * v['spread']:.0f} %",
            f"{v['prefix/this']:.2f}x",
            f"{v['full/this']:.2f}x",
        )
        for v in report["ttft"]
    ]
    notes = [
        f"{report['model']}, {report['docs']} documents per request, prompts up to "
        f"{report['max_prompt_tokens']} tokens, {report['requests']} requests"
    ]
    if report["machine_warning"]:
        notes.append(report["machine_warning"])
    _timing.print_table(
        "time to first token (medians)",
        ("variant", "TTFT s", "spread", "prefix / this", "full / this"),
        rows,
        notes,
    )
    qrows = [
        (
            q["variant"],
            f"{100 * q['accuracy']:.0f} %",
            f"{100 * q['agreement']:.0f} %",
            f"{q['answer_ppl']:.3f}",
            f"{100 * q['ppl_rise']:+.1f} %",
        )
        for q in report["quality"]
    ]
    pick = report["recommended_r"]
    _timing.print_table(
        "answer quality against a full prefill",
        ("variant", "retrieval", "greedy agreement", "answer PPL", "ΔPPL"),
        qrows,
        [
            "recommended r: "
            + (f"{pick:g}" if pick is not None else "none within 2 points / 2 % on this model")
        ],
    )
    return 0
