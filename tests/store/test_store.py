"""KVStore: prefix reuse across requests, tiers and restarts; tenant salts; layer
groups; and a stateful property test of many sequences over one store."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from transformers import DynamicCache

from blockstore_harness import read_sequence
from hf_models import greedy_ids, shared_prefix_case, tiny_model
from hf_models import seeded_ids as _ids
from kvstrata import CacheConfig, ConfigError, KVStore, OutOfBlocksError
from kvstrata.attention.writes import write_layer, write_plan
from kvstrata.integrations.hf import TieredCache, enable
from kvstrata.model.geometry import KVGeometry
from kvstrata.model.groups import layer_groups
from reference_placement import check_order, compare_with_reference

PREFIX = 2048
NEW = 40


class ForwardTokens:
    """Counts the tokens every forward of a model sees."""

    def __init__(self, model) -> None:
        self.seen: list[int] = []
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.seen.append(int(ids.shape[1]))


def _greedy(model, ids, cache, n=NEW):
    return greedy_ids(model, ids, cache, n)


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama", max_position_embeddings=4096)
    prompts, refs = shared_prefix_case(model, PREFIX, 60, (8, 9), NEW)
    enable(model)
    counter = ForwardTokens(model)
    return model, prompts, refs, counter


def _config(**kw) -> CacheConfig:
    return CacheConfig(**{"block_size": 64, "max_tokens": 4096, **kw})


def test_prefix_hit_in_process_runs_only_the_suffix(llama):
    model, prompts, refs, counter = llama
    store = KVStore(model.config, _config(resident_fraction=0.25, host_budget="64MiB"))
    first = TieredCache.from_store(store, prompts[0])
    assert first.matched_tokens == 0
    assert torch.equal(_greedy(model, prompts[0], first), refs[0])
    first.close()
    second = TieredCache.from_store(store, prompts[1])
    assert second.matched_tokens == PREFIX
    counter.seen.clear()
    out = _greedy(model, prompts[1], second)
    assert torch.equal(out, refs[1])
    assert counter.seen[0] == prompts[1].shape[1] - PREFIX  # only the unmatched tokens
    prefix = store.stats()["prefix"]
    assert prefix["hit_tokens"] == PREFIX
    assert sum(prefix["hit_tokens_by_tier"].values()) == PREFIX
    # the hit came from the tiers the first request left its blocks on
    assert set(prefix["hit_tokens_by_tier"]) <= {"device", "host"}
    store.close()


def test_prefix_hit_after_restart_comes_from_disk(llama, tmp_path):
    model, prompts, refs, counter = llama
    cfg = _config(
        resident_fraction=0.1, host_budget="256KiB", disk_dir=str(tmp_path), disk_budget="64MiB"
    )
    with KVStore(model.config, cfg) as store:
        cache = TieredCache.from_store(store, prompts[0])
        assert torch.equal(_greedy(model, prompts[0], cache), refs[0])
    with KVStore(model.config, cfg) as restarted:  # a new process, the same directory
        cache = TieredCache.from_store(restarted, prompts[1])
        assert cache.matched_tokens == PREFIX
        counter.seen.clear()
        assert torch.equal(_greedy(model, prompts[1], cache), refs[1])
        assert counter.seen[0] == prompts[1].shape[1] - PREFIX
        assert restarted.stats()["prefix"]["hit_tokens_by_tier"] == {"disk": PREFIX}


def test_corrupt_disk_block_is_a_miss_and_is_recomputed(llama, tmp_path):
    model, prompts, refs, counter = llama
    cfg = _config(
        resident_fraction=0.1, host_budget="256KiB", disk_dir=str(tmp_path), disk_budget="64MiB"
    )
    with KVStore(model.config, cfg) as store:
        assert torch.equal(
            _greedy(model, prompts[0], TieredCache.from_store(store, prompts[0])), refs[0]
        )
    arena = Path(tmp_path) / "blocks.bin"
    data = bytearray(arena.read_bytes())
    assert any(data), "nothing was written to disk"
    for pos in range(2048, len(data), 4096):  # one byte in every 4 KiB page
        data[pos] ^= 0x01
    arena.write_bytes(bytes(data))
    with KVStore(model.config, cfg) as restarted:
        cache = TieredCache.from_store(restarted, prompts[1])
        assert cache.matched_tokens < PREFIX
        assert restarted.stats()["prefix"]["corrupt_blocks"] >= 1
        counter.seen.clear()
        assert torch.equal(_greedy(model, prompts[1], cache), refs[1])
        assert counter.seen[0] == prompts[1].shape[1] - cache.matched_tokens


def test_generate_with_another_prompt_than_the_cache_was_made_for_is_refused(llama):
    model, prompts, refs, counter = llama
    store = KVStore(model.config, _config(host_budget="64MiB"))
    first = TieredCache.from_store(store, prompts[0])
    _greedy(model, prompts[0], first, n=2)
    first.close()
    made_for_0 = TieredCache.from_store(store, prompts[0])
    assert made_for_0.matched_tokens == PREFIX  # shared with prompt 1 too
    with pytest.raises(ConfigError, match="input_ids"):
        _greedy(model, prompts[1], made_for_0, n=2)  # its suffix is not prompt 0's
    store.close()


def test_a_cache_dropped_without_close_gives_its_blocks_back_to_the_store(llama):
    model, prompts, refs, counter = llama
    store = KVStore(model.config, _config(host_budget="64MiB"))
    cache = TieredCache.from_store(store, prompts[0])
    _greedy(model, prompts[0], cache, n=2)
    assert store.sequence_ids and store.manager.live_bytes() > 0
    del cache  # no reference cycle: the finalizer runs now, and queues the sequence
    # freed at the store's next step (a finalizer may run in the middle of anything)
    new, _ = store.add_sequence(None)
    assert store.sequence_ids == [new] and store.manager.live_bytes() == 0
    store.free(new)
    assert (
        TieredCache.from_store(store, prompts[1]).matched_tokens == PREFIX
    )  # its blocks stayed cached
    store.close()


def test_tenant_salts_never_share_a_block(llama):
    model, prompts, refs, counter = llama
    store = KVStore(model.config, _config(host_budget="64MiB"))
    a = TieredCache.from_store(store, prompts[0], salt="tenant-a")
    assert torch.equal(_greedy(model, prompts[0], a), refs[0])
    a.close()
    b = TieredCache.from_store(store, prompts[1], salt="tenant-b")
    assert b.matched_tokens == 0
    b.close()
    a2 = TieredCache.from_store(store, prompts[1], salt="tenant-a")
    assert a2.matched_tokens == PREFIX
    a2.close()
    store.close()


def test_other_weights_under_the_same_config_name_never_share_a_block(tmp_path):
    cfg = _config(host_budget="4MiB", disk_dir=str(tmp_path), disk_budget="16MiB")
    prompt = _ids(5, 300)
    keys = []
    for seed in (0, 1, 0):  # same architecture and (empty) name, other weights, then back
        model = enable(tiny_model("llama", seed=seed))
        with KVStore(model.config, cfg) as store:
            cache = TieredCache.from_store(store, prompt)
            keys.append((store.model_key, cache.matched_tokens))
            _greedy(model, prompt, cache, n=4)
    assert keys[0][0] != keys[1][0] and keys[0][0] == keys[2][0]
    assert [matched for _, matched in keys] == [0, 0, 256]


def test_multi_turn_chat_with_one_cache_reuses_its_own_history(llama):
    model, prompts, refs, counter = llama
    store = KVStore(model.config, _config(host_budget="64MiB"))
    cache = TieredCache.from_store(store)
    first = _greedy(model, prompts[0][:, :300], cache, n=10)
    follow = torch.cat([first, _ids(11, 30)], dim=1)
    counter.seen.clear()
    out = _greedy(model, follow, cache, n=10)
    assert counter.seen[0] == 30 + 1  # the last answer token was never fed back
    model.set_attn_implementation("sdpa")
    try:
        ref = _greedy(model, follow, DynamicCache(config=model.config), n=10)
    finally:
        enable(model)
    assert torch.equal(out, ref)
    store.close()


@pytest.mark.parametrize("family", ["mistral", "qwen2", "gemma2"])
def test_prefix_hit_on_sliding_window_models(family):
    """Sliding groups keep only their window: a hit needs just those blocks, and the
    continuation is still exact."""
    attn = "eager" if family == "gemma2" else "sdpa"
    model = tiny_model(family, attn)
    prefix = _ids(21, 320)
    prompts = [torch.cat([prefix, _ids(seed, 30)], dim=1) for seed in (22, 23)]
    refs = [_greedy(model, p, DynamicCache(config=model.config), n=20) for p in prompts]
    enable(model)
    try:
        store = KVStore(model.config, _config(block_size=16, host_budget="4MiB"))
        first = TieredCache.from_store(store, prompts[0])
        assert torch.equal(_greedy(model, prompts[0], first, n=20), refs[0])
        first.close()
        second = TieredCache.from_store(store, prompts[1])
        assert second.matched_tokens == 320
        assert torch.equal(_greedy(model, prompts[1], second, n=20), refs[1])
        sliding = [g for g in store.groups if g.window]
        assert sliding, "the family should have sliding layers"
        held = store.runs(second.seq_ids[0], sliding[0].index)
        assert held[0].token_start > 0  # the sliding group dropped what it cannot see
        store.close()
    finally:
        model.set_attn_implementation(attn)


def test_a_step_that_never_finished_stops_indexing_its_sequence():
    geometry = KVGeometry(
        model_type="toy", num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4, v_head_dim=4,
        dtype="fp32",
    )  # fmt: skip
    store = KVStore(geometry, CacheConfig(block_size=4, max_tokens=64))
    store.build(torch.float32)
    seq, _ = store.add_sequence([])
    store.extend([seq], 8, [list(range(3, 11))])
    store.step_done([seq])  # two full blocks, indexed
    assert len(store.manager.state.hash_to_block) == 2
    store.extend([seq], 8, [list(range(11, 19))])  # the forward fails: no step_done
    store.extend([seq], 1, [[19]])
    store.step_done([seq])
    assert len(store.manager.state.hash_to_block) == 2  # the possibly partial blocks are not


@pytest.mark.parametrize(
    ("fields", "in_place"),
    [
        ({"host_budget": 64 * 1024}, "host"),  # the CPU computes: host RAM read in place
        ({"host_budget": 64 * 1024, "cold_attention": "stage"}, None),  # staged: not
        ({"host_budget": 64 * 1024, "host_codec": "int8", "residual_tokens": 8}, None),  # lossy
        ({}, None),
    ],
)
def test_capacity_names_the_lower_tiers_a_step_reads_in_place(fields, in_place):
    geometry = KVGeometry(
        model_type="toy", num_layers=1, num_heads=1, num_kv_heads=1, head_dim=4, v_head_dim=4,
        dtype="fp32",
    )  # fmt: skip
    store = KVStore(
        geometry, CacheConfig(block_size=4, max_tokens=64, device_budget=4096, **fields)
    )
    store.build(torch.float32)
    slots = store.manager.state.budget_slots
    assert store.capacity().in_place_blocks == (slots[in_place] if in_place else 0)
    assert store.capacity().device_blocks == slots["device"]
    store.close()


# -- layer groups ------------------------------------------------------------------------------


def test_layer_groups_have_equal_sizes_and_cover_every_layer():
    groups = layer_groups(18, [i for i in range(18) if i % 6 != 5], 512)
    assert [g.layers for g in groups] == [
        (5, 11, 17), (0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16),
    ]  # fmt: skip
    assert [g.window for g in groups] == [None] + [512] * 5
    assert [g.layers for g in layer_groups(4, [], None)] == [(0, 1, 2, 3)]
    assert [len(g.layers) for g in layer_groups(5, [0, 2], 8)] == [1] * 5


def _gemma3(window: int = 512):
    transformers = pytest.importorskip("transformers")
    config = transformers.Gemma3TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
        max_position_embeddings=9000, initializer_range=0.3, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, query_pre_attn_scalar=16, attn_implementation="sdpa",
    )  # fmt: skip
    assert config.layer_types.count("sliding_attention") == 5
    torch.manual_seed(0)
    return transformers.Gemma3ForCausalLM(config).eval()


@pytest.mark.slow
def test_sliding_groups_hold_the_window_not_the_context():
    """Gemma-3 style (5 of 6 layers slide) at 8k: identical tokens, KV bytes close to
    DynamicCache's, and the planner's bytes agree with the cache's."""
    model = _gemma3()
    ids = _ids(3, 8192 - 24)
    dyn = DynamicCache(config=model.config)
    ref = _greedy(model, ids, dyn, n=24)
    dyn_bytes = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in dyn.layers)
    enable(model)
    store = KVStore(model.config, _config(max_tokens=8192))
    cache = TieredCache.from_store(store)
    try:
        out = _greedy(model, ids, cache, n=24)
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(out, ref)
    stats = store.stats()
    assert stats["peak_kv_bytes"] <= 1.15 * dyn_bytes, (stats["peak_kv_bytes"], dyn_bytes)
    geometry = KVGeometry.from_hf_config(model.config)
    planned = geometry.bytes_for_context(cache.get_seq_length(), "none", "fp32", block_size=64)
    block_bytes = stats["tiers"]["device"]["block_bytes"]
    assert abs(stats["kv_bytes"] - planned) <= len(store.groups) * block_bytes


