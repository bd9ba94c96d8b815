"""What one request may ask of the server (`ServeLimits`), by default from its budgets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstrata.core.errors import ConfigError

# A body holds at most a few prompts of max_model_len tokens: 8 MiB is a 131k-token
# prompt as token ids ("123456, " each) or a 650k-character string, ten times what a
# 8k-position model takes in one prompt.
DEFAULT_MAX_BODY_BYTES = 8 * 2**20


@dataclass(frozen=True)
class ServeLimits:
    """Limits of one request."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # a 413 past it, before it is read
    # (prompt + max_tokens) x n over every prompt, at most (a 400 with the numbers past
    # it); None: the engine's max_num_seqs x max_model_len (what it runs at once)
    max_request_tokens: int | None = None
    # a special token's text in chat content (and, for a chat model, in a completion
    # prompt string) is that token; False: it is plain text, so no client forges a turn
    trust_special_tokens: bool = False
    # an unknown request field is a 400 (True) or ignored, named in the response's
    # X-Kvstrata-Ignored-Fields header and logged once per name (False: vLLM's way)
    strict_fields: bool = False

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_request_tokens"):
            value = getattr(self, name)
            whole = isinstance(value, int) and not isinstance(value, bool) and value >= 1
            if not whole and (value is not None or name == "max_body_bytes"):
                raise ConfigError.field(name, value, "a whole number >= 1")
        for name in ("trust_special_tokens", "strict_fields"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError.field(name, getattr(self, name), "a bool")

    def request_tokens(self, engine: Any) -> int:
        """The work ceiling over `engine` (max_request_tokens, or its default)."""
        if self.max_request_tokens is not None:
            return self.max_request_tokens
        # a model without a position limit: what all tiers hold
        positions = engine.max_model_len or engine.sched.capacity_blocks * engine.sched.block_size
        return max(1, engine.config.max_num_seqs * positions)


def longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest token as the vocabulary spells it (at least what it
    decodes to: one character per byte or more); 0 without a vocabulary."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return 0
    try:
        vocab = get_vocab()
    except Exception:  # noqa: BLE001 - no vocabulary to read: no bound
        return 0
    return max((len(token) for token in vocab), default=0)
