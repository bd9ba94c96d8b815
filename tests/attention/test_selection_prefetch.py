"""Predictive prefetch for query-aware selection over staged tiers (`attention_prefetch`):
each (block, layer) unit a step's chosen keys touch is read once; the units predicted for
the next step are held (or fetched ahead) within the budget; tokens and logits are the
same bit for bit whatever the policy; hits, misses, waste and stalls are reported."""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import pytest
import torch

from hf_models import seeded_ids, tiny_model
from kvstrata import CacheConfig, ConfigError
from kvstrata.attention.selection import attend as attend_mod
from kvstrata.attention.selection.prefetch import DECAY, THRESHOLD, SelectionPrefetcher
from kvstrata.integrations.hf import TieredCache, enable
from kvstrata.model.budgets import placement

BS = 16
PLACEMENTS = {
    "disk": {"resident_fraction": 0.1, "disk_budget": "16MiB"},
    "host-staged": {"resident_fraction": 0.1, "host_budget": "16MiB", "cold_attention": "stage"},
}


def _model():
    model = tiny_model("llama", initializer_range=0.3)
    enable(model)
    return model


def _generate(model, ids, tmp_path, name, where="disk", new=10, **fields):
    """Greedy tokens and every step's logits through a TieredCache selecting a quarter
    of the context over `where`, and its selection stats."""
    place = dict(PLACEMENTS[where])
    if "disk_budget" in place:
        place["disk_dir"] = str(tmp_path / name)
    cache = TieredCache(
        model.config, block_size=BS, max_tokens=1024, attention_budget=0.25, **place, **fields
    )
    out = model.generate(
        ids, cache=cache, max_new_tokens=new, min_new_tokens=new, do_sample=False,
        output_scores=True, return_dict_in_generate=True,
    )  # fmt: skip
    stats = cache.stats()["selection"]
    prefetch = cache.store.runtime.prefetch
    cache.close()
    stats["held_after_close"] = prefetch.stats.held_bytes
    return out.sequences, torch.stack(out.scores), stats, prefetch.unit_bytes


@pytest.mark.parametrize("where", list(PLACEMENTS))
def test_prediction_holds_the_next_steps_units_and_changes_no_logit(where, tmp_path):
    model = _model()
    ids = seeded_ids(11, 600)
    runs = {p: _generate(model, ids, tmp_path, p, where, attention_prefetch=p) for p in
            ("off", "last", "learned")}  # fmt: skip
    seq, scores, off, _ = runs["off"]
    layers = model.config.num_hidden_layers
    assert off["layers"] == 9 * layers  # every decode step after the prompt selected
    pf = off["prefetch"]
    assert pf["policy"] == "off" and pf["hits"] == 0 and pf["held_bytes"] == 0
    assert pf["misses"] == pf["needed"] > 0 and pf["attentions"] == 9 * layers
    for policy in ("last", "learned"):
        got, got_scores, stats, unit = runs[policy]
        assert torch.equal(got, seq) and torch.equal(got_scores, scores)  # bit for bit
        p = stats["prefetch"]
        assert p["policy"] == policy and p["needed"] == pf["needed"]  # the same choices
        assert p["hits"] + p["misses"] == p["needed"]
        # the first decode holds nothing yet; later ones find most units held
        assert p["hit_rate"] > 0.5 and p["misses"] < pf["misses"] / 2
        assert p["read_bytes"] < pf["read_bytes"] / 2
        assert p["read_bytes"] == (p["misses"] + p["fetched_ahead"]) * unit
        assert 0 < p["peak_held_bytes"] <= 2**30
        assert p["held_bytes"] > 0 and stats["held_after_close"] == 0
    assert off["keys_attended"] == runs["last"][2]["keys_attended"]


def test_units_read_are_whole_blocks_each_holding_a_chosen_key(tmp_path, monkeypatch):
    """What the staged path reads: only blocks where some head chose a key, each once
    per layer and step, and the mask attends exactly the chosen keys in them."""
    model = _model()
    seen = []
    gather = SelectionPrefetcher.gather

    def spy(self, key, table, local, needs, weights, read, attend, locate):
        blocks = [n[0] for n in needs]
        assert blocks == sorted(set(blocks))  # each unit once, in block order
        assert all(w > 0 for w in weights)  # each holds a chosen key
        seen.append(len(needs))
        return gather(self, key, table, local, needs, weights, read, attend, locate)

    masks = []
    masked = attend_mod._masked_partial

    def spy_mask(qp, k, v, allowed, scale, softcap):
        if inside:  # the staged units' one attention (not the other pieces')
            masks.append(allowed.clone())
        return masked(qp, k, v, allowed, scale, softcap)

    inside = []
    gather_spied = spy

    def flagged(*args):
        inside.append(True)
        try:
            return gather_spied(*args)
        finally:
            inside.clear()

    monkeypatch.setattr(SelectionPrefetcher, "gather", flagged)
    monkeypatch.setattr(attend_mod, "_masked_partial", spy_mask)
    _, _, stats, _ = _generate(model, seeded_ids(12, 600), tmp_path, "a", new=3)
    assert seen and sum(seen) == stats["prefetch"]["needed"]
    assert len(masks) == len(seen)  # one attention per layer and step
    for m in masks:  # every unit read has a key chosen in it
        assert bool(m.reshape(m.shape[0], -1, BS).any(-1).any(0).all())


