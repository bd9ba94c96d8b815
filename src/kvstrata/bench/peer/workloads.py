"""The workloads of `kvstrata bench peer` (pure: token ids in, requests out) and the
metric maths over what the client saw (TTFT / TPOT percentiles, output agreement).

Every prompt is a list of token ids cut from real text (the embedded model's held-out
stdlib files, tokenized by the served model's tokenizer) and sent as the completion
`prompt`: both servers then compute exactly the same tokens (no tokenizer, BOS or
chat-template difference between them), and prefix hits line up with whole blocks.
Each repeat draws fresh text, so no repeat finds the previous one's documents cached.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from kvstrata.bench._timing import percentile

WORKLOADS = ("docqa", "chat", "throughput", "single")
# The rows a run reports: docqa is two phases (cold documents, then questions on them).
PHASES = {
    "docqa": ("docqa_warm", "docqa_query"),
    "chat": ("chat",),
    "throughput": ("throughput",),
    "single": ("single",),
}
# Fixed text around the cut-out pieces (tokenized once by the model's tokenizer).
QUESTION_HEAD = "\n\nQuestion: what does this part of the code above do?\n"
QUESTION_TAIL = "\nAnswer:"
SYSTEM_HEAD = "System: you are a helpful assistant that explains Python code.\n\n"
USER_HEAD = "\n\nUser: explain this code:\n"
USER_TAIL = "\nAssistant:"


@dataclass(frozen=True)
class Sizes:
    """How big each workload is (tokens are the model's tokens)."""

    docs: int = 6
    doc_tokens: int = 1500
    question_tokens: int = 16  # cut-out text inside the question
    docqa_out: int = 32
    docqa_concurrency: int = 4
    users: int = 4
    rounds: int = 3
    system_tokens: int = 300
    turn_tokens: int = 64  # cut-out text in each user turn
    chat_out: int = 32
    requests: int = 32
    prompt_min: int = 128
    prompt_max: int = 1024
    out_min: int = 16
    out_max: int = 128
    concurrency: int = 8
    single_requests: int = 4
    single_prompt: int = 512
    single_out: int = 128


QUICK = Sizes(
    docs=2,
    doc_tokens=400,
    docqa_out=16,
    users=2,
    rounds=2,
    system_tokens=120,
    turn_tokens=32,
    chat_out=16,
    requests=8,
    prompt_min=64,
    prompt_max=256,
    out_min=8,
    out_max=32,
    single_requests=2,
    single_prompt=256,
    single_out=32,
)


@dataclass(frozen=True)
class Req:
    """One completion request: `key` names it the same way on every server."""

    key: str
    prompt: list[int]
    max_tokens: int


@dataclass(frozen=True)
class Frame:
    """The fixed pieces of text, as token ids."""

    question_head: list[int]
    question_tail: list[int]
    system_head: list[int]
    user_head: list[int]
    user_tail: list[int]

    @classmethod
    def build(cls, encode: Callable[[str], list[int]]) -> Frame:
        return cls(
            encode(QUESTION_HEAD),
            encode(QUESTION_TAIL),
            encode(SYSTEM_HEAD),
            encode(USER_HEAD),
            encode(USER_TAIL),
        )


class TokenPool:
    """Real text as one token stream; `take` cuts the next piece (wrapping around, so
    pieces taken at different places never start alike)."""

    def __init__(self, ids: Sequence[int]) -> None:
        if not ids:
            raise ValueError("the token pool is empty")
        self.ids = list(ids)
        self.at = 0

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            piece = self.ids[self.at : self.at + n - len(out)]
            out += piece
            self.at = (self.at + len(piece)) % len(self.ids)
        return out


@dataclass
class ChatPlan:
    """The chat workload of one repeat: a shared system prompt and each user's turns
    (the history grows by each turn and the answer the server returned)."""

    system: list[int]
    turns: list[list[list[int]]]  # [user][round] -> the user turn's ids
    max_tokens: int


@dataclass
class RepeatRequests:
    """Every workload of one repeat (the same on every server)."""

    docqa_warm: list[Req]
    docqa_query: list[Req]
    chat: ChatPlan
    throughput: list[Req]
    single: list[Req]


def spread(lo: int, hi: int, count: int, i: int) -> int:
    """The i-th of `count` values spread evenly from lo to hi (inclusive)."""
    return lo if count <= 1 else lo + round((hi - lo) * i / (count - 1))


def docqa(pool: TokenPool, frame: Frame, s: Sizes, tag: str) -> tuple[list[Req], list[Req]]:
    """D fresh documents; the warm-up round asks each one question (cold prompts), the
    query round two more in tile order (doc0 q1, doc1 q1, ..., doc0 q2, ...), each a
    prefix hit on its document."""
    docs = [pool.take(s.doc_tokens) for _ in range(s.docs)]

    def ask(d: int, q: int) -> Req:
        question = frame.question_head + pool.take(s.question_tokens) + frame.question_tail
        return Req(f"{tag}/doc{d}/q{q}", docs[d] + question, s.docqa_out)

    warm = [ask(d, 0) for d in range(s.docs)]
    query = [ask(d, q) for q in (1, 2) for d in range(s.docs)]
    return warm, query


def chat(pool: TokenPool, frame: Frame, s: Sizes, system: list[int]) -> ChatPlan:
    turns = [
        [frame.user_head + pool.take(s.turn_tokens) + frame.user_tail for _ in range(s.rounds)]
        for _ in range(s.users)
    ]
    return ChatPlan(system, turns, s.chat_out)


def chat_request(plan: ChatPlan, user: int, rnd: int, history: list[int], tag: str) -> Req:
    """The request of a user's round: its history (system prompt, earlier turns and
    answers) followed by this round's turn."""
    return Req(f"{tag}/user{user}/round{rnd}", history + plan.turns[user][rnd], plan.max_tokens)


def throughput(pool: TokenPool, s: Sizes, tag: str) -> list[Req]:
    """Distinct prompts of mixed lengths (short to long) and mixed output lengths (the
    order interleaves them so long and short run together)."""
    out = []
    for i in range(s.requests):
        j = (i * 7) % s.requests if s.requests % 7 else i  # a fixed shuffle of the outputs
        n = spread(s.prompt_min, s.prompt_max, s.requests, i)
        out.append(Req(f"{tag}/req{i}", pool.take(n), spread(s.out_min, s.out_max, s.requests, j)))
    return out


def single(pool: TokenPool, s: Sizes, tag: str) -> list[Req]:
    return [
        Req(f"{tag}/req{i}", pool.take(s.single_prompt), s.single_out)
        for i in range(s.single_requests)
    ]


def plans(pool: TokenPool, frame: Frame, s: Sizes, repeats: int) -> list[RepeatRequests]:
    """One RepeatRequests per repeat, each of fresh text; the chat system prompt is shared by
    every repeat (as a deployment's would be)."""
    system = frame.system_head + pool.take(s.system_tokens)
    out = []
    for r in range(repeats):
        warm, query = docqa(pool, frame, s, f"r{r}/docqa")
        out.append(
            RepeatRequests(
                docqa_warm=warm,
                docqa_query=query,
                chat=chat(pool, frame, s, system),
                throughput=throughput(pool, s, f"r{r}/throughput"),
                single=single(pool, s, f"r{r}/single"),
            )
        )
    return out


def tokens_needed(s: Sizes, repeats: int) -> int:
    """Text (tokens) the plans of `repeats` repeats cut out, at most, plus a margin."""
    per_repeat = (
        s.docs * (s.doc_tokens + 3 * s.question_tokens)
        + s.users * s.rounds * s.turn_tokens
        + s.requests * s.prompt_max
        + s.single_requests * s.single_prompt
    )
    return s.system_tokens + repeats * per_repeat + 1024


def chat_bound(plan: ChatPlan, answer_slack: int = 8) -> int:
    """Tokens of the longest chat request at most (an answer re-tokenized from its text
    may come out a few tokens longer than generated)."""
    turns = max(sum(len(t) for t in user) for user in plan.turns)
    rounds = len(plan.turns[0]) if plan.turns else 0
    return len(plan.system) + turns + rounds * (plan.max_tokens + answer_slack)


def max_model_len(
    plans: Sequence[RepeatRequests], workloads: Sequence[str], limit: int | None
) -> int:
    """The longest prompt + output of the selected workloads, rounded up to 256 tokens
    (at most the model's positions)."""
    need = 1
    for p in plans:
        for w in workloads:
            if w == "chat":
                need = max(need, chat_bound(p.chat))
            else:
                for phase in PHASES[w]:
                    need = max(need, *(len(r.prompt) + r.max_tokens for r in getattr(p, phase)))
    need = -(-need // 256) * 256
    return min(need, limit) if limit else need


def working_set_tokens(plan: RepeatRequests, workloads: Sequence[str], s: Sizes) -> int:
    """Distinct tokens one repeat keeps reusing: docqa's (documents, questions, answers)
    when docqa runs, else the largest of the selected workloads'."""

    def tokens(w: str) -> int:
        if w == "docqa":
            asked = plan.docqa_warm + plan.docqa_query
            extra = sum(len(r.prompt) - s.doc_tokens + r.max_tokens for r in asked)
            return s.docs * s.doc_tokens + extra
        if w == "chat":
            c = plan.chat
            return len(c.system) + len(c.turns) * (chat_bound(c) - len(c.system))
        sizes = [len(r.prompt) + r.max_tokens for r in getattr(plan, w)]
        return sum(sizes) if w == "throughput" else max(sizes)

    return tokens("docqa") if "docqa" in workloads else max(tokens(w) for w in workloads)


def shrink(s: Sizes, **counts: int | None) -> Sizes:
    """Sizes with the given counts replaced (None: keep)."""
    return replace(s, **{k: v for k, v in counts.items() if v is not None})


def sizes_dict(s: Sizes) -> dict[str, int]:
    return asdict(s)


# -- metrics ------------------------------------------------------------------------------


def request_times(sent: float, chunk_times: Sequence[float], tokens: int) -> tuple[float, float]:
    """(TTFT, TPOT) of one streamed request: TTFT from sending to the first chunk with
    text; TPOT = (last - first) / (tokens - 1), the mean gap between generated tokens
    after the first (NaN with fewer than two tokens or no chunk)."""
    if not chunk_times:
        return float("nan"), float("nan")
    ttft = chunk_times[0] - sent
    if tokens < 2:
        return ttft, float("nan")
    return ttft, (chunk_times[-1] - chunk_times[0]) / (tokens - 1)


def summarize(records: Sequence[dict[str, Any]], wall_s: float) -> dict[str, Any]:
    """One round of one phase: wall time, output tokens/s, TTFT / TPOT p50 and p99
    (seconds), prefix-hit tokens (None when the server reported none), completion."""
    ok = [r for r in records if r.get("error") is None]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] == r["ttft_s"]]  # NaN-free
    tpot = [r["tpot_s"] for r in ok if r["tpot_s"] == r["tpot_s"]]
    out_tokens = sum(r["completion_tokens"] for r in ok)
    cached = [r["cached_tokens"] for r in ok]
    return {
        "wall_s": wall_s,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "complete": sum(r["completion_tokens"] == r["max_tokens"] for r in ok),
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else float("nan"),
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "cached_tokens": None if not cached or None in cached else sum(cached),
        "ttft_p50_s": percentile(ttft, 0.5),
        "ttft_p99_s": percentile(ttft, 0.99),
        "tpot_p50_s": percentile(tpot, 0.5),
        "tpot_p99_s": percentile(tpot, 0.99),
    }


