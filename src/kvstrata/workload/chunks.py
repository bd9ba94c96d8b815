"""A prompt made of segments, some of them documents whose KV is reused wherever they sit.

    chunks = Chunks.of(prompt_text, documents=[doc_a, doc_b])   # documents found in it
    chunks = Chunks.split("sys<doc>A<doc>B<doc>Q", "<doc>")     # a separator you name
    ids, spans = chunks.encode(tokenizer)

Each segment is tokenized on its own, so a document has the same token ids in every
prompt it appears in (tokenizing the whole text would let a document's first and last
tokens merge with their neighbours differently each time). The first segment takes the
tokenizer's special tokens (a BOS), the others none. `spans` are the documents' [start,
end) token ranges in `ids`; the engine (`Engine.submit`) and `blend_prompt` for a
`TieredCache` reuse their KV (integrations/hf/blend_store.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.core.errors import ConfigError

Segment = str | tuple[int, ...]


@dataclass(frozen=True)
class Chunks:
    """The prompt's segments in order (text, or token ids as a tuple) and the indices
    of those that are documents."""

    segments: tuple[Segment, ...]
    documents: frozenset[int]

    def __post_init__(self) -> None:
        segs = tuple(s if isinstance(s, str) else tuple(s) for s in self.segments)
        object.__setattr__(self, "segments", segs)
        object.__setattr__(self, "documents", frozenset(self.documents))
        for s in segs:
            if not isinstance(s, str) and not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in s
            ):
                raise ConfigError.field("segments", s, "text or a list of token ids")
        if not self.documents:
            raise ConfigError.field("documents", [], "at least one document segment")
        bad = [i for i in self.documents if not 0 <= i < len(segs)]
        if bad:
            raise ConfigError.field("documents", bad[0], f"a segment index below {len(segs)}")
        if max(self.documents) == len(segs) - 1:
            raise ConfigError.field(
                "documents",
                max(self.documents),
                "a prompt that goes on after its last document (the question)",
            )
        if any(len(segs[i]) == 0 for i in self.documents):
            raise ConfigError.field("documents", "an empty document", "non-empty documents")

    @classmethod
    def of(cls, prompt: str, documents: Sequence[str]) -> Chunks:
        """The prompt text with each document found in it, in order, verbatim."""
        if not isinstance(prompt, str):
            raise ConfigError.field("prompt", type(prompt).__name__, "text holding the documents")
        if isinstance(documents, str) or not documents:
            raise ConfigError.field("documents", documents, "a list of document texts")
        segments: list[Segment] = []
        index: list[int] = []
        pos = 0
        for i, doc in enumerate(documents):
            if not isinstance(doc, str) or not doc:
                raise ConfigError.field(f"documents[{i}]", doc, "a non-empty text")
            at = prompt.find(doc, pos)
            if at < 0:
                shown = doc if len(doc) <= 40 else doc[:37] + "..."
                raise ConfigError.field(
                    f"documents[{i}]",
                    shown,
                    "text that appears verbatim in the prompt, after the documents before it",
                )
            segments.append(prompt[pos:at])
            index.append(len(segments))
            segments.append(doc)
            pos = at + len(doc)
        segments.append(prompt[pos:])
        return cls(tuple(segments), frozenset(index))

    @classmethod
    def of_ids(cls, ids: Sequence[int], spans: Sequence[tuple[int, int]]) -> Chunks:
        """Token ids with the documents' [start, end) spans (in order, apart)."""
        segments: list[Segment] = []
        index: list[int] = []
        pos = 0
        for i, (s, e) in enumerate(spans):
            if not pos <= s < e <= len(ids):
                raise ConfigError.field(
                    f"spans[{i}]", (s, e), f"ordered, non-empty ranges within {len(ids)} tokens"
                )
            segments.append(tuple(ids[pos:s]))
            index.append(len(segments))
            segments.append(tuple(ids[s:e]))
            pos = e
        segments.append(tuple(ids[pos:]))
        return cls(tuple(segments), frozenset(index))

    @classmethod
    def split(cls, prompt: str, separator: str) -> Chunks:
        """The text split at `separator` (which is dropped): the first piece comes
        before the documents, the last after them, every piece between is one."""
        if not isinstance(separator, str) or not separator:
            raise ConfigError.field("separator", separator, "a non-empty marker string")
        pieces = prompt.split(separator)
        if len(pieces) < 3:
            raise ConfigError.field(
                "separator",
                separator,
                f"a marker found at least twice in the prompt (found {len(pieces) - 1}): "
                "text, documents between markers, the question",
            )
        return cls(tuple(pieces), frozenset(range(1, len(pieces) - 1)))

    def encode(self, tokenizer: Any) -> tuple[list[int], list[tuple[int, int]]]:
        """(prompt token ids, the documents' [start, end) spans), each segment
        tokenized on its own (see the module docstring)."""
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        for i, seg in enumerate(self.segments):
            if isinstance(seg, str):
                if tokenizer is None:
                    raise ConfigError.field("prompt", "text chunks", "token ids (no tokenizer)")
                toks = list(tokenizer(seg, add_special_tokens=i == 0)["input_ids"]) if seg else []
            else:
                toks = list(seg)
            if i in self.documents:
                spans.append((len(ids), len(ids) + len(toks)))
            ids += toks
        return ids, spans


def find_documents(ids: list[int], documents: list[list[int]]) -> Chunks:
    """The prompt `ids` as Chunks whose documents are where each document's own token
    ids (tokenized alone) appear in it, in order. Where a document's first or last
    token merged with its neighbour in the prompt's tokenization, its inner tokens are
    the document (the same tokens in every prompt). ConfigError naming the document
    when it is not there."""
    segments: list[Segment] = []
    index: list[int] = []
    pos = 0
    for i, doc in enumerate(documents):
        at, found = -1, doc
        for cand in (doc, doc[1:], doc[:-1], doc[1:-1]):
            if cand:
                at = _find(ids, cand, pos)
                if at >= 0:
                    found = cand
                    break
        if at < 0:
            raise ConfigError.field(
                f"documents[{i}]",
                f"<{len(doc)} tokens>",
                "text that appears verbatim in the prompt, after the documents before it",
            )
        segments.append(tuple(ids[pos:at]))
        index.append(len(segments))
        segments.append(tuple(found))
        pos = at + len(found)
    segments.append(tuple(ids[pos:]))
    return Chunks(tuple(segments), frozenset(index))


def _find(ids: list[int], part: list[int], start: int) -> int:
    """The first index >= start where `part` occurs in `ids`, else -1."""
    first, n = part[0], len(part)
    at = start
    while True:
        try:
            at = ids.index(first, at)
        except ValueError:
            return -1
        if ids[at : at + n] == part:
            return at
        at += 1