# -- the predictor itself, on fake units ----------------------------------------------------


class _Reads:
    """A tier of fake units: unit b holds the value b everywhere; reads counted."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[int]]] = []

    def read(self, tier: str, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append((tier, list(slots)))
        k = torch.cat([torch.full((1, BS, 2), float(s)) for s in slots], dim=1)
        return k, k.clone()


def _done(fn, nbytes) -> Future:
    f: Future = Future()
    f.set_result(fn())
    return f


def _prefetcher(policy: str, units: int = 100) -> SelectionPrefetcher:
    return SelectionPrefetcher(
        policy, units * 64, 64, 1, BS, torch.device("cpu"), _done, lambda f: f.result()
    )


def _step(pf, reads, blocks, table="t", valid=BS, key="s"):
    """One gather of units `blocks` (slot = 100 + block): the attended pieces' blocks."""
    got = []
    needs = [(b, "disk", 100 + b, valid) for b in blocks]
    pf.gather(
        key, table, 0, needs, np.ones(len(blocks)), reads.read,
        lambda pieces: got.extend(int(k[0, 0, 0]) - 100 for _, k, _ in pieces),
        lambda b: ("disk", 100 + b),
    )  # fmt: skip
    return got


def test_off_reads_every_unit_each_step_in_one_call_per_tier():
    pf, reads = _prefetcher("off"), _Reads()
    assert _step(pf, reads, [1, 2, 5]) == [1, 2, 5]
    assert _step(pf, reads, [1, 2, 5]) == [1, 2, 5]
    assert reads.calls == [("disk", [101, 102, 105])] * 2
    assert pf.stats.hits == 0 and pf.stats.held_bytes == 0


def test_last_holds_what_the_step_read_and_reads_only_new_units():
    pf, reads = _prefetcher("last"), _Reads()
    _step(pf, reads, [1, 2, 5])
    assert _step(pf, reads, [2, 5, 7]) == [2, 5, 7]  # every unit attended, in block order
    assert reads.calls[-1] == ("disk", [107])
    assert (pf.stats.hits, pf.stats.misses) == (2, 4)
    assert pf.stats.held_bytes == 3 * 64  # 1 went: the step did not read it
    # a partial block (its newest keys still change) is never held
    _step(pf, reads, [9], valid=BS - 3)
    _step(pf, reads, [9], valid=BS - 2)
    assert reads.calls[-2:] == [("disk", [109])] * 2


def test_held_units_go_with_a_cut_or_a_new_table():
    pf, reads = _prefetcher("last"), _Reads()
    _step(pf, reads, [1, 2, 5])
    pf.truncate("s", 3 * BS)  # keeps tokens [0, 48): blocks 0..2
    _step(pf, reads, [1, 2, 5])
    assert reads.calls[-1] == ("disk", [105])
    _step(pf, reads, [1, 2, 5], table="another")  # a new sequence under the same key
    assert reads.calls[-1] == ("disk", [101, 102, 105])
    pf.forget(lambda key: None)  # the sequence left
    assert pf.stats.held_bytes == 0


def test_learned_keeps_frequent_units_through_a_skip_and_fetches_ahead():
    pf, reads = _prefetcher("learned", units=2), _Reads()
    _step(pf, reads, [1, 2, 3, 4])
    _step(pf, reads, [1, 2, 3, 4])  # a budget of 2 units: two held, two not
    assert pf.stats.held_bytes == 2 * 64
    held = set(pf._layers[("s", 0)].units)
    pf.budget = 4 * 64  # room again: the predicted units not held are fetched ahead
    _step(pf, reads, sorted(held))
    assert pf.stats.fetched_ahead == 2 and pf.stats.held_bytes == 4 * 64
    pf.settle()
    n = len(reads.calls)
    others = sorted({1, 2, 3, 4} - held)
    assert _step(pf, reads, others) == others and len(reads.calls) == n  # no read
    assert pf.stats.wasted_units == 0
    # read in one step only: not predicted after a step that skips it
    pf.budget = 10 * 64
    score = 1 - DECAY
    assert score >= THRESHOLD > score * DECAY
    _step(pf, reads, [8])
    _step(pf, reads, others)
    assert 8 not in pf._layers[("s", 0)].units
    for _ in range(4):  # the units read ahead were used: dropped now, they are no waste
        _step(pf, reads, sorted(held))
    assert not set(others) & set(pf._layers[("s", 0)].units)
    assert pf.stats.wasted_units == 0


