"""What `kvstrata bench fleet` asks (pure: text in, requests out) and the summaries of
what the client saw.

Each tenant has a long system prompt cut from real text (the embedded model's held-out
stdlib files); a request is its tenant's system prompt, a short question cut from
elsewhere in that text, and a short answer. The warm-up asks every tenant once, in order;
the measured phase draws tenants uniformly at random and sends at Poisson arrival times
(an open loop: a request is sent at its time whether or not earlier ones are answered).
The seed fixes the text, the order and the times, so every policy gets the same requests
at the same offsets.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.bench._timing import percentile

SYSTEM_HEAD = "System: you are the assistant of tenant {tenant}. Its code base follows.\n\n"
QUESTION_HEAD = "\n\nQuestion: where is this used?\n"
QUESTION_TAIL = "\nAnswer:"


@dataclass(frozen=True)
class Sizes:
    """How big the workload is (tokens are the served model's tokens)."""

    tenants: int = 12
    system_tokens: int = 2048
    question_tokens: int = 24
    max_tokens: int = 16
    requests: int = 48  # measured, after the warm-up's one per tenant
    rate: float = 0.5  # mean arrivals per second (Poisson)


@dataclass(frozen=True)
class Req:
    """One completion request: `key` names it the same way under every policy; `at`
    is its send time in seconds from the phase's start."""

    key: str
    tenant: int
    prompt: str
    max_tokens: int
    at: float = 0.0


@dataclass
class Workload:
    warmup: list[Req]
    measured: list[Req]


def build(
    ids: Sequence[int], decode: Callable[[Sequence[int]], str], s: Sizes, seed: int = 0
) -> Workload:
    """The tenants' prompts from the token stream `ids` (each piece cut in turn,
    wrapping around) and the two phases."""
    if not ids:
        raise ValueError("the token pool is empty")
    at = 0

    def take(n: int) -> str:
        nonlocal at
        piece: list[int] = []
        while len(piece) < n:
            part = list(ids[at : at + n - len(piece)])
            piece += part
            at = (at + len(part)) % len(ids)
        return decode(piece)

    systems = [SYSTEM_HEAD.format(tenant=t) + take(s.system_tokens) for t in range(s.tenants)]
    rng = random.Random(seed)

    def ask(key: str, tenant: int, when: float) -> Req:
        prompt = systems[tenant] + QUESTION_HEAD + take(s.question_tokens) + QUESTION_TAIL
        return Req(key, tenant, prompt, s.max_tokens, when)

    warmup = [ask(f"warmup/{t}", t, 0.0) for t in range(s.tenants)]
    measured, when = [], 0.0
    for i in range(s.requests):
        measured.append(ask(f"q{i}", rng.randrange(s.tenants), when))
        when += rng.expovariate(s.rate)
    return Workload(warmup, measured)


def summarize(records: Sequence[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """One phase under one policy: TTFT p50 / p90 / p99 (seconds), output tokens/s,
    requests and errors, prompt tokens and those the replicas found cached."""
    ok = [r for r in records if r.get("error") is None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] == r["ttft_s"]]  # NaN-free
    out = sum(r["completion_tokens"] for r in ok)
    cached = [r["cached_tokens"] for r in ok if r["cached_tokens"] is not None]
    return {
        "wall_s": wall_s,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "output_tokens": out,
        "output_tokens_per_s": out / wall_s if wall_s > 0 else float("nan"),
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else float("nan"),
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "cached_tokens": sum(cached),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p90_s": percentile(ttft, 0.9),
        "ttft_p99_s": percentile(ttft, 0.99),
    }


def sources(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Where the phase's prompt tokens came from, summed over the replicas' /metrics
    (`before` / `after`: `hit{tier}` and `prompt` counters): tokens per tier, and those
    recomputed (prompt tokens not found on any tier)."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after if k != "requests"}
    found = {k.removeprefix("hit:"): v for k, v in delta.items() if k.startswith("hit:") and v}
    out = dict(sorted(found.items()))
    out["recomputed"] = max(0.0, delta.get("prompt", 0.0) - sum(found.values()))
    return out


def texts_equal(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each policy's greedy answers against the first policy's, request by request
    (requests that failed under either are left out and counted)."""
    names = list(runs)
    if not names:
        return {}
    base = {r["key"]: r for r in runs[names[0]]}
    out: dict[str, Any] = {}
    for name in names[1:]:
        same = differ = skipped = 0
        for r in runs[name]:
            b = base.get(r["key"])
            if b is None or b.get("error") or r.get("error"):
                skipped += 1
            elif b["text"] == r["text"]:
                same += 1
            else:
                differ += 1
        out[name] = {"against": names[0], "equal": same, "differ": differ, "skipped": skipped}
    return out
