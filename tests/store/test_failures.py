"""A step that fails is undone; a sequence that cannot be restored refuses further use;
a store is used by one thread; caches and stores release what they hold.

Failures are injected where they happen in practice: a block read that raises inside
the attention (a corrupt or unreadable block), an error in the model outside
kvstrata (an MLP), and an error while storing the step's K/V. After each, the cache
must be exactly as before the forward: the retried step's logits equal an
uninterrupted run's.
"""

from __future__ import annotations

import gc
import os
import threading

import pytest
import torch

from blockstore_harness import held_deleted_files, read_sequence
from hf_models import tiny_model
from kvstrata import CacheConfig, KVStore
from kvstrata.attention.runtime import AttentionRuntime
from kvstrata.attention.writes import write_layer, write_plan
from kvstrata.core.errors import BlockCorruptError, KvstrataError
from kvstrata.integrations.hf import TieredCache, enable

STEPS = 8
FAIL_AT = 3  # the decode step whose forward raises once


def _prompt(n: int, seed: int = 5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 97, (1, n), generator=g)


def _cache(model, tmp_path, **kw) -> TieredCache:
    fields = dict(
        block_size=16,
        max_tokens=1024,
        resident_fraction=0.25,
        host_budget="64KiB",
        disk_dir=str(tmp_path),
        disk_budget="4MiB",
    )
    fields.update(kw)
    return TieredCache(model.config, **fields)


@torch.no_grad()
def _decode(model, cache, prompt: torch.Tensor, fail=None) -> list[torch.Tensor]:
    """Prefill + STEPS greedy steps; `fail(step)` arms a one-shot failure for a step.
    A failed forward is retried with the same input after checking the length."""
    out = model(input_ids=prompt, cache=cache)
    logits = [out.logits[0, -1]]
    tok = logits[-1].argmax().view(1, 1)
    for step in range(STEPS):
        if fail is not None and step == FAIL_AT:
            before = cache.get_seq_length()
            with fail(), pytest.raises(BaseException, match="injected"):
                model(input_ids=tok, cache=cache)
            if cache._in_forward:  # a KeyboardInterrupt: forward hooks do not see it,
                assert cache.get_seq_length() == before + 1  # the next forward undoes it
            else:
                assert cache.get_seq_length() == before, "the failed step was not undone"
        out = model(input_ids=tok, cache=cache)
        logits.append(out.logits[0, -1])
        tok = logits[-1].argmax().view(1, 1)
    return logits


def _step(store: KVStore, seq: int, n: int, seed: int, tokens: list[int] | None = None) -> None:
    """Extend a sequence by n tokens and write random K/V for them in every layer."""
    lay = store.layout
    writes = store.extend([seq], n, None if tokens is None else [tokens])
    g = torch.Generator().manual_seed(seed)
    for group, group_writes in zip(store.groups, writes, strict=True):
        plan = write_plan(store.runtime, group_writes, 1)
        for local in range(len(group.layers)):
            shape = (1, lay.num_kv_heads, n, lay.head_dim)
            write_layer(plan, local, torch.randn(shape, generator=g), torch.randn(shape))


class _Once:
    """Patch `owner.name` so its `layer`-th call of the armed step raises once."""

    def __init__(self, owner, name: str, exc: BaseException, call: int = 1) -> None:
        self.owner, self.name, self.exc, self.call = owner, name, exc, call

    def __enter__(self):
        real = getattr(self.owner, self.name)
        count = [0]

        def broken(*args, **kwargs):
            count[0] += 1
            if count[0] == self.call + 1:
                raise self.exc
            return real(*args, **kwargs)

        self.real = real
        setattr(self.owner, self.name, broken)
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.owner, self.name, self.real)


@pytest.fixture(scope="module")
def llama():
    model = tiny_model("llama", num_hidden_layers=3)
    enable(model)
    return model


