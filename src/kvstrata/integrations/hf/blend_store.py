"""A prompt's documents blended through the store: each document's K/V found by its own
content hash wherever it sits in the prompt, moved to its new position, the tokens the
question reads most recomputed (`hf.blend`), the result written to the prompt's sequence.

A document's K/V are those it gets right after the prompt's *head* — the tokens before
its first document (a system prompt, an instruction) — at positions len(head) ..: the
store keeps them as the cached blocks of the sequence "head + document", so the prefix
index finds them (on any tier, with the codecs, salt and checks of any cached block)
and a prompt that starts with that document reuses them exactly. A document not found
is computed once that way and kept for the next prompt. The head acts as the attention
sink every document was computed with, and is the same in the prompts that reuse it.

What is written to the prompt's sequence: the head's tokens not in the store yet (exact,
hashed like any prefix), then the blended tokens up to the last prompt token, which are
*not* hashed: they are an approximation and must never be found as a cached prefix. The
last prompt token is left to the caller's own forward (its logits choose the first
output token), so the continuation runs exactly as after a prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.attention.writes import write_layer, write_plan
from kvstrata.core.blending import BLEND_RECOMPUTE, check_recompute
from kvstrata.core.errors import ConfigError, KvstrataError, UnsupportedModelError
from kvstrata.integrations.hf.blend import SINK_TOKENS, Blender, Reuse
from kvstrata.integrations.hf.cache import TieredCache
from kvstrata.store.kvstore import KVStore


@dataclass
class BlendResult:
    """What one prompt's blend did: tokens now in the sequence, prompt tokens whose K/V
    were reused (moved, not recomputed), tokens computed, documents found / computed."""

    computed: int
    reused: int = 0
    recomputed: int = 0
    found: int = 0
    missed: int = 0
    error: str | None = None  # why it stopped early (the sequence holds `computed`)


class PromptBlender:
    """Blends prompts into sequences of one store (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, store: KVStore) -> None:
        self.blender = Blender(model)
        self.store = store
        if len(store.layer_map) != len(self.blender.layers):
            raise UnsupportedModelError(
                f"model_type={self.blender.model_type!r}: {len(store.layer_map)} layers "
                f"cache K/V but {len(self.blender.layers)} attend: blending needs one K/V "
                "per layer; send the prompt without documents"
            )

    def blend(
        self,
        seq_id: int,
        prompt: list[int],
        spans: list[tuple[int, int]],
        recompute: float,
        salt: str = "",
    ) -> BlendResult:
        """Fill `seq_id` (holding an exact prefix of `prompt`) up to the last prompt
        token. `spans`: the documents, [start, end) token ranges in order. A failure of
        the store (out of blocks, a block that cannot be read) stops it with the
        sequence holding only exact K/V (`error` says why): the caller computes the rest."""
        try:
            return self._blend(seq_id, prompt, spans, recompute, salt)
        except (KvstrataError, OSError) as err:
            return BlendResult(self.store.num_tokens(seq_id), error=str(err))

    def _blend(
        self,
        seq_id: int,
        prompt: list[int],
        spans: list[tuple[int, int]],
        recompute: float,
        salt: str,
    ) -> BlendResult:
        store, bl = self.store, self.blender
        end = len(prompt) - 1
        have = store.num_tokens(seq_id)
        if not spans:
            return BlendResult(have)
        if not store.prefix_caching:  # no document could be kept or found: an exact prefill
            return BlendResult(have, error="prefix caching is off: documents cannot be kept")
        head_end = spans[0][0]  # the head: the tokens before the first document
        start = max(have, head_end)  # blended from here: what the store holds is exact
        docs = [(s, min(e, end)) for s, e in spans if min(e, end) > start]
        if not docs:
            return BlendResult(have)
        bl.check_window(len(prompt))
        pk, pv = read_kv(store, seq_id, 0, have, bl.device)
        if have < head_end:  # the head's rest: exact, and hashed like any prefix
            part = bl.blend(prompt[have:head_end], have, pk, pv)
            write_kv(store, seq_id, part.k, part.v, prompt[have:head_end])
            pk, pv = _cat(pk, part.k), _cat(pv, part.v)
        result = BlendResult(end)
        total = end - start
        layers, heads, _, dk = pk.shape
        rk = pk.new_zeros((layers, heads, total, dk))
        rv = pv.new_zeros((layers, heads, total, pv.shape[-1]))
        found = torch.zeros(total, dtype=torch.bool, device=pk.device)
        sink = torch.zeros_like(found)
        head = prompt[:head_end]
        hk, hv = pk[:, :, :head_end], pv[:, :, :head_end]
        for s, e in docs:
            k, v, hit = self._document(head, prompt[s:e], hk, hv, salt)
            result.found += hit
            result.missed += not hit
            # the document's tokens [s, s + m) at prompt positions, those from `start` on
            lo, hi = max(s, start), min(s + k.shape[2], e)
            if hi <= lo:
                continue
            moved = bl.move_keys(k[:, :, lo - s : hi - s], s - head_end)
            rk[:, :, lo - start : hi - start] = moved
            rv[:, :, lo - start : hi - start] = v[:, :, lo - s : hi - s]
            found[lo - start : hi - start] = True
            sink[max(s, start) - start : max(min(s + SINK_TOKENS, e), start) - start] = True
        reuse = Reuse(rk, rv, found, sink)
        out = bl.blend(prompt[start:end], start, pk, pv, reuse, recompute)
        write_kv(store, seq_id, out.k, out.v, None)  # approximate: never hashed
        result.reused = int((found & ~out.recomputed).sum())
        result.recomputed = total - result.reused
        return result

    def _document(
        self, head: list[int], doc: list[int], pk: torch.Tensor, pv: torch.Tensor, salt: str
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """A document's K/V after `head` ([L, Hkv, m, D] at positions len(head) ..):
        the cached blocks of "head + doc" when there are some past the head, else
        computed now and kept in the store (whether it was found)."""
        store, h = self.store, len(head)
        seq_id, matched = store.add_sequence(head + doc, salt=salt)
        try:
            if matched > h:
                k, v = read_kv(store, seq_id, h, matched, self.blender.device)
                return k, v, True
            part = self.blender.blend(doc, h, pk, pv)
            # the sequence holds `matched` tokens of the head: the rest of it, then the doc
            k = _cat(pk[:, :, matched:h], part.k)
            v = _cat(pv[:, :, matched:h], part.v)
            write_kv(store, seq_id, k, v, (head + doc)[matched:])
            return part.k, part.v, False
        finally:
            store.free(seq_id)


def _cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat((a, b.to(a.dtype)), dim=2)


def read_kv(
    store: KVStore, seq_id: int, start: int, end: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [start, end) of a sequence's K/V, every layer ([L, Hkv, T, D]), decoded
    from wherever its blocks are (any tier; a bad block raises TierIOError)."""
    layout, bs = store.layout, store.layout.block_size
    layers = len(store.layer_map)
    dtype = store.layout.dtype
    k = torch.zeros((layers, layout.num_kv_heads, end - start, layout.head_dim), dtype=dtype)
    v = torch.zeros((layers, layout.num_kv_heads, end - start, layout.dim_v), dtype=dtype)
    tiers = store.tiers
    for group in store.groups:
        ids = list(group.layers)
        for run in store.runs(seq_id, group.index):
            lo, hi = max(start, run.token_start), min(end, run.token_start + run.num_tokens)
            if lo >= hi:
                continue
            first = (lo - run.token_start) // bs
            last = (hi - 1 - run.token_start) // bs + 1
            slots = list(range(run.first_slot + first, run.first_slot + last))
            tier = tiers[run.tier]
            shape = (len(ids), layout.num_kv_heads, len(slots) * bs)
            kb = torch.empty(
                (*shape, layout.head_dim), dtype=dtype, device=getattr(tier, "device", "cpu")
            )
            vb = torch.empty(
                (*shape, layout.dim_v), dtype=dtype, device=getattr(tier, "device", "cpu")
            )
            tier.read_blocks(slots, kb, vb)
            off = run.token_start + first * bs
            k[ids, :, lo - start : hi - start] = kb[:, :, lo - off : hi - off].cpu()
            v[ids, :, lo - start : hi - start] = vb[:, :, lo - off : hi - off].cpu()
    return k.to(device), v.to(device)


def write_kv(
    store: KVStore, seq_id: int, k: torch.Tensor, v: torch.Tensor, token_ids: list[int] | None
) -> None:
    """Append K/V ([L, Hkv, T, D]) of T tokens to a sequence as one step of its own.
    `token_ids` None: the tokens are unknown to the prefix index (never hashed; the
    sequence is not hashed past them either)."""
    n = k.shape[2]
    if n == 0:
        return
    dtype = store.layout.dtype
    writes = store.extend([seq_id], [n], None if token_ids is None else [list(token_ids)])
    try:
        plans = [write_plan(store.runtime, w, 1) for w in writes]
        for layer, (group, local) in enumerate(store.layer_map):
            dev = store.runtime.device
            write_layer(
                plans[group], local, k[layer][None].to(dev, dtype), v[layer][None].to(dev, dtype)
            )
        store.step_done([seq_id])
    except BaseException:
        store.abort_step([seq_id])
        raise


def blend_prompt(
    model: torch.nn.Module,
    cache: TieredCache,
    prompt: tuple[list[int], list[tuple[int, int]]],
    recompute: float = BLEND_RECOMPUTE,
) -> torch.Tensor:
    """Fill a one-row `cache` with a prompt's K/V up to its last token, its documents
    reused (see the module docstring); returns the prompt's ids [1, N] for `generate`,
    which computes the last token and goes on as after a prefill.

    Args:
        model: the causal LM (a Llama-family decoder, `kvstrata.enable`d to generate).
        cache: a fresh TieredCache, or one made with `prompt_ids` of this prompt (its
            cached prefix is kept); give it a shared `store=` to keep the documents
            for the next prompts.
        prompt: (ids, document spans), e.g. `Chunks.encode(tokenizer)`.
        recompute: the share of reused tokens recomputed in context (0 to 1).
    """
    ids, spans = prompt
    recompute = check_recompute(recompute, "recompute")
    store = cache.store
    weights = next(model.parameters())
    if not store.is_built:
        store.build(weights.dtype, num_sequences=1, native=cache.native_attention)
    if not cache.seq_ids:
        cache.seq_ids.append(store.add_sequence(ids, salt=cache.salt)[0])
    if len(cache.seq_ids) != 1:
        raise ConfigError.field("cache", f"{len(cache.seq_ids)} rows", "a cache of one row")
    seq_id = cache.seq_ids[0]
    held = store.num_tokens(seq_id)
    if held >= len(ids):
        raise ConfigError.field("cache", f"{held} tokens", "a cache holding less than the prompt")
    res = PromptBlender(model, store).blend(seq_id, list(ids), list(spans), recompute, cache.salt)
    rows = torch.tensor([list(ids)], device=weights.device)
    cache._rest_of_prompt = rows[:, res.computed :]  # what generate's first forward feeds
    cache.blend_result = res
    return rows
