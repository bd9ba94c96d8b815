"""BlockManager: stateful property tests over device + host (+ disk) tiers, and
exact-order tests (slot allocation, id recycling, cascade placement) in vLLM style."""

from __future__ import annotations

import os
import re
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blockstore_harness import (
    SeqModel,
    check_accounting,
    check_contents,
    check_step,
    read_sequence,
    snapshot,
    tiny_layout,
    write_step,
)
from kvstrata.blocks.eviction import EvictionPolicy
from kvstrata.blocks.hash_index import HashIndex
from kvstrata.blocks.manager import BlockManager, Run
from kvstrata.core.errors import ConfigError, KvstrataError, OutOfBlocksError
from kvstrata.tiers.disk import DiskTier
from kvstrata.tiers.memory import DeviceTier, HostTier
from reference_placement import check_order, compare_with_reference

BYTES_RE = re.compile(r"\d+(\.\d+)? (B|KiB|MiB|GiB)")


def assert_actionable(err: OutOfBlocksError) -> None:
    """(e) the message states bytes and which budget to raise."""
    msg = str(err)
    assert BYTES_RE.search(msg), msg
    assert re.search(r"raise (device|host|disk)_budget", msg), msg


# -- stateful property test -----------------------------------------------------------------


class BlockStoreMachine(RuleBasedStateMachine):
    """Random sequence operations; after every step all tokens read back bit-exact."""

    block_size = 2
    policy = "window"
    sink_tokens = 0
    slots = (5, 5, 6)  # device, host, disk arenas; disk only when use_disk
    use_disk = True

    def __init__(self) -> None:
        super().__init__()
        self.layout = tiny_layout(self.block_size)
        tiers = [DeviceTier(self.layout, self.slots[0], device="cpu")]
        tiers.append(HostTier(self.layout, self.slots[1]))
        self.tmp = None
        if self.use_disk:
            self.tmp = tempfile.TemporaryDirectory()
            tiers.append(DiskTier(self.layout, self.slots[2], self.tmp.name))
        self.tier_list = tiers
        self.mgr = BlockManager(
            self.layout, tiers, EvictionPolicy(self.policy), sink_tokens=self.sink_tokens
        )
        compare_with_reference(self.mgr)  # every placement equals the old full sort's
        self.model = SeqModel(self.layout)

    def teardown(self) -> None:
        for t in self.tier_list:
            t.close()
        if self.tmp is not None:
            self.tmp.cleanup()

    # helpers
    def _seq_ids(self) -> list[int]:
        return sorted(self.mgr.state.tables)

    def _refused(self, before: dict, err: OutOfBlocksError) -> None:
        assert_actionable(err)
        assert snapshot(self.mgr) == before, "a refused operation changed the state"

    def _within_budgets(self) -> None:
        state = self.mgr.state
        for name, tier in state.tiers.items():
            assert tier.num_used <= state.budget_slots[name], (
                f"{name}: {tier.num_used} blocks over a budget of {state.budget_slots[name]}"
            )

    # rules
    @precondition(lambda self: len(self.mgr.state.tables) < 4)
    @rule()
    def add_sequence(self) -> None:
        seq_id = max(self.mgr.state.tables, default=-1) + 1
        self.mgr.add_sequence(seq_id)
        self.model.add(seq_id)

    @precondition(lambda self: self.mgr.state.tables)
    @rule(data=st.data(), num_new=st.integers(1, 5), seed=st.integers(0, 2**16))
    def append(self, data: st.DataObject, num_new: int, seed: int) -> None:
        seq_ids = data.draw(
            st.lists(st.sampled_from(self._seq_ids()), min_size=1, max_size=4, unique=True)
        )
        lay = self.layout
        gen = torch.Generator().manual_seed(seed)
        shape = (len(seq_ids), lay.num_kv_heads, num_new, lay.head_dim)
        ks = [torch.randn(shape, generator=gen) for _ in range(lay.num_layers)]
        vs = [torch.randn(shape, generator=gen) for _ in range(lay.num_layers)]
        before = snapshot(self.mgr)
        try:
            writes = self.mgr.append(seq_ids, num_new)
        except OutOfBlocksError as err:
            self._refused(before, err)
            return
        check_step(self.mgr, seq_ids, writes)
        write_step(self.mgr, writes, ks, vs)
        self.model.append(seq_ids, ks, vs)
        # (d) the device (and every tier) is within its budget after a step.
        self._within_budgets()

    @precondition(lambda self: self.mgr.state.tables and len(self.mgr.state.tables) < 4)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        src = data.draw(st.sampled_from(self._seq_ids()))
        dst = max(self.mgr.state.tables) + 1
        self.mgr.fork(src, dst)
        self.model.fork(src, dst)

    @precondition(lambda self: self.mgr.state.tables)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self._seq_ids()))
        self.mgr.free_sequence(seq_id)
        self.model.free(seq_id)

    @precondition(lambda self: self.mgr.state.tables)
    @rule(data=st.data())
    def truncate(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self._seq_ids()))
        n = data.draw(st.integers(0, self.mgr.num_tokens(seq_id)))
        before = snapshot(self.mgr)
        try:
            self.mgr.truncate(seq_id, n)
        except OutOfBlocksError as err:
            self._refused(before, err)
            return
        self.model.truncate(seq_id, n)

    @precondition(lambda self: self.mgr.state.tables)
    @rule(data=st.data())
    def remap(self, data: st.DataObject) -> None:
        sources = data.draw(st.lists(st.sampled_from(self._seq_ids()), min_size=0, max_size=4))
        self.mgr.remap(sources)
        self.model.remap(sources)

    @rule(data=st.data())
    def set_budget(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self.mgr.state.tier_order))
        n = data.draw(st.integers(0, self.mgr.state.tiers[name].num_slots))
        before = snapshot(self.mgr)
        try:
            self.mgr.set_budget(name, n)
        except OutOfBlocksError as err:
            self._refused(before, err)
            return
        assert self.mgr.state.budget_slots[name] == n
        self._within_budgets()

    @invariant()
    def consistent(self) -> None:
        check_accounting(self.mgr)
        check_order(self.mgr)
        check_contents(self.mgr, self.model)


