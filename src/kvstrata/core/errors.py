"""Typed errors. Every message a user can act on names the field, the value and the fix."""

from __future__ import annotations


class KvstrataError(Exception):
    """Base class of every error kvstrata raises on purpose."""


class ConfigError(KvstrataError, ValueError):
    """Bad user input: a config field, a CLI flag, a preset name, a model directory."""

    @classmethod
    def field(cls, field: str, value: object, accepted: str) -> ConfigError:
        """Build the one-line message `<field>=<value!r> is invalid: <accepted>` (a long
        or multi-line repr, e.g. of a tensor, is collapsed and shortened)."""
        return cls(f"{field}={_short_repr(value)} is invalid: {accepted}")

    @classmethod
    def unknown(cls, field: str, value: object, known: list[str] | tuple[str, ...]) -> ConfigError:
        """An unknown field (a misspelled keyword or dict key): names it, suggests the
        closest known names (difflib) and lists the known ones, on one line."""
        import difflib

        close = difflib.get_close_matches(field, known, n=1, cutoff=0.6)
        guess = f"did you mean {close[0]!r}? " if close else ""
        return cls.field(field, value, f"unknown field; {guess}known: {', '.join(sorted(known))}")


def _short_repr(value: object, limit: int = 240) -> str:
    """repr(value) on one line, at most `limit` characters."""
    text = repr(value)
    if "\n" in text or len(text) > limit:
        text = " ".join(text.split())
        if len(text) > limit:
            text = text[: limit - 3] + "..."
    return text


class OutOfBlocksError(KvstrataError, MemoryError):
    """Every tier is full: states bytes needed vs available and which budget to raise."""


class CodecError(KvstrataError, ValueError):
    """A codec cannot encode this input (NaN/inf, bad shape, bad group size)."""


class TierIOError(KvstrataError, OSError):
    """A tier could not read or write a block. The caller recomputes the block.

    `seq_ids`: the sequences whose blocks could not be read, where the reader knew
    them (attention names the sequence it was reading for); empty when unknown."""

    seq_ids: frozenset[int] = frozenset()


class BlockCorruptError(TierIOError):
    """A stored block failed its checksum or its token ids do not match."""


class BlockMissingError(TierIOError):
    """A block the index names is not there (missing or truncated file)."""


class TierFullError(TierIOError):
    """The medium behind a tier ran out of space (e.g. ENOSPC on disk)."""


class UnsupportedModelError(KvstrataError, ValueError):
    """A model kvstrata cannot serve exactly (names the model type and what is missing)."""


class MissingExtraError(KvstrataError, ImportError):
    """An optional dependency is not installed; the message names the extra to install."""