def test_units_fetched_ahead_and_dropped_unused_count_as_waste():
    pf, reads = _prefetcher("learned", units=2), _Reads()
    _step(pf, reads, [1, 2, 3, 4])
    _step(pf, reads, [1, 2, 3, 4])
    held = sorted(pf._layers[("s", 0)].units)
    pf.budget = 4 * 64
    _step(pf, reads, held)  # the other two fetched ahead
    for _ in range(3):  # ... and never asked for again: their scores fall, they go
        _step(pf, reads, held)
    assert pf.stats.wasted_units == 2 and pf.stats.wasted_bytes == 2 * 64
    assert pf.stats.as_dict()["precision"] < 1


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("attention_prefetch", "next", r"^attention_prefetch='next' is invalid: one of off, last"),
        ("attention_prefetch", None, r"^attention_prefetch=None is invalid"),
        ("attention_prefetch_budget", "lots", r"^attention_prefetch_budget='lots' is invalid"),
        ("attention_prefetch_budget", -1, r"^attention_prefetch_budget=-1 is invalid"),
    ],
)
def test_bad_prefetch_settings_are_one_line_naming_the_field(field, value, match):
    with pytest.raises(ConfigError, match=match) as err:
        CacheConfig(**{field: value})
    assert "\n" not in str(err.value)


def test_the_counters_reach_the_engines_metrics(tmp_path):
    from kvstrata.engine.metrics import EngineMetrics

    model = _model()
    cache = TieredCache(
        model.config, block_size=BS, max_tokens=1024, attention_budget=0.25,
        attention_prefetch="last", disk_dir=str(tmp_path), **PLACEMENTS["disk"],
    )  # fmt: skip
    model.generate(seeded_ids(14, 500), cache=cache, max_new_tokens=4, do_sample=False)
    stats = cache.store.stats()
    pf = stats["selection"]["prefetch"]
    metrics = EngineMetrics(lambda: {"store": stats})
    assert metrics.value("kvstrata_selection_prefetch_hits_total") == pf["hits"] > 0
    assert metrics.value("kvstrata_selection_prefetch_misses_total") == pf["misses"]
    assert metrics.value("kvstrata_selection_prefetch_read_bytes_total") == pf["read_bytes"]
    assert metrics.value("kvstrata_selection_prefetch_wasted_bytes_total") == 0
    assert metrics.value("kvstrata_selection_prefetch_held_bytes") == pf["held_bytes"] > 0
    assert metrics.value("kvstrata_selection_prefetch_hit_rate") == pytest.approx(pf["hit_rate"])
    assert metrics.value("kvstrata_selection_prefetch_stall_seconds_total") >= 0
    cache.close()


def test_placement_puts_a_share_of_the_kv_on_disk(tmp_path):
    model = tiny_model("llama")
    half = placement(model, 1024, resident=0.1, block_size=BS, disk_dir=str(tmp_path))
    most = placement(
        model, 1024, resident=0.1, block_size=BS, disk_dir=str(tmp_path), disk_share=0.9
    )
    assert half["host_budget"] > 0 and most["host_budget"] == 0
    assert most["disk_budget"] > half["disk_budget"]
    with pytest.raises(ConfigError, match="^disk_share="):
        placement(model, 1024, resident=0.1, disk_dir=str(tmp_path), disk_share=1.5)


def test_bench_engine_rows_compare_prediction_with_the_same_budget_without(tmp_path):
    from kvstrata.bench._selection_engine import engine_decode

    model = _model()
    ids = seeded_ids(15, 500).tolist()[0]
    base = {"block_size": BS, "max_tokens": 1024, **PLACEMENTS["disk"], "disk_dir": str(tmp_path)}
    sel = {**base, "attention_budget": 0.25}
    configs = {"full": base, "sel": sel, "sel last": {**sel, "attention_prefetch": "last"}}
    rows = engine_decode(
        model, None, ids, configs, tokens=6, repeats=1, same_as={"sel last": "sel"}
    )
    full, off, last = rows
    assert full["prefetch"] is None and last["same_as_base"] == 1.0
    assert off["prefetch"]["hits"] == 0 and off["prefetch"]["misses"] > 0
    assert (
        last["prefetch"]["hit_rate"] > 0.3
        and last["prefetch"]["needed"] == off["prefetch"]["needed"]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--prefetch", "off,soon"], "attention_prefetch='soon' is invalid"),
        (["--prefetch", "last:lots"], "attention_prefetch_budget='lots' is invalid"),
        (["--disk", "--disk-share", "1.5"], "disk_share=1.5 is invalid"),
        (["--disk-share", "0.9"], "disk_share=0.9 is invalid: it needs the disk tier"),
        (["--o-direct"], "o_direct=True is invalid: it needs the disk tier"),
    ],
)
def test_bench_selection_prediction_flags_are_one_line_errors(args, message, capsys):
    from kvstrata.cli import main

    assert main(["bench", "selection", "--windows", "0", "--engine", "4", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