# Shrinking a failing run through the disk tier can take minutes: failures print
# unshrunk unless BLOCKSTORE_SHRINK=1. BLOCKSTORE_EXAMPLES=300 explores further.
_PHASES = [Phase.explicit, Phase.reuse, Phase.generate]
if os.environ.get("BLOCKSTORE_SHRINK") == "1":
    _PHASES.append(Phase.shrink)
_FAST = settings(
    phases=_PHASES,
    max_examples=int(os.environ.get("BLOCKSTORE_EXAMPLES", "20")),
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class WindowDiskMachine(BlockStoreMachine):
    block_size = 2
    policy = "window"
    use_disk = True


class LruSinkMachine(BlockStoreMachine):
    block_size = 3
    policy = "lru"
    sink_tokens = 3
    use_disk = False
    slots = (6, 4, 0)


class LfuDiskMachine(BlockStoreMachine):
    block_size = 4
    policy = "lfu"
    sink_tokens = 4
    slots = (4, 3, 5)


TestWindowDisk = WindowDiskMachine.TestCase
TestWindowDisk.settings = _FAST
TestLruSink = LruSinkMachine.TestCase
TestLruSink.settings = _FAST
TestLfuDisk = LfuDiskMachine.TestCase
TestLfuDisk.settings = _FAST


class _Draws:
    """A hypothesis `data` that returns recorded draws in turn."""

    def __init__(self, *values) -> None:
        self.values = list(values)

    def draw(self, strategy):
        return self.values.pop(0)


def test_a_crop_that_reopens_a_lower_block_keeps_the_device_within_its_budget():
    """A run the state machine found (CI): with the device budget cut below its arena,
    cropping a sequence into a block on the host brings that block back to the device;
    the room counted was the arena's free slots, not the budget's, and the device
    ended one block over its budget."""
    m = WindowDiskMachine()
    steps = [
        ("set_budget", ("device", 3), {}), ("add_sequence", None, {}),
        ("remap", ([0, 0, 0, 0],), {}), ("truncate", (3, 0), {}), ("truncate", (0, 0), {}),
        ("remap", ([2, 1, 1],), {}), ("truncate", (0, 0), {}), ("fork", (0,), {}),
        ("append", ([2, 0],), {"num_new": 5, "seed": 2762}), ("truncate", (3, 0), {}),
        ("set_budget", ("disk", 6), {}),
        ("append", ([0, 3, 2, 1],), {"num_new": 3, "seed": 1520}), ("free", (0,), {}),
        ("append", ([1, 2, 3],), {"num_new": 2, "seed": 137}), ("truncate", (1, 1), {}),
        ("append", ([2],), {"num_new": 1, "seed": 200}),
    ]  # fmt: skip
    try:
        for name, draws, kw in steps:
            rule = getattr(m, name)
            rule() if draws is None else rule(_Draws(*draws), **kw)
            m.consistent()
            m._within_budgets()
    finally:
        m.teardown()


# -- exact orders (vLLM style) --------------------------------------------------------------


def _manager(policy: str, slots: list[int], block_size: int = 2, sink_tokens: int = 0, tmp=None):
    layout = tiny_layout(block_size)
    tiers = [DeviceTier(layout, slots[0], device="cpu"), HostTier(layout, slots[1])]
    if len(slots) > 2:
        tiers.append(DiskTier(layout, slots[2], tmp))
    return BlockManager(layout, tiers, EvictionPolicy(policy), sink_tokens=sink_tokens)


def _placement(mgr: BlockManager, seq_id: int) -> list[tuple[str, int]]:
    return [(b.tier, b.slot) for b in mgr.blocks_of(seq_id)]


def _on_tier(mgr: BlockManager) -> dict[str, list[int]]:
    return {name: sorted(ids) for name, ids in mgr.state.on_tier.items()}


def test_window_keeps_sinks_and_newest_demotes_oldest() -> None:
    mgr = _manager("window", [3, 6], sink_tokens=2)
    state = mgr.state
    mgr.add_sequence(0)
    mgr.append([0], 8)  # 4 full blocks: sink + the 2 newest fit on the device
    assert state.tables[0].block_ids == [0, 3, 1, 2]
    assert _placement(mgr, 0) == [("device", 0), ("host", 0), ("device", 1), ("device", 2)]
    mgr.append([0], 1)  # an open block: the oldest non-sink device block goes down
    assert state.tables[0].block_ids == [0, 3, 1, 2, 4]
    assert _placement(mgr, 0) == [
        ("device", 0),
        ("host", 0),
        ("host", 1),
        ("device", 2),
        ("device", 1),
    ]
    assert _on_tier(mgr) == {"device": [0, 2, 4], "host": [1, 3]}
    assert mgr.runs(0) == [
        Run("device", 0, 1, 0, 2),
        Run("host", 0, 2, 2, 4),
        Run("device", 2, 1, 6, 2),
        Run("device", 1, 1, 8, 1),
    ]
    assert state.bytes_moved == {"device->host": 256}
    assert mgr.blocks_of(0)[0].is_sink and not mgr.blocks_of(0)[1].is_sink


def test_window_with_two_sequences() -> None:
    mgr = _manager("window", [4, 8])
    state = mgr.state
    mgr.add_sequence(0)
    mgr.add_sequence(1)
    mgr.append([0, 1], 4)
    assert state.tables == {0: state.tables[0], 1: state.tables[1]}
    # Installed in rank order: seq 1's newest block ranks first (ties: newer step index).
    assert [state.tables[0].block_ids, state.tables[1].block_ids] == [[2, 3], [0, 1]]
    assert _placement(mgr, 0) == [("device", 2), ("device", 3)]
    assert _placement(mgr, 1) == [("device", 0), ("device", 1)]
    mgr.set_budget("device", 2)  # each sequence keeps its newest block
    assert _on_tier(mgr) == {"device": [1, 3], "host": [0, 2]}
    assert _placement(mgr, 0) == [("host", 1), ("device", 3)]
    assert _placement(mgr, 1) == [("host", 0), ("device", 1)]
    assert mgr.eviction_order() == [2, 0, 3, 1]


@pytest.mark.parametrize(
    ("policy", "device", "host"),
    [("window", [0, 1, 3], [2]), ("lru", [1, 2, 3], [0]), ("lfu", [0, 1, 3], [2])],
)
def test_policy_decides_the_demoted_block(policy: str, device: list[int], host: list[int]) -> None:
    # seq 0: 2 blocks, accessed 3 times (last at step 3); seq 1: 1 block, then a
    # second one at step 5 that needs room on a full 3-slot device.
    mgr = _manager(policy, [3, 4])
    mgr.add_sequence(0)
    mgr.add_sequence(1)
    mgr.append([0], 2)
    mgr.append([0], 2)
    mgr.append([0], 0)
    mgr.append([1], 2)
    assert _on_tier(mgr) == {"device": [0, 1, 2], "host": []}
    mgr.append([1], 2)
    assert _on_tier(mgr) == {"device": device, "host": host}
    assert mgr.state.num_moves == 1


def test_cascade_three_tiers_moves_each_block_to_its_final_tier() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mgr = _manager("window", [2, 2, 4], tmp=tmp)
        state = mgr.state
        mgr.add_sequence(0)
        mgr.append([0], 10)  # 5 full blocks: 2 device, 2 host, the oldest on disk
        assert state.tables[0].block_ids == [4, 2, 3, 0, 1]
        assert _placement(mgr, 0) == [
            ("disk", 0),
            ("host", 0),
            ("host", 1),
            ("device", 0),
            ("device", 1),
        ]
        mgr.append([0], 2)  # one more: every tier passes its oldest block down
        assert state.tables[0].block_ids == [4, 2, 3, 0, 1, 5]
        assert _placement(mgr, 0) == [
            ("disk", 0),
            ("disk", 1),
            ("host", 1),
            ("host", 0),
            ("device", 1),
            ("device", 0),
        ]
        assert _on_tier(mgr) == {"device": [1, 5], "host": [0, 3], "disk": [2, 4]}
        assert state.bytes_moved == {"host->disk": 256, "device->host": 256}
        # A shrinking device budget sends blocks two tiers down in one move.
        mgr.set_budget("host", 0)
        assert _on_tier(mgr) == {"device": [1, 5], "host": [], "disk": [0, 2, 3, 4]}
        assert state.bytes_moved == {"host->disk": 768, "device->host": 256}
        for t in state.tiers.values():
            t.close()


def test_out_of_blocks_messages_and_refused_budget() -> None:
    mgr = _manager("window", [2, 2])
    state = mgr.state
    for s in range(3):
        mgr.add_sequence(s)
    with pytest.raises(OutOfBlocksError) as err:
        mgr.append([0, 1, 2], 1)  # three open blocks, two device slots
    assert str(err.value) == (
        "device tier needs 768 B for blocks being written (open blocks of 3 sequences) "
        "but its budget is 512 B: raise device_budget or lower block_size"
    )
    assert state.pool.num_live == 0 and mgr.num_tokens(0) == 0
    mgr.append([0, 1], 1)
    with pytest.raises(OutOfBlocksError) as err:
        mgr.set_budget("device", 1)
    assert_actionable(err.value)
    assert state.budget_slots["device"] == 2  # a refused budget does not stick
    with pytest.raises(ConfigError, match=r"device_budget=3 is invalid: between 0 and"):
        mgr.set_budget("device", 3)
    with pytest.raises(OutOfBlocksError) as err:
        mgr.append([0], 9)  # 5 full blocks; seq 1's open block holds a device slot
    assert str(err.value) == (
        "all tiers are full: 2 more blocks (512 B raw) needed, budgets device=512 B, "
        "host=512 B; raise host_budget or disk_budget (or use a smaller codec on the "
        "lower tiers)"
    )
    assert_actionable(err.value)
    assert [mgr.num_tokens(0), mgr.num_tokens(1)] == [1, 1]


def test_fork_copy_on_write_and_free() -> None:
    mgr = _manager("window", [4, 4])
    state = mgr.state
    model = SeqModel(state.layout)
    mgr.add_sequence(0)
    model.add(0)
    gen = torch.Generator().manual_seed(0)

    def step(seq_ids: list[int], n: int) -> None:
        shape = (len(seq_ids), 2, n, 4)
        ks = [torch.randn(shape, generator=gen) for _ in range(2)]
        vs = [torch.randn(shape, generator=gen) for _ in range(2)]
        write_step(mgr, mgr.append(seq_ids, n), ks, vs)
        model.append(seq_ids, ks, vs)

    step([0], 3)
    mgr.fork(0, 1)
    model.fork(0, 1)
    assert [b.ref_count for b in mgr.blocks_of(1)] == [2, 2]
    step([1], 1)  # the shared open block is copied for seq 1
    assert state.tables == {0: state.tables[0], 1: state.tables[1]}
    assert [state.tables[0].block_ids, state.tables[1].block_ids] == [[0, 1], [0, 2]]
    check_contents(mgr, model)
    mgr.free_sequence(0)
    model.free(0)
    assert state.pool.free_ids() == [1]
    assert _on_tier(mgr) == {"device": [0, 2], "host": []}
    check_accounting(mgr)
    check_contents(mgr, model)
    k, _ = read_sequence(mgr, 1, 1)
    assert k.shape == (2, 4, 4)


def test_sliding_table_drops_blocks_outside_its_window_and_limits_crops() -> None:
    # block size 2, window 4: after n tokens the table keeps blocks from
    # (n - 3 - 2) // 2 on (one block of slack below the window)
    mgr = _manager("window", [16, 4])
    state = mgr.state
    mgr.add_sequence(0, window=4)
    mgr.add_sequence(1, window=4)
    mgr.truncate(1, 0)  # nothing dropped yet: a crop to 0 is fine
    mgr.append([0], 3)
    assert state.tables[0].first_block == 0
    mgr.append([0], 1)
    mgr.append([0], 1)
    mgr.append([0], 1)  # 6 tokens: the step starts at 5 -> first live block (5-5)//2 = 0
    mgr.append([0], 1)  # starts at 6: (6 - 5) // 2 = 0
    mgr.append([0], 1)  # starts at 7: block 1 is the first live one
    table = state.tables[0]
    assert (table.first_block, len(table.block_ids), table.num_tokens) == (1, 3, 8)
    assert [r.token_start for r in mgr.runs(0)] == [2]
    mgr.truncate(0, 7)  # one token back: still inside what the window kept
    with pytest.raises(KvstrataError, match="crop by at most one block"):
        mgr.truncate(0, 2)
    # a long step stores only what its window keeps; history is held until it ends
    mgr.append([0], 20)
    table = state.tables[0]
    assert table.first_block == (27 - 5) // 2 and table.step_history
    mgr.end_step([0])
    assert not table.step_history
    assert state.tables[0].num_tokens == 27


def test_skipped_sliding_blocks_kept_as_cache_copies_are_written_by_the_step() -> None:
    # window 4, block size 2: a 20-token first step keeps blocks 7.. live; with free
    # slots the full blocks 0..7 are stored too (written by this step, from token 0)
    mgr = _manager("window", [16, 4])
    state = mgr.state
    state.keep_skipped_blocks = True
    mgr.add_sequence(0, window=4)
    writes = mgr.append([0], 20)
    table = state.tables[0]
    assert table.first_block == (20 - 5) // 2
    assert [i for i, _ in table.step_extra] == list(range(7))  # all fit in free device slots
    src = sorted(s for w in writes for s in w.src.tolist())
    assert src == list(range(0, 20))  # every token of a kept block is written
    assert mgr.live_bytes() == len(table.block_ids) * state.tiers["device"].block_bytes
    mgr.end_step([0])
    assert not table.step_extra and not state.cached  # unhashed copies are released


@pytest.mark.parametrize("host_codec", ["none", "int8"])
def test_a_large_move_is_copied_in_chunks_with_the_same_result(host_codec, monkeypatch) -> None:
    """Demoting many blocks at once copies at most COPY_CHUNK_BYTES of raw blocks per
    step (bounded GPU scratch when blocks leave a GPU): the result is the same bytes."""
    from kvstrata.codecs.registry import get_codec
    from kvstrata.tiers import movement

    def run(chunk_bytes: int) -> tuple[dict, list]:
        monkeypatch.setattr(movement, "COPY_CHUNK_BYTES", chunk_bytes)
        layout = tiny_layout(2)
        tiers = [
            DeviceTier(layout, 12, device="cpu"),
            HostTier(layout, 12, codec=get_codec(host_codec)),
        ]
        mgr = BlockManager(layout, tiers, EvictionPolicy("window"))
        mgr.add_sequence(0)
        torch.manual_seed(0)
        writes = mgr.append([0], 20)
        ks = [torch.randn(1, 2, 20, 4) for _ in range(2)]
        write_step(mgr, writes, ks, [k * 2 for k in ks])
        calls = []
        real = mgr._copy_chunk
        monkeypatch.setattr(mgr, "_copy_chunk", lambda *a: calls.append(len(a[1])) or real(*a))
        mgr.set_budget("device", 2)  # slots: 8 of the 10 blocks go down at once
        seq = [read_sequence(mgr, 0, layer) for layer in range(2)]
        return {"placement": _placement(mgr, 0), "chunks": calls}, seq

    whole, seq_whole = run(2**30)
    chunked, seq_chunked = run(1)  # one block per chunk
    assert whole["chunks"] == [8] and chunked["chunks"] == [1] * 8
    assert whole["placement"] == chunked["placement"]
    for (k1, v1), (k2, v2) in zip(seq_whole, seq_chunked, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


# -- the content-hash index (shared with the vLLM backend's offload index) -------------------
@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["rank", "unrank", "move"]),
            st.integers(0, 7),  # item
            st.sampled_from(["host", "disk"]),
            st.integers(0, 5),  # rank value (made unique with the item)
        ),
        max_size=60,
    )
)
def test_hash_index_keeps_each_tier_in_rank_order(ops) -> None:
    index: HashIndex[int] = HashIndex(["host", "disk"])
    model: dict[str, dict[int, tuple]] = {"host": {}, "disk": {}}
    for op, item, tier, value in ops:
        other = "disk" if tier == "host" else "host"
        if op == "rank":
            index.rank(tier, item, (value, item))
            model[tier][item] = (value, item)
        elif op == "unrank":
            assert index.unrank(tier, item) == (item in model[tier])
            model[tier].pop(item, None)
        else:
            assert index.move(item, tier, other) == (item in model[tier])
            if item in model[tier]:
                model[other][item] = model[tier].pop(item)
        for name, ranks in model.items():
            assert [i for _, i in index.ascending(name)] == sorted(ranks, key=ranks.__getitem__)
            assert index.num_ranked(name) == len(ranks)
            assert all(index.is_ranked(name, i) == (i in ranks) for i in range(8))
    assert sorted(index.ranked()) == sorted([*model["host"], *model["disk"]])


