"""Passkey retrieval ("needle in a haystack") through a KV cache.

A random 5-digit passkey is planted at a given depth of a haystack of real text (Python's
language reference, as ``pydoc_data`` ships it), and the model is asked for it at the end
(Mohtashami & Jaggi's passkey task, with real text instead of a repeated filler). With a
tiered cache the passkey's K/V are usually offloaded and encoded (int8, fp8, int4), so a
lossy codec that blurs them shows up as a wrong answer. The answer is decoded greedily
after "The secret number is" and scored by exact match of its first number::

    cases = needle_cases(tokenizer, lengths=[1024, 4096], depths=[0.1, 0.5, 0.9], trials=1)
    report = needle_sweep(model, cases, {"int8": lambda n: dict(host_codec="int8", ...)})
    report.accuracy("int8", 4096)

Pure functions: no printing; progress goes through an optional callback.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvstrata.core.errors import ConfigError
from kvstrata.quality.agreement import greedy_tokens
from kvstrata.quality.evaluate import (
    EXACT,
    REFERENCE_ATTENTION,
    Progress,
    exact_cache_factory,
    tiered_cache_factory,
)
from kvstrata.workload.prompts import encode_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# The passkey task's wording, with "secret number" for "pass key": in a haystack of
# Python's documentation, SmolLM2-135M read "pass key" as Python's `pass` statement and
# answered with its definition, even at 2k tokens, where it finds a "secret number".
INSTRUCTION = (
    "There is a secret number hidden inside a lot of irrelevant text. Find it and remember "
    "it: I will ask you for it at the end."
)
NEEDLE = "The secret number is {key}. Remember it. {key} is the secret number."
QUESTION = "What is the secret number?"
ANSWER_PREFIX = "The secret number is"
ANSWER_TOKENS = 8  # " 12345." and an end take at most this many new tokens
# Trials start their haystack this many characters apart, so they read different text.
TRIAL_STRIDE_CHARS = 40_000


def haystack_text() -> str:
    """Real English text that ships with Python: the language reference of pydoc_data
    (every topic, in sorted order; about 750 kB on 3.11)."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:
        raise ConfigError(
            "the needle haystack needs pydoc_data (Python's own documentation), which this "
            "Python does not ship"
        ) from exc
    return "\n\n".join(topics[name].strip() for name in sorted(topics))


@dataclass
class NeedleCase:
    """One prompt: a haystack of `length` tokens with the passkey at `depth`.

    Fields:
        length: nominal context in tokens (prompt + answer fit in it).
        depth: where the needle starts, as a fraction of the haystack.
        trial: the trial number (its own passkey and stretch of text).
        key: the passkey.
        prompt_ids: the prompt's token ids (ending with the answer prefix).
        needle_position: token index where the needle starts.
    """

    length: int
    depth: float
    trial: int
    key: str
    prompt_ids: list[int]
    needle_position: int


def _prompt_ids(tokenizer: Any, body: str, chat: bool) -> list[int]:
    """The whole prompt for one haystack text `body` (needle already in it)."""
    user = f"{INSTRUCTION}\n\n{body}\n\n{QUESTION}"
    ids = encode_prompt(tokenizer, user, chat)[0].tolist()
    sep = "" if chat else " "
    answer = tokenizer(sep + ANSWER_PREFIX, add_special_tokens=False).input_ids
    return ids + list(answer)


