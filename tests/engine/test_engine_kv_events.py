"""The engine's KV events: one batch per step handed to its sink, starting with
AllBlocksCleared and what a persistent disk tier kept (a restart)."""

from __future__ import annotations

import threading

from hf_models import tiny_model
from kvstrata.engine import Engine, EngineConfig, SamplingParams
from kvstrata.store.events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 16


class ListSink:
    """Collects what the engine publishes (as a publisher would, from its thread)."""

    def __init__(self) -> None:
        self.batches: list[tuple[float, list]] = []
        self.thread = None

    def publish(self, ts, events) -> None:
        self.thread = threading.current_thread().name
        self.batches.append((ts, list(events)))


def _replay(batches) -> dict[bytes, set[str]]:
    view: dict[bytes, set[str]] = {}
    for _, events in batches:
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                view.clear()
            elif isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    view.setdefault(h, set()).add(ev.tier)
            else:
                for h in ev.block_hashes:
                    view[h].discard(ev.tier)
                    if not view[h]:
                        del view[h]
    return view


def _held(engine) -> dict[bytes, set[str]]:
    state = engine.store.manager.state
    return {h: {state.pool.blocks[b].tier} for h, b in state.hash_to_block._by_hash.items()}


def test_the_engine_publishes_each_steps_changes_and_a_restart_announces_the_disk(tmp_path):
    model = tiny_model("llama")
    prompt = list(range(3, 3 + 5 * BS + 3))
    fields = dict(block_size=BS, host_budget="1MiB", disk_dir=tmp_path, disk_budget="1MiB")
    sink = ListSink()
    config = EngineConfig(max_batched_tokens=32, preemption="off")
    with Engine(model, config=config, kv_events=sink, **fields) as engine:
        engine.generate([prompt], SamplingParams(max_tokens=4))
        assert engine.generate([prompt], SamplingParams(max_tokens=4))[0].token_ids
        held = _held(engine)
    assert sink.batches[0][1] == [AllBlocksCleared()]  # nothing on disk yet
    assert sink.thread == "kvstrata-engine"
    assert len(sink.batches) > 3  # a prefill in chunks of 32 tokens: a batch per step
    assert _replay(sink.batches) == held and len(held) >= 5
    assert all(ev.medium == "GPU" for _, evs in sink.batches[1:] for ev in evs)

    again = ListSink()
    with Engine(model, config=config, kv_events=again, **fields) as engine:
        first = again.batches[0][1]
        assert first[0] == AllBlocksCleared()
        on_disk = {h for ev in first[1:] for h in ev.block_hashes}
        assert on_disk == set(held) and {ev.medium for ev in first[1:]} == {"STORAGE"}
        engine.generate([prompt], SamplingParams(max_tokens=2))  # a hit from disk
        assert _replay(again.batches) == _held(engine)
    assert not any(isinstance(ev, BlockRemoved) for _, evs in sink.batches for ev in evs)


def test_without_a_sink_the_engine_records_nothing():
    with Engine(tiny_model("llama"), block_size=BS) as engine:
        engine.generate([list(range(3, 40))], SamplingParams(max_tokens=2))
        assert engine.store.prefix_index.events is None
        assert engine.store.manager.state.on_unindex is None
