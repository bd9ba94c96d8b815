"""Key selection's summaries shared along a common prefix (attention/selection/sharing.py):
a prefix hit starts from the summaries of the sequence whose blocks it reuses instead
of reading the prompt's keys back from the tiers, with the same tokens as without;
only a sequence of the same layer group, over blocks of equal content hashes, donates;
a cut drops the hashes past it; the RETAINED last finished sequences are kept."""

from __future__ import annotations

import pytest
import torch

from hf_models import tiny_model
from kvstrata.attention.selection.selector import KeySelector, _Summaries
from kvstrata.attention.selection.sharing import (
    RETAINED,
    BlockHashes,
    best_donor,
    common,
    copy_prefix,
    table_hashes,
)
from kvstrata.blocks.table import BlockTable


def _engine(share: bool, coarse: int = 0):
    from kvstrata.engine import Engine, EngineConfig

    engine = Engine(
        tiny_model("llama", initializer_range=0.3),
        block_size=16, device_budget="64KiB", host_budget="8MiB", attention_budget=96,
        attention_coarse=coarse, config=EngineConfig(max_batched_tokens=128, preemption="off"),
        prefix_caching=True,
    )  # fmt: skip
    if not share:
        engine.store.runtime.selector.blocks = None
    return engine


@pytest.mark.parametrize("coarse", [0, 4])
def test_a_prefix_hit_starts_from_its_donors_summaries_with_the_same_tokens(coarse):
    from kvstrata.engine import SamplingParams

    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 97, (300,), generator=g).tolist()
    params = [SamplingParams(max_tokens=8)]
    runs = {}
    for share in (True, False):
        with _engine(share, coarse) as engine:
            stats = engine.store.runtime.selector.stats
            first = engine.generate([prompt], params)[0]
            tiers, shared = stats.pages_summarised_from_tiers, stats.pages_shared
            second = engine.generate([prompt], params)[0]
            runs[share] = (
                first.token_ids, second.token_ids,
                stats.pages_summarised_from_tiers - tiers, stats.pages_shared - shared,
                getattr(second, "cached_tokens", None), stats.layers,
            )  # fmt: skip
    (a1, b1, tiers1, shared1, cached1, layers1), (a0, b0, tiers0, shared0, _, _) = (
        runs[True], runs[False],
    )  # fmt: skip
    assert layers1 > 0  # the decodes selected
    assert cached1 >= 256  # the second request hit the prefix cache
    # without sharing the hit re-summarises its prompt from the tiers; with it, the
    # pages of the shared blocks are copied (every layer) and none is read
    assert shared0 == 0 and tiers0 >= 2 * (256 // 4)
    assert shared1 >= 2 * (256 // 4) and tiers1 < tiers0
    assert a1 == b1 == a0 == b0 and len(a1) == 8


class _Hashes(dict):
    def of(self, block_id: int):
        return self.get(block_id)


def test_table_hashes_stop_at_the_first_unhashed_block_and_skip_windows():
    h = _Hashes({1: b"a", 2: b"b", 4: b"d"})
    table = BlockTable(block_ids=[1, 2, 3, 4], num_tokens=64)
    assert table_hashes(table, h.of, []) == [b"a", b"b"]
    known = [b"a"]
    assert table_hashes(table, h.of, known) == [b"a", b"b"] and known == [b"a"]  # a copy
    h[3] = b"c"
    assert table_hashes(table, h.of, [b"a", b"b"]) == [b"a", b"b", b"c", b"d"]
    windowed = BlockTable(block_ids=[3, 4], num_tokens=64, first_block=2, window=32)
    assert table_hashes(windowed, h.of, []) == []
    assert common([b"a", b"b", b"x"], [b"a", b"b", b"c", b"d"]) == 2
    assert common([], [b"a"]) == 0


def _entry(pages: int, filled: list[int], hashes: list[bytes], fill: float, groups: int = 0):
    data = torch.full((2, 1, 4, pages), fill)
    g = torch.full((2, 1, 4, pages // groups), fill) if groups else None
    return _Summaries(object(), data, list(filled), g, list(hashes))


def test_the_donor_is_the_longest_common_prefix_of_the_same_group():
    mine = [b"a", b"b", b"c"]
    cands = [
        ((7, 0), _entry(8, [8, 8], [b"a"], 1.0)),
        ((8, 0), _entry(8, [8, 8], [b"a", b"b"], 2.0)),
        ((9, 1), _entry(8, [8, 8], [b"a", b"b", b"c"], 3.0)),  # another layer group
        ((5, 0), _entry(8, [8, 8], [b"a", b"b", b"c"], 4.0)),  # the sequence itself
        ((6, 0), _entry(8, [8, 8], [b"z", b"b", b"c"], 5.0)),  # other content
    ]
    donor, n = best_donor((5, 0), mine, cands)
    assert n == 2 and donor is cands[1][1]
    assert best_donor((5, 2), mine, cands) == (None, 0)


def test_copy_prefix_copies_each_layers_filled_pages_and_complete_groups():
    src = _entry(16, [12, 5], [], 2.0, groups=4)
    dst = _entry(16, [0, 0], [], 0.0, groups=4)
    copied = copy_prefix(dst, src, 8, coarse=4)
    assert dst.filled == [8, 5] and copied == 13
    assert torch.all(dst.data[0, ..., :8] == 2.0) and torch.all(dst.data[0, ..., 8:] == 0.0)
    assert torch.all(dst.data[1, ..., :5] == 2.0) and torch.all(dst.data[1, ..., 5:] == 0.0)
    assert torch.all(dst.groups[0, ..., :2] == 2.0) and torch.all(dst.groups[0, ..., 2:] == 0.0)
    assert torch.all(dst.groups[1, ..., :1] == 2.0) and torch.all(dst.groups[1, ..., 1:] == 0.0)


def test_finished_sequences_wait_for_a_hit_and_a_cut_drops_hashes_past_it():
    h = _Hashes({i: bytes([i]) for i in range(10)})
    sel = KeySelector(0.125, "minmax", 4, torch.device("cpu"), blocks=BlockHashes(h.of, 16))
    tables = {}
    for seq in range(RETAINED + 2):
        tables[(seq, 0)] = BlockTable(block_ids=[0, 1, 2], num_tokens=48)
        sel._entry((seq, 0), tables[(seq, 0)], 2, 1, 4, 12)
    sel.forget(tables.get)  # all live: each notes its blocks' hashes
    assert all(e.hashes == [b"\x00", b"\x01", b"\x02"] for e in sel._seqs.values())
    sel.truncate((0, 0), 20)  # block 1 is cut inside: only block 0 still holds its keys
    assert sel._seqs[(0, 0)].hashes == [b"\x00"]
    sel.forget({}.get)  # all finished
    assert not sel._seqs and [k for k, _ in sel._retired] == [(2, 0), (3, 0)][-RETAINED:]


def test_a_finished_donors_summaries_are_taken_over_and_a_live_ones_copied():
    h = _Hashes({i: bytes([i]) for i in range(10)})
    sel = KeySelector(0.125, "minmax", 4, torch.device("cpu"), blocks=BlockHashes(h.of, 16))
    a = BlockTable(block_ids=[0, 1, 2], num_tokens=48)
    donor = sel._entry((1, 0), a, 2, 1, 4, 12)
    donor.filled = [12, 12]
    sel.forget({(1, 0): a}.get)  # notes its hashes
    b = BlockTable(block_ids=[0, 1, 3], num_tokens=48)  # shares blocks 0 and 1
    live = sel._entry((2, 0), b, 2, 1, 4, 12)
    assert live.data is not donor.data and live.filled == [8, 8]
    sel.forget({(2, 0): b}.get)  # (1, 0) finished
    c = BlockTable(block_ids=[0, 1, 2, 4], num_tokens=64)
    taken = sel._entry((3, 0), c, 2, 1, 4, 16)
    # the finished sequence shares 3 blocks (12 pages), the live one 2: it donates,
    # its tensor itself, and is no longer kept
    assert taken.data is donor.data and taken.filled == [12, 12]
    assert all(s is not donor for _, s in sel._retired)