MEDIAN_FIELDS = (
    "wall_s",
    "output_tokens_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "tpot_p99_s",
)


def median_over_repeats(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians of the timing fields over repeats; counts summed."""
    out: dict[str, Any] = {}
    for key in MEDIAN_FIELDS:
        values = [r[key] for r in rounds if r[key] == r[key]]
        out[key] = statistics.median(values) if values else float("nan")
    for key in ("requests", "errors", "complete", "output_tokens", "prompt_tokens"):
        out[key] = sum(r[key] for r in rounds)
    cached = [r["cached_tokens"] for r in rounds]
    out["cached_tokens"] = None if not cached or None in cached else sum(cached)
    out["repeats"] = len(rounds)
    return out


# (summary field, label, lower is better): the rows of the ratio table
RATIO_ROWS = (
    ("wall_s", "wall s", True),
    ("ttft_p50_s", "TTFT p50", True),
    ("tpot_p50_s", "TPOT p50", True),
    ("output_tokens_per_s", "output tok/s", False),
)


def ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else float("nan")


def compare(rounds: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    """Per variant and phase (rounds[variant][phase] = one result per repeat): medians,
    and against the reference (vllm when it ran, else the first variant) the ratios of
    RATIO_ROWS and the agreement of the greedy outputs."""
    ref = "vllm" if "vllm" in rounds else next(iter(rounds))
    out: dict[str, Any] = {"reference": ref, "variants": {}}
    for variant, phases in rounds.items():
        rows = {}
        for phase, results in phases.items():
            row = median_over_repeats(results)
            ref_row = median_over_repeats(rounds[ref][phase])
            same = agreement(_texts(results), _texts(rounds[ref][phase]))
            row["agreement"] = None if variant == ref else same
            row["ratios"] = (
                None
                if variant == ref
                else {key: ratio(row[key], ref_row[key]) for key, _, _ in RATIO_ROWS}
            )
            rows[phase] = row
        out["variants"][variant] = rows
    return out


def _texts(results: Sequence[dict[str, Any]]) -> dict[str, str]:
    return {rec["key"]: rec["text"] for res in results for rec in res["records"]}


def failures(report: dict[str, Any]) -> int:
    """Requests that failed or came back with fewer tokens than asked, over the run."""
    bad = 0
    for result in report["sizes"].values():
        for phases in result["summary"]["variants"].values():
            bad += sum(r["errors"] + r["requests"] - r["complete"] for r in phases.values())
    return bad


def common_prefix(a: str, b: str) -> float:
    """The share of the longer text that both start with (1.0 for two empty texts)."""
    longest = max(len(a), len(b))
    if not longest:
        return 1.0
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n / longest


def agreement(mine: dict[str, str], theirs: dict[str, str]) -> dict[str, Any] | None:
    """Greedy outputs of two servers on the requests both answered: the fraction whose
    text is identical and the mean common-prefix fraction (None: nothing in common)."""
    keys = sorted(set(mine) & set(theirs))
    if not keys:
        return None
    return {
        "requests": len(keys),
        "identical": sum(mine[k] == theirs[k] for k in keys) / len(keys),
        "prefix": sum(common_prefix(mine[k], theirs[k]) for k in keys) / len(keys),
    }