@pytest.mark.parametrize("where", ["attention", "mlp", "store_write", "output_head", "interrupt"])
def test_a_failed_step_is_undone_and_the_retry_is_exact(llama, tmp_path, where):
    model = llama
    prompt = _prompt(150)
    with _cache(model, tmp_path / "ref") as ref_cache:
        want = _decode(model, ref_cache, prompt)
    fail = {
        # a block read raising inside layer 1's attention (after layer 0 ran)
        "attention": lambda: _Once(
            AttentionRuntime, "attend", BlockCorruptError("injected corrupt block")
        ),
        # the model itself failing outside kvstrata, after the K/V of layer 0 went in
        "mlp": lambda: _Once(
            model.model.layers[1].mlp, "forward", RuntimeError("injected MLP failure"), 0
        ),
        # storing layer 2's K/V failing (e.g. a full disk)
        "store_write": lambda: _Once(TieredCache, "_update", OSError("injected write failure"), 2),
        # after the last layer (its step already done): the output head fails
        "output_head": lambda: _Once(model.lm_head, "forward", RuntimeError("injected"), 0),
        # an interrupt in the model, which torch's forward hooks do not see
        "interrupt": lambda: _Once(
            model.model.layers[1].mlp, "forward", KeyboardInterrupt("injected"), 0
        ),
    }[where]
    with _cache(model, tmp_path / "run") as cache:
        got = _decode(model, cache, prompt, fail)
        for step, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), f"step {step}: logits differ"
        assert cache.store.stats()["initialized"]


def test_abort_step_undoes_an_unfinished_step_without_transformers(llama):
    """The store API: a step that failed is undone by abort_step; a step without
    step_done (K/V filled by direct writes) is kept but never indexed."""
    store = KVStore(llama.config, CacheConfig(block_size=16, max_tokens=512))
    store.build(torch.float32)
    seq, _ = store.add_sequence(list(range(3, 40)))
    _step(store, seq, 37, 0, list(range(3, 40)))
    store.step_done([seq])
    _step(store, seq, 5, 1, [7] * 5)  # the forward that fails
    assert store.num_tokens(seq) == 42
    assert store.abort_step() == [seq]
    assert store.num_tokens(seq) == 37
    _step(store, seq, 1, 2, [9])  # the retry
    assert store.num_tokens(seq) == 38
    store.step_done([seq])
    store.close()


def test_aborting_a_sliding_step_that_skipped_its_window_restores_the_history():
    """A prefill chunk longer than the window drops the old blocks only at the end of
    the step; aborting it must bring them back (the next step's queries see them)."""
    model = tiny_model("mistral")  # window 48
    cfg = CacheConfig(block_size=8, max_tokens=1024, host_budget="1MiB")
    store = KVStore(model.config, cfg)
    store.build(torch.float32)
    seq, _ = store.add_sequence(None)

    def step(n: int, seed: int) -> None:
        _step(store, seq, n, seed)

    step(60, 0)
    store.step_done([seq])
    before = [read_sequence(store.manager, (seq, 0), layer) for layer in range(2)]
    step(200, 1)  # past the window: the history is held for this step only
    assert store.num_tokens(seq) == 260
    assert store.abort_step([seq]) == [seq]
    assert store.num_tokens(seq) == 60
    for layer in range(2):
        k, v = read_sequence(store.manager, (seq, 0), layer)
        assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1])
    step(1, 2)  # usable again
    store.step_done([seq])
    store.close()