# -- many sequences over one store: a stateful property test -----------------------------------


def _token_kv(tokens: torch.Tensor, start: int, local: int, group: int, heads: int, dim: int):
    """Deterministic K/V of tokens at positions start.. (what a model would compute:
    a function of the token and its position, so equal prefixes give equal blocks)."""
    pos = torch.arange(start, start + len(tokens), dtype=torch.float32)
    base = tokens.float() * 1000 + pos + 0.25 * local + 0.125 * group
    k = base[None, :, None] + torch.arange(heads * dim, dtype=torch.float32).view(heads, 1, dim)
    return k, -k


class StoreMachine(RuleBasedStateMachine):
    """4 interleaved sequences over one store with a sliding group, shared and private
    prefixes, random lengths, lossless codecs, tight tiers, restarts: every sequence
    reads back exactly what a run of it alone would have stored."""

    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.geometry = KVGeometry(
            model_type="toy", num_layers=3, num_heads=2, num_kv_heads=1, head_dim=4,
            v_head_dim=4, dtype="fp32", sliding_window=20, sliding_layers=(1,),
        )  # fmt: skip
        self.cfg = CacheConfig(
            block_size=4, max_tokens=64, device_budget=16 * 128, host_budget=12 * 128,
            disk_dir=self.tmp.name, disk_budget=240 * 128, sink_tokens=0,
        )  # fmt: skip
        self._open()
        self.tokens: dict[int, list[int]] = {}
        self.prefixes = [[(7 * i + j) % 50 + 3 for j in range(12)] for i in range(2)]

    def _open(self) -> None:
        self.store = KVStore(self.geometry, self.cfg)
        self.store.build(torch.float32)
        compare_with_reference(self.store.manager)  # placements equal the old full sort's

    def teardown(self) -> None:
        self.store.close()
        self.tmp.cleanup()

    def _write(self, seq_id: int, new: list[int]) -> None:
        store = self.store
        start = store.num_tokens(seq_id)
        try:
            writes = store.extend([seq_id], len(new), [new])
        except OutOfBlocksError:  # refused (e.g. copies on write of forks): nothing changed
            assert store.num_tokens(seq_id) == start
            return
        plans = [write_plan(store.runtime, w, 1) for w in writes]
        lay = store.layout
        for group in store.groups:
            for local, _layer in enumerate(group.layers):
                k, v = _token_kv(
                    torch.tensor(new), start, local, group.index, lay.num_kv_heads, lay.head_dim
                )
                write_layer(plans[group.index], local, k[None], v[None])
        store.step_done([seq_id])
        self.tokens[seq_id] += new

    @precondition(lambda self: len(self.tokens) < 4)
    @rule(
        which=st.integers(0, 2),
        extra=st.lists(st.integers(3, 60), min_size=1, max_size=9),
        salt=st.sampled_from(["", "b"]),
    )
    def add(self, which: int, extra: list[int], salt: str) -> None:
        prompt = (self.prefixes[which] if which < 2 else []) + extra
        seq_id, matched = self.store.add_sequence(prompt, salt=salt)
        assert matched % 4 == 0 and matched < len(prompt)
        self.tokens[seq_id] = list(prompt[:matched])
        self._write(seq_id, prompt[matched:])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 9))
    def extend(self, data, n: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        if len(self.tokens[seq_id]) + n > 60:
            return
        self._write(seq_id, [data.draw(st.integers(3, 60)) for _ in range(n)])

    @precondition(lambda self: len(self.tokens) >= 2)
    @rule(data=st.data())
    def ragged_step(self, data) -> None:
        """One step over several sequences with a different token count each (the
        engine's packed batch): K/V arrive as one row, sequence after sequence."""
        store = self.store
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=2, unique=True))
        counts = [data.draw(st.integers(1, 9)) for _ in ids]
        if any(len(self.tokens[s]) + n > 60 for s, n in zip(ids, counts, strict=True)):
            return
        new = [[data.draw(st.integers(3, 60)) for _ in range(n)] for n in counts]
        starts = [store.num_tokens(s) for s in ids]
        try:
            writes = store.extend(ids, counts, new)
        except OutOfBlocksError:
            assert [store.num_tokens(s) for s in ids] == starts
            return
        plans = [write_plan(store.runtime, w, 1) for w in writes]
        lay = store.layout
        for group in store.groups:
            for local, _layer in enumerate(group.layers):
                parts = [
                    _token_kv(
                        torch.tensor(t), start, local, group.index, lay.num_kv_heads, lay.head_dim
                    )[0]
                    for t, start in zip(new, starts, strict=True)
                ]
                k = torch.cat(parts, dim=1)
                write_layer(plans[group.index], local, k[None], -k[None])
        store.step_done(ids)
        for s, t in zip(ids, new, strict=True):
            self.tokens[s] += t

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def demote(self, data) -> None:
        """Preemption: a sequence's full blocks leave the device, contents unchanged."""
        store = self.store
        mgr = store.manager
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        before = {t: o["used_blocks"] for t, o in mgr.occupancy().items()}
        moved = store.demote(seq_id)
        after = {t: o["used_blocks"] for t, o in mgr.occupancy().items()}
        assert before["device"] - after["device"] == moved
        for key in store.tables(seq_id):
            for block in mgr.blocks_of(key):
                full_private = block.num_tokens == 4 and block.ref_count == 1
                room = any(after[t] < mgr.state.budget_slots[t] for t in ("host", "disk"))
                assert block.tier != "device" or not full_private or not room

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), n=st.integers(1, 9), layers=st.integers(0, 2))
    def failed_step(self, data, n: int, layers: int) -> None:
        """A step that fails after writing `layers` layers is undone: the sequence
        reads as before it (the invariant), and later steps overwrite its slots."""
        store = self.store
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        if len(self.tokens[seq_id]) + n > 60:
            return
        new = [data.draw(st.integers(3, 60)) for _ in range(n)]
        start = store.num_tokens(seq_id)
        try:
            writes = store.extend([seq_id], n, [new])
        except OutOfBlocksError:
            return
        plans = [write_plan(store.runtime, w, 1) for w in writes]
        lay = store.layout
        for group in store.groups:
            for local, _layer in enumerate(group.layers[:layers]):
                k, v = _token_kv(
                    torch.tensor(new), start, local, group.index, lay.num_kv_heads, lay.head_dim
                )
                write_layer(plans[group.index], local, k[None] + 1.0, v[None] - 1.0)
        assert store.abort_step([seq_id]) == [seq_id]
        assert store.num_tokens(seq_id) == start

    @precondition(lambda self: 0 < len(self.tokens) < 4)
    @rule(data=st.data())
    def fork(self, data) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.tokens[self.store.fork(seq_id)] = list(self.tokens[seq_id])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.store.free(seq_id)
        del self.tokens[seq_id]

    @rule(device_slots=st.integers(12, 16))
    def evict(self, device_slots: int) -> None:
        try:
            self.store.manager.set_budget("device", device_slots)
        except Exception as exc:  # refused: too many open blocks for the new budget
            assert "budget" in str(exc)

    @rule()
    def restart(self) -> None:
        self.store.close()
        self._open()
        self.tokens.clear()

    @invariant()
    def contents_match_a_run_alone(self) -> None:
        store = self.store
        check_order(store.manager)
        lay = store.layout
        for seq_id, tokens in self.tokens.items():
            assert store.num_tokens(seq_id) == len(tokens)
            for group in store.groups:
                runs = store.runs(seq_id, group.index)
                if not runs:
                    continue
                start = runs[0].token_start
                if group.window is None:
                    assert start == 0
                else:  # a sliding group holds at least its window
                    assert start <= max(0, len(tokens) - group.window)
                for local in range(len(group.layers)):
                    got, _ = read_sequence(store.manager, (seq_id, group.index), local)
                    want, _ = _token_kv(
                        torch.tensor(tokens[start:]), start, local, group.index,
                        lay.num_kv_heads, lay.head_dim,
                    )  # fmt: skip
                    assert torch.equal(got, want), (seq_id, group.index, local)


TestStoreMachine = StoreMachine.TestCase
TestStoreMachine.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_persist_that_fails_gives_its_disk_slots_back(llama, tmp_path, monkeypatch):
    """Closing writes memory-only hashed blocks to disk; a copy that fails there (a full
    disk) gives the slots it took back and keys nothing."""
    from kvstrata.blocks.manager import BlockManager
    from kvstrata.core.errors import TierFullError

    model, prompts, refs, counter = llama
    cfg = _config(host_budget="4MiB", disk_dir=str(tmp_path), disk_budget="16MiB")
    store = KVStore(model.config, cfg)
    assert torch.equal(
        _greedy(model, prompts[0], TieredCache.from_store(store, prompts[0])), refs[0]
    )
    disk = store.disk_tier
    free = disk.num_free

    def full(self, *args, **kwargs):
        raise TierFullError("injected: no space left on device")

    monkeypatch.setattr(BlockManager, "copy_blocks", full)
    with pytest.raises(TierFullError):
        store.prefix_index.persist()
    assert disk.num_free == free and not disk.keyed_slots()
    monkeypatch.undo()
    assert store.prefix_index.persist() > 0  # and it works once the disk has room
    store.close()