def needle_case(
    tokenizer: Any,
    text: str,
    length: int,
    depth: float,
    key: str,
    *,
    trial: int = 0,
    chat: bool = True,
    max_new: int = ANSWER_TOKENS,
) -> NeedleCase:
    """Build one prompt of at most `length - max_new` tokens from the start of `text`.

    The haystack is cut to fit, the needle goes in at `depth` of it on a line of its own
    (moved back to the start of the line or sentence it falls in when that is within 2 %
    of the haystack), and the prompt ends with the answer prefix.
    """
    if not 0.0 <= depth <= 1.0:
        raise ConfigError.field("depth", depth, "a fraction of the haystack in [0, 1]")
    needle = NEEDLE.format(key=key)
    budget = length - max_new
    overhead = len(_prompt_ids(tokenizer, f"\n{needle}\n", chat))
    room = budget - overhead
    if room < 16:
        raise ConfigError.field(
            "length", length, f"at least {overhead + max_new + 16} tokens for the prompt"
        )
    # The haystack's tokens, cut to the room left; re-tokenizing the joined text may add a
    # token or two at the seams, so shrink until the whole prompt fits.
    hay_ids = tokenizer(text[: room * 8], add_special_tokens=False, verbose=False).input_ids
    if len(hay_ids) < room:
        raise ConfigError.field(
            "length", length, f"at most the haystack's {len(hay_ids) + overhead} tokens"
        )
    for slack in (0, 4, 8, 16, 32, 64):
        body = tokenizer.decode(hay_ids[: room - slack])
        at = int(depth * len(body))
        # at the start of the line (else the sentence) it falls in, when that is near
        near = max(1, min(200, len(body) // 50))
        line = body.rfind("\n", 0, at)
        sentence = body.rfind(". ", 0, at)
        if line >= 0 and at - line <= near:
            at = line + 1
        elif sentence >= 0 and at - sentence <= near:
            at = sentence + 2
        ids = _prompt_ids(tokenizer, f"{body[:at]}\n{needle}\n{body[at:]}", chat)
        if len(ids) <= budget:
            break
    else:  # pragma: no cover - the seams never cost 64 tokens
        raise ConfigError.field("length", length, "the prompt does not fit")
    return NeedleCase(length, depth, trial, key, ids, _first_mention(tokenizer, ids, key))


def _first_mention(tokenizer: Any, ids: list[int], key: str) -> int:
    """Index of the token that completes the first mention of `key` in the prompt."""
    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if key in tokenizer.decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo - 1


def passkeys(count: int, seed: int = 0) -> list[str]:
    """`count` random 5-digit passkeys (seeded)."""
    rng = random.Random(seed)
    return [str(rng.randrange(10_000, 100_000)) for _ in range(count)]


def answer_of(text: str) -> str | None:
    """The first number in a generated answer (None when there is none)."""
    found = re.search(r"\d+", text)
    return found.group(0) if found else None


def needle_cases(
    tokenizer: Any,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int = 1,
    *,
    seed: int = 0,
    chat: bool = True,
    text: str | None = None,
) -> list[NeedleCase]:
    """The prompts of a sweep: every length x depth x trial (trial t starts
    t * TRIAL_STRIDE_CHARS characters into the haystack; every case has its own passkey).

    Args:
        tokenizer: The model's tokenizer.
        lengths: Context lengths in tokens.
        depths: Needle depths, fractions in [0, 1].
        trials: Passkeys per (length, depth).
        seed: Seeds the passkeys.
        chat: Ask through the chat template.
        text: The haystack (default :func:`haystack_text`).

    Returns:
        The cases, length-major.
    """
    if trials < 1:
        raise ConfigError.field("trials", trials, "at least 1")
    text = haystack_text() if text is None else text
    keys = passkeys(trials * len(lengths) * len(depths), seed)
    cases: list[NeedleCase] = []
    for length in lengths:
        for depth in depths:
            for trial in range(trials):
                start = (trial * TRIAL_STRIDE_CHARS) % max(1, len(text) // 2)
                key = keys[len(cases)]
                cases.append(
                    needle_case(tokenizer, text[start:], length, depth, key, trial=trial, chat=chat)
                )
    return cases


ConfigFactory = Callable[[int], dict[str, Any]]
"""CacheConfig fields for a context of the given length (budgets scale with it)."""


@dataclass
class NeedleReport:
    """Per configuration (the exact reference first), the answer to every case."""

    cases: list[NeedleCase]
    answers: dict[str, list[str]] = field(default_factory=dict)  # decoded answer texts

    def correct(self, name: str) -> list[bool]:
        """Per case, whether the configuration's answer is the passkey."""
        return [answer_of(a) == c.key for a, c in zip(self.answers[name], self.cases, strict=True)]

    def accuracy(self, name: str, length: int | None = None) -> float:
        """Exact-match accuracy of a configuration (at one length, or over all)."""
        hits = [
            ok
            for ok, c in zip(self.correct(name), self.cases, strict=True)
            if length is None or c.length == length
        ]
        return sum(hits) / len(hits) if hits else float("nan")

    def to_dict(self) -> dict[str, Any]:
        """JSON form: every case with every answer, and the accuracies."""
        lengths = sorted({c.length for c in self.cases})
        return {
            "cases": [
                {
                    "length": c.length,
                    "depth": c.depth,
                    "trial": c.trial,
                    "key": c.key,
                    "prompt_tokens": len(c.prompt_ids),
                    "needle_position": c.needle_position,
                    "answers": {n: a[i] for n, a in self.answers.items()},
                }
                for i, c in enumerate(self.cases)
            ],
            "accuracy": {
                name: {
                    "all": self.accuracy(name),
                    **{str(n): self.accuracy(name, n) for n in lengths},
                }
                for name in self.answers
            },
        }


def needle_sweep(
    model: PreTrainedModel,
    tokenizer: Any,
    cases: Sequence[NeedleCase],
    configs: dict[str, ConfigFactory],
    *,
    max_new: int = ANSWER_TOKENS,
    progress: Progress | None = None,
) -> NeedleReport:
    """Answer every case with the exact cache and with every configuration.

    Args:
        model: A causal LM.
        tokenizer: Its tokenizer (decodes the answers).
        cases: From :func:`needle_cases`.
        configs: name -> a function of the case's length giving CacheConfig fields.
        max_new: Answer tokens at most (a run also stops once a number is followed by
            something else).
        progress: Called with 1 after each run (cases x (1 + configs) in all).

    Returns:
        A :class:`NeedleReport`.
    """
    if EXACT in configs:
        raise ConfigError.field("config", EXACT, f"{EXACT!r} is the reference's name")
    report = NeedleReport(list(cases), {EXACT: [], **{name: [] for name in configs}})
    stop_ids = [t for t in (tokenizer.eos_token_id,) if t is not None]

    def answered(tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        return re.search(r"\d+\D", text) is not None

    for case in cases:  # case-major: an interrupted sweep still compares like with like
        factories = {EXACT: exact_cache_factory(model)}
        for name, make in configs.items():
            factories[name] = tiered_cache_factory(model, **make(case.length))
        for name, factory in factories.items():
            cache = factory(len(case.prompt_ids) + max_new)
            try:
                tokens = greedy_tokens(
                    model, case.prompt_ids, cache, max_new, stop_ids=stop_ids, stop=answered
                )
            finally:
                if hasattr(cache, "close"):
                    cache.close()
            report.answers[name].append(tokenizer.decode(tokens, skip_special_tokens=True))
            if progress is not None:
                progress(1)
    model.set_attn_implementation(REFERENCE_ATTENTION)
    return report