def test_a_full_disk_during_a_prefill_is_undone_and_the_retry_is_exact(llama, tmp_path):
    """Blocks that spill straight to the disk tier in a long prefill: the disk fails
    at its second layer write; the retried prefill equals an undisturbed one."""
    from kvstrata.core.errors import TierFullError
    from kvstrata.tiers.disk import DiskTier

    model = llama
    prompt = _prompt(600)
    small = dict(resident_fraction=0.1, host_budget="16KiB")
    with _cache(model, tmp_path / "ref", **small) as ref:
        want = _decode(model, ref, prompt)
    with _cache(model, tmp_path / "run", **small) as cache:
        with (
            _Once(DiskTier, "write_layer", TierFullError("injected: disk full"), 1),
            pytest.raises(TierFullError),
            torch.no_grad(),
        ):
            model(input_ids=prompt, cache=cache)
        assert cache.get_seq_length() == 0
        assert not cache.store.disk_tier._pending  # the failed step's layers are gone
        got = _decode(model, cache, prompt)
        assert cache.stats()["tiers"]["disk"]["used_blocks"] > 0
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_a_failed_move_to_disk_leaves_the_store_as_it_was(llama, tmp_path):
    """A storage error while a step moves blocks down to the disk tier: the step is
    refused with every table and slot as before, and the next try goes through."""
    from blockstore_harness import check_accounting
    from kvstrata.core.errors import TierFullError
    from kvstrata.tiers.disk import DiskTier

    cfg = CacheConfig(
        block_size=16, max_tokens=1024, resident_fraction=0.1, host_budget="16KiB",
        disk_dir=str(tmp_path), disk_budget="4MiB",
    )  # fmt: skip
    store = KVStore(llama.config, cfg)
    store.build(torch.float32)
    seq, _ = store.add_sequence(None)
    _step(store, seq, 16, 0)
    store.step_done([seq])
    moved = store.manager.state.bytes_moved.get("host->disk", 0)
    failing = [
        _Once(DiskTier, name, TierFullError("injected: disk full"), 0)
        for name in ("write_encoded", "write_blocks")
    ]
    with failing[0], failing[1], pytest.raises(TierFullError):  # noqa: PT012
        for i in range(1, 40):  # until a step has to move blocks down to the disk
            before = [read_sequence(store.manager, (seq, 0), layer) for layer in range(3)]
            n = store.num_tokens(seq)
            _step(store, seq, 16, i)
            store.step_done([seq])
    assert store.manager.state.bytes_moved.get("host->disk", 0) == moved
    assert store.num_tokens(seq) == n
    check_accounting(store.manager)
    for layer in range(3):
        k, v = read_sequence(store.manager, (seq, 0), layer)
        assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1])
    _step(store, seq, 16, 200)
    store.step_done([seq])
    assert store.num_tokens(seq) == n + 16
    assert store.manager.state.bytes_moved.get("host->disk", 0) > moved
    store.close()


def test_aborting_a_first_prefill_past_the_window():
    """The first step of a sliding-window sequence is longer than its window (no
    history to hold): aborting it leaves an empty, usable sequence."""
    model = tiny_model("mistral")  # window 48
    store = KVStore(model.config, CacheConfig(block_size=8, max_tokens=1024, host_budget="1MiB"))
    store.build(torch.float32)
    seq, _ = store.add_sequence(None)
    _step(store, seq, 200, 0)
    assert store.abort_step([seq]) == [seq]
    assert store.num_tokens(seq) == 0
    _step(store, seq, 10, 1)
    store.step_done([seq])
    assert store.num_tokens(seq) == 10
    store.close()


def test_a_sequence_that_cannot_be_restored_refuses_further_use(llama, monkeypatch):
    store = KVStore(llama.config, CacheConfig(block_size=16, max_tokens=512))
    store.build(torch.float32)
    seq, _ = store.add_sequence(None)
    store.extend([seq], 20, None)

    def cannot(*args, **kwargs):
        raise KvstrataError("injected: cannot restore")

    monkeypatch.setattr(store.manager, "abort_step", cannot)
    assert store.abort_step([seq]) == []
    with pytest.raises(KvstrataError, match=f"sequence {seq} is unusable"):
        store.extend([seq], 1, None)
    with pytest.raises(KvstrataError, match="unusable"):
        store.fork(seq)
    store.free(seq)  # freeing is always allowed
    store.close()