def test_cached_blocks_are_ranked_in_the_hash_index() -> None:
    """A hashed block whose last reference goes is ranked on its tier by (last access,
    -id) in the same index that maps its hash; a re-reference takes it out again."""
    mgr = BlockManager(tiny_layout(), [DeviceTier(tiny_layout(), 8)], EvictionPolicy("lru"))
    state = mgr.state
    mgr.add_sequence(0)
    mgr.append([0], 4)
    mgr.end_step([0])
    block_id = state.tables[0].block_ids[0]
    assert mgr.set_hash(block_id, b"h0", (1, 2))
    assert state.hash_to_block.get(b"h0") == block_id
    mgr.free_sequence(0)
    ranks = list(state.hash_to_block.ascending("device"))
    assert ranks == [((state.pool.blocks[block_id].last_access, -block_id), block_id)]
    assert state.cached == {block_id} and mgr.occupancy()["device"]["cached_blocks"] == 1


def test_a_crop_into_a_lower_tier_block_makes_room_among_the_cut_blocks_left_cached() -> None:
    """Cropping into a block on the host reopens it on the device; the cut blocks that
    held the device stay cached (they are hashed), so one of them moves down to make the
    slot — still found by its hash — instead of the crop failing."""
    mgr = _manager("window", [2, 8])
    state = mgr.state
    mgr.add_sequence(0)
    mgr.append([0], 8)
    mgr.end_step([0])
    for i, block_id in enumerate(state.tables[0].block_ids):
        assert mgr.set_hash(block_id, bytes([i]), (i,))
    assert [b.tier for b in mgr.blocks_of(0)] == ["host", "host", "device", "device"]
    mgr.truncate(0, 3)
    blocks = mgr.blocks_of(0)
    assert mgr.num_tokens(0) == 3 and [b.tier for b in blocks] == ["host", "device"]
    assert blocks[1].num_tokens == 1 and blocks[1].block_hash is None  # reopened
    cut = [state.pool.blocks[state.hash_to_block.get(h)] for h in (b"\x02", b"\x03")]
    assert all(b.ref_count == 0 for b in cut)  # the cut blocks: cached, one moved to the host
    assert sorted(b.tier for b in cut) == ["device", "host"]