def test_a_cache_used_from_a_second_thread_is_refused(llama, tmp_path):
    model = llama
    prompt = _prompt(40)
    cache = _cache(model, tmp_path)
    with torch.no_grad():
        model(input_ids=prompt, cache=cache)
    errors: list[BaseException] = []

    def other():
        try:
            with torch.no_grad():
                model(input_ids=prompt[:, :1], cache=cache)
        except BaseException as err:  # noqa: BLE001 - collected for the assertion
            errors.append(err)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], KvstrataError), errors
    assert "not thread-safe" in str(errors[0])
    # the owner thread goes on undisturbed
    with torch.no_grad():
        model(input_ids=prompt[:, :1], cache=cache)
    assert cache.get_seq_length() == 41
    cache.close()


def test_one_cache_per_thread_is_exact(llama, tmp_path):
    """Caches created in the main thread, each used by one worker thread."""
    model = llama
    prompts = [_prompt(80, seed) for seed in range(4)]
    want = []
    for i, p in enumerate(prompts):
        with _cache(model, tmp_path / f"ref{i}") as c:
            want.append(_decode(model, c, p))
    caches = [_cache(model, tmp_path / f"t{i}") for i in range(4)]
    got: dict[int, list] = {}

    def work(i: int) -> None:
        got[i] = _decode(model, caches[i], prompts[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        assert [x.argmax() for x in got[i]] == [x.argmax() for x in want[i]]
        for a, b in zip(got[i], want[i], strict=True):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    for c in caches:
        c.close()  # from the main thread, once the workers are done


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_create_use_close_cycles_leak_nothing(llama, tmp_path):
    """1,000 stores with a disk tier built, used and closed: descriptors and memory
    flat, nothing left on disk once the directories are removed."""
    import shutil

    geometry = llama.config

    def cycle(i: int) -> None:
        d = tmp_path / f"c{i}"
        cfg = CacheConfig(
            block_size=16, max_tokens=256, resident_fraction=0.25, host_budget="16KiB",
            disk_dir=str(d), disk_budget="1MiB",
        )  # fmt: skip
        with KVStore(geometry, cfg) as store:
            store.build(torch.float32)
            seq, _ = store.add_sequence(list(range(3, 103)))
            _step(store, seq, 100, i, list(range(3, 103)))
            store.step_done([seq])
        shutil.rmtree(d)

    for i in range(50):  # warm-up: allocator pools, native libraries, sqlite
        cycle(i)
    gc.collect()
    fds, rss = _open_fds(), _rss_bytes()
    for i in range(50, 1050):
        cycle(i)
    gc.collect()
    assert _open_fds() <= fds, "file descriptors leaked"
    assert _rss_bytes() <= rss * 1.05, f"RSS grew from {rss} to {_rss_bytes()}"
    assert not held_deleted_files(tmp_path)  # nothing open or mapped after rmtree


def test_a_dropped_cache_closes_its_store(llama, tmp_path):
    fds = _open_fds()
    for i in range(20):
        cache = _cache(llama, tmp_path / f"d{i}")
        with torch.no_grad():
            llama(input_ids=_prompt(40), cache=cache)
        del cache
        gc.collect()
    assert _open_fds() <= fds


def test_handover_passes_a_store_to_another_thread(llama):
    store = KVStore(llama.config, CacheConfig(block_size=16, max_tokens=256))
    store.build(torch.float32)
    made: list[int] = []
    worker = threading.Thread(target=lambda: made.append(store.add_sequence(None)[0]))
    worker.start()
    worker.join()
    with pytest.raises(KvstrataError, match="not thread-safe"):
        store.extend(made, 1, None)
    store.handover()  # the worker is done: this thread takes the store over
    _step(store, made[0], 3, 0)
    store.step_done(made)
    assert store.num_tokens(made[0]) == 3
    store.close()
