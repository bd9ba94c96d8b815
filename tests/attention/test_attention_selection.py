"""Query-aware key selection (`attention_budget`, Quest-style): each KV head attends
exactly the ranges it chose — wherever the blocks live — and nothing else is read; a
budget that covers the context is exact attention; the scores bound the logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DynamicCache

from hf_models import greedy_ids, seeded_ids, tiny_model
from kvstrata import CacheConfig, ConfigError, KVStore
from kvstrata.attention import runtime as runtime_mod
from kvstrata.attention.runtime import AttentionRuntime
from kvstrata.attention.selection import attend as selected_mod
from kvstrata.attention.selection.scores import (
    _scoring,
    choose_pages,
    choose_two_level,
    page_scores,
)
from kvstrata.attention.selection.selector import PAGE_TOKENS, KeySelector, _ranges, union
from kvstrata.attention.writes import write_layer, write_plan
from kvstrata.integrations.hf import TieredCache, enable
from kvstrata.model.geometry import KVGeometry
from kvstrata.platform import native as native_lib

HEADS, KV_HEADS, DIM, LAYERS = 4, 2, 8, 2
HISTORY = 320


def _geometry() -> KVGeometry:
    return KVGeometry(
        model_type="toy", num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV_HEADS,
        head_dim=DIM, v_head_dim=DIM, dtype="fp32",
    )  # fmt: skip


PLACEMENTS = {
    "device": {},
    "host": {"resident_fraction": 0.25, "host_budget": "1MiB"},
    "host-int8": {
        "resident_fraction": 0.25,
        "host_budget": "1MiB",
        "host_codec": "int8",
        "residual_tokens": 0,
    },  # fmt: skip
    "host-staged": {"resident_fraction": 0.25, "host_budget": "1MiB", "cold_attention": "stage"},
    "disk": {"resident_fraction": 0.25, "disk_budget": "4MiB"},
}


def _store(placement: str, tmp_path, **extra) -> KVStore:
    fields = dict(PLACEMENTS[placement], **extra)
    if "disk_budget" in fields:
        fields["disk_dir"] = str(tmp_path)
    cfg = CacheConfig(block_size=32, max_tokens=512, sink_tokens=4, **fields)
    store = KVStore(_geometry(), cfg)
    store.build(torch.float32)
    return store


def _step(store: KVStore, seq: int, kv: list[tuple[torch.Tensor, torch.Tensor]], lo: int, hi: int):
    """Store tokens [lo, hi) of every layer's k/v [Hkv, T, D]."""
    writes = store.extend([seq], hi - lo, [list(range(lo + 3, hi + 3))])
    plans = [write_plan(store.runtime, w, 1) for w in writes]
    for group in store.groups:
        for local, layer in enumerate(group.layers):
            k, v = kv[layer]
            write_layer(plans[group.index], local, k[None, :, lo:hi], v[None, :, lo:hi])


def _prefill(store: KVStore, seq: int, kv, attend: bool) -> None:
    """The history's K/V stored as one chunk; attended like a model's prefill (which
    summarises its pages as it goes) when `attend`."""
    _step(store, seq, kv, 0, HISTORY)
    if attend:
        q = torch.randn(HEADS, HISTORY, DIM, generator=torch.Generator().manual_seed(9))
        for layer in range(LAYERS):
            k, v = kv[layer]
            store.runtime.attend(
                layer, seq, q, k[:, :HISTORY], v[:, :HISTORY], 0.3, None, None, None, None
            )
    store.step_done([seq])


def _history(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(KV_HEADS, HISTORY + 1, DIM, generator=g) * 2,
         torch.randn(KV_HEADS, HISTORY + 1, DIM, generator=g))
        for _ in range(LAYERS)
    ]  # fmt: skip


def _reference(q, k, v, ranges_per_head, scale):
    """Each query head over its KV head's chosen keys, in fp64."""
    out = torch.empty(HEADS, DIM, dtype=torch.float64)
    for h in range(HEADS):
        kv_head = h // (HEADS // KV_HEADS)
        idx = torch.cat([torch.arange(a, b) for a, b in ranges_per_head[kv_head]])
        logits = (k[kv_head, idx].double() @ q[h, 0].double()) * scale
        out[h] = torch.softmax(logits, 0) @ v[kv_head, idx].double()
    return out


def _spy_ranges(monkeypatch, selector) -> list[tuple[str, np.ndarray]]:
    """Record (path, rows (head, lo, hi)) of the keys each selecting attention attends:
    "numpy" when the selector's ranges were attended piece by piece, "native" when one
    native call chose and attended them (its chosen pages, which must be the pages the
    numpy scoring chooses from the same summaries)."""
    seen: list[tuple[str, np.ndarray]] = []
    ranges = selector.ranges
    monkeypatch.setattr(
        selector, "ranges", lambda c, qp: seen.append(("numpy", ranges(c, qp))) or seen[-1][1]
    )
    native = selected_mod.native_select_attention

    def spy(q, desc, n, starts, summaries, page, pages, keys, *rest, score, coarse, channels):
        assert (page, score, channels) == (selector.page, selector.score, selector.channels)
        c0, c1, choose = pages
        chosen = np.empty((q.shape[0], choose), dtype=np.int64)
        out = native(
            q, desc, n, starts, summaries, page, pages, keys, *rest, chosen=chosen, score=score,
            coarse=coarse, channels=channels,
        )  # fmt: skip
        summaries = summaries.transpose(1, 2)  # channel-major as stored: [Hkv, pages, W]
        # the same pages as numpy's scoring (equal scores may be chosen either way)
        qs = _scoring(q, summaries.shape[-1], score, torch.device("cpu"), channels)
        scores = (summaries[:, c0:c1].float() @ qs.transpose(1, 2)).amax(-1)  # [Hkv, pages]
        if coarse is None:
            want = choose_pages(summaries[:, c0:c1], q, choose, score, channels)
        else:
            groups, group, refine = coarse
            assert group == selector.coarse
            want, _ = choose_two_level(
                summaries, groups.transpose(1, 2), q, c0, c1, choose, group, refine, score,
                channels,
            )  # fmt: skip
        got_s, want_s = (np.sort(np.take_along_axis(scores.numpy(), p, 1)) for p in (chosen, want))
        np.testing.assert_allclose(got_s, want_s, rtol=1e-5, atol=1e-5)
        seen.append(("native", _ranges(chosen, c0, *keys, page)))
        return out

    monkeypatch.setattr(selected_mod, "native_select_attention", spy)
    return seen


@pytest.mark.parametrize(
    ("summary", "attend_prefill", "page", "score"),
    [("minmax", True, 4, "max"), ("mean", False, 4, "max"), ("minmax", False, 8, "sum")],
)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_each_head_attends_exactly_its_chosen_keys_and_nothing_else_is_read(
    placement, summary, attend_prefill, page, score, tmp_path, monkeypatch
):
    store = _store(
        placement, tmp_path, attention_budget=96, attention_summary=summary,
        attention_page=page, attention_score=score,
    )  # fmt: skip
    seq, _ = store.add_sequence([])
    kv = _history(1)
    _prefill(store, seq, kv, attend_prefill)
    _step(store, seq, kv, HISTORY, HISTORY + 1)  # one decode token

    staged_reads = []
    chosen = _spy_ranges(monkeypatch, store.runtime.selector)
    views = selected_mod._views

    def spy_views(rt, local, pieces):
        for t0, k, v in views(rt, local, pieces):
            staged_reads.append((t0, t0 + k.shape[1]))
            yield t0, k, v

    monkeypatch.setattr(selected_mod, "_views", spy_views)
    summarising = []  # pages no prefill chunk summarised are read once, apart
    read_keys = runtime_mod.read_keys

    def spy_read_keys(*args):
        summarising.append(args[-2:])
        n = len(staged_reads)
        out = read_keys(*args)
        del staged_reads[n:]
        return out

    monkeypatch.setattr(runtime_mod, "read_keys", spy_read_keys)
    g = torch.Generator().manual_seed(2)
    scale = 1 / math.sqrt(DIM)
    lossy = PLACEMENTS[placement].get("host_codec") == "int8"
    for layer in range(LAYERS):
        q = torch.randn(HEADS, 1, DIM, generator=g)
        k, v = kv[layer]
        out = store.runtime.attend(
            layer, seq, q, k[:, HISTORY:], v[:, HISTORY:], scale, None, None, None, None
        )
        path, ranges_ = chosen[-1]
        # the native kernel reads every in-place placement; staged pieces go through torch
        in_place = native_lib.available() and placement not in ("host-staged", "disk")
        assert path == ("native" if in_place else "numpy")
        heads = [[(a, b) for h, a, b in ranges_.tolist() if h == kv] for kv in range(KV_HEADS)]
        for ranges in heads:
            assert sum(b - a for a, b in ranges) <= 96
            assert ranges[0][0] == 0 and ranges[-1][1] == HISTORY + 1  # sinks, newest
        ref = _reference(q, k, v, heads, scale)
        tol = 0.15 if lossy else 1e-5
        torch.testing.assert_close(out[:, 0].double(), ref, atol=tol, rtol=tol)
        wanted = union(ranges_)
        for lo, hi in staged_reads:  # every key read (staged or in place) was chosen
            assert any(a <= lo and hi <= b for a, b in wanted), (lo, hi, wanted)
        staged_reads.clear()
    stats = store.runtime.selector.stats.as_dict()
    assert stats["layers"] == LAYERS and stats["attended_share"] < 0.35
    # pages with no summary are read once: every whole page stored (those among the
    # newest keys too, so the next read waits until they leave the newest)
    whole = (HISTORY + 1) // page
    assert whole > store.runtime.selector.bounds(0, HISTORY + 1)[1] // page
    if attend_prefill:
        assert stats["pages_summarised_from_tiers"] == 0 and not summarising
    else:
        assert stats["pages_summarised_from_tiers"] == whole * LAYERS
        assert summarising == [(0, whole * page)] * LAYERS
    store.close()


def test_a_page_that_holds_the_querys_key_is_chosen_by_its_head(tmp_path, monkeypatch):
    """A key far more aligned with the query than any other lies in one page of one head:
    that head chooses the page (its bound is the largest); the other head need not."""
    store = _store("host", tmp_path, attention_budget=64)
    seq, _ = store.add_sequence([])
    kv = _history(3)
    q = torch.zeros(HEADS, 1, DIM)
    q[0, 0, 0] = 1.0  # query head 0 -> KV head 0
    needle = 150
    for layer in range(LAYERS):
        kv[layer][0][0, needle, 0] = 40.0
    _step(store, seq, kv, 0, HISTORY)
    store.step_done([seq])
    _step(store, seq, kv, HISTORY, HISTORY + 1)
    heads = _spy_ranges(monkeypatch, store.runtime.selector)
    k, v = kv[0]
    store.runtime.attend(0, seq, q, k[:, HISTORY:], v[:, HISTORY:], 1.0, None, None, None, None)
    assert any(h == 0 and a <= needle < b for h, a, b in heads[0][1].tolist())
    store.close()


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.01, 10.0))
def test_minmax_scores_bound_every_logit_of_their_page(seed, scale):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, 4 * PAGE_TOKENS, 8, generator=g) * scale
    q = torch.randn(2, 3, 8, generator=g)
    pages = keys.reshape(2, 4, PAGE_TOKENS, 8)
    scores = page_scores(q, torch.cat([pages.amax(2), pages.amin(2)], dim=-1))
    logits = torch.einsum("hrd,hptd->hprt", q, pages).amax(-1)
    assert bool((scores >= logits - 1e-4 * (1 + logits.abs())).all())


@pytest.mark.parametrize("placement", ["host", "disk"])
def test_a_budget_that_covers_the_context_is_token_identical_to_dynamic_cache(placement, tmp_path):
    model = tiny_model("llama", initializer_range=0.3)
    ids = seeded_ids(5, 300)
    ref = greedy_ids(model, ids, DynamicCache(config=model.config), 12)
    enable(model)
    fields = dict(PLACEMENTS[placement])
    if "disk_budget" in fields:
        fields["disk_dir"] = str(tmp_path)
    cache = TieredCache(model.config, block_size=16, max_tokens=512, attention_budget=512, **fields)
    assert torch.equal(greedy_ids(model, ids, cache, 12), ref)
    assert cache.store.runtime.selector.stats.layers == 0  # it never had to select
    cache.close()


def test_a_small_budget_selects_in_every_decode_and_reads_only_its_share():
    model = tiny_model("llama", initializer_range=0.3)
    enable(model)
    cache = TieredCache(
        model.config, block_size=16, max_tokens=1024, resident_fraction=0.25,
        host_budget="8MiB", attention_budget=0.25, attention_dense_layers=1,
    )  # fmt: skip
    out = greedy_ids(model, seeded_ids(6, 640), cache, 8)
    assert out.shape[1] == 648
    stats = cache.store.runtime.selector.stats.as_dict()
    layers = model.config.num_hidden_layers - 1  # all but the dense first layer
    assert stats["layers"] == 7 * layers  # every decode step after the first forward
    assert 0.15 < stats["attended_share"] <= 0.26
    cache.close()


@pytest.mark.parametrize("value", [0, -5, 1.0, 1.5, "x", True, 2048.0])
def test_a_bad_budget_is_one_line_naming_the_field(value):
    with pytest.raises(ConfigError, match=r"^attention_budget=.* is invalid: None \(exact"):
        CacheConfig(attention_budget=value)
    with pytest.raises(ConfigError, match="attention_summary"):
        CacheConfig(attention_summary="max")


def test_budgets_read_as_tokens_or_fractions():
    assert CacheConfig(attention_budget="1k").attention_budget == 1024
    assert CacheConfig(attention_budget="12.5%").attention_budget == 0.125
    assert CacheConfig(attention_budget=0.125).attention_budget == 0.125
    small = KeySelector(0.125, "minmax", 4, torch.device("cpu"))
    sink_end, recent_start, choose = small.bounds(0, 1024)
    page = PAGE_TOKENS
    assert (sink_end, recent_start, choose) == (page, 992, (128 - page - 32) // page)
    assert KeySelector(512, "minmax", 4, torch.device("cpu")).bounds(0, 300) is None


def test_the_engine_selects_per_sequence_and_batching_does_not_change_its_tokens():
    """Selection in the engine's packed steps: each sequence's decode chooses from its own
    query and pages (never the native batched call), so a request's tokens are the same
    alone and beside others; prompts over the budget do select."""
    from kvstrata.engine import Engine, EngineConfig, SamplingParams

    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(3, 97, (n,), generator=g).tolist() for n in (260, 300, 90, 330)]
    params = [SamplingParams(max_tokens=m) for m in (10, 14, 6, 12)]
    with Engine(
        tiny_model("llama", initializer_range=0.3),
        block_size=16, device_budget="64KiB", host_budget="8MiB", attention_budget=96,
        config=EngineConfig(max_batched_tokens=128, preemption="off"),
    ) as engine:  # fmt: skip
        together = engine.generate(ps, params)
        selected = engine.store.runtime.selector.stats.layers
        solo = [engine.generate([p], [sp])[0] for p, sp in zip(ps, params, strict=True)]
    assert selected > 0
    for a, b in zip(together, solo, strict=True):
        assert a.token_ids == b.token_ids and len(a.token_ids) > 0


@pytest.mark.parametrize("placement", ["device", "host"])
def test_dense_layers_attend_every_key_exactly_and_never_select(placement, tmp_path, monkeypatch):
    """attention_dense_layers=1: layer 0 attends all keys (no selection, no summaries),
    layer 1 selects."""
    store = _store(placement, tmp_path, attention_budget=96, attention_dense_layers=1)
    seq, _ = store.add_sequence([])
    kv = _history(3)
    _prefill(store, seq, kv, attend=True)
    _step(store, seq, kv, HISTORY, HISTORY + 1)
    selector = store.runtime.selector
    assert selector.dense_layers == 1
    layers_selected = []
    prepare = selector.prepare
    monkeypatch.setattr(
        selector, "prepare", lambda *a: layers_selected.append(a[3]) or prepare(*a)
    )  # a[3]: the local layer
    g = torch.Generator().manual_seed(5)
    scale = 1 / math.sqrt(DIM)
    for layer in range(LAYERS):
        q = torch.randn(HEADS, 1, DIM, generator=g)
        k, v = kv[layer]
        out = store.runtime.attend(
            layer, seq, q, k[:, HISTORY:], v[:, HISTORY:], scale, None, None, None, None
        )
        if layer == 0:
            every = [[(0, HISTORY + 1)]] * KV_HEADS
            ref = _reference(q, k, v, every, scale)
            torch.testing.assert_close(out[:, 0].double(), ref, atol=1e-5, rtol=1e-5)
    assert layers_selected == [1] and selector.stats.layers == 1
    entry = next(iter(selector._seqs.values()))
    assert entry.filled[0] == 0  # the dense layer's pages were never summarised
    store.close()


def test_dense_layers_covering_the_model_are_token_identical_to_dynamic_cache():
    model = tiny_model("llama", initializer_range=0.3)
    ids = seeded_ids(7, 300)
    ref = greedy_ids(model, ids, DynamicCache(config=model.config), 10)
    enable(model)
    cache = TieredCache(
        model.config, block_size=16, max_tokens=512, attention_budget=32,
        attention_dense_layers=model.config.num_hidden_layers,
    )  # fmt: skip
    assert torch.equal(greedy_ids(model, ids, cache, 10), ref)
    assert cache.store.runtime.selector.stats.layers == 0
    cache.close()


@pytest.mark.parametrize("value", [-1, True, 1.5, "2", None])
def test_a_bad_dense_layer_count_is_one_line_naming_the_field(value):
    with pytest.raises(ConfigError, match=r"^attention_dense_layers=.* is invalid: first layers"):
        CacheConfig(attention_dense_layers=value)
    assert CacheConfig().attention_dense_layers == 0


def test_bench_engine_decode_times_each_config_and_compares_its_tokens():
    """`bench selection --engine`: one engine computes the prompt once, then each
    configuration decodes from it cached; a budget that covers the context decodes full
    attention's tokens (agreement 1) and a small one selects; ratios are to the first
    configuration."""
    from kvstrata.bench._selection_engine import engine_decode

    model = tiny_model("llama", initializer_range=0.3)
    ids = seeded_ids(8, 300).tolist()[0]
    base = {"block_size": 16, "max_tokens": 512, "resident_fraction": 0.5, "host_budget": "8MiB"}
    configs = {
        "full": base,
        "covering": {**base, "attention_budget": 512},
        "small": {**base, "attention_budget": 64},
    }
    calls = []
    selected = []
    set_selection = AttentionRuntime.set_selection

    def spy(self, cc):
        set_selection(self, cc)
        selected.append(None if self.selector is None else self.selector.budget)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(AttentionRuntime, "set_selection", spy)
        rows = engine_decode(model, None, ids, configs, tokens=6, repeats=2, progress=calls.append)
    assert len(calls) == 6 and [r["config"] for r in rows] == ["full", "covering", "small"]
    # the store's construction, then each request's configuration in turn
    assert selected == [None, None, 512, 64, None, 512, 64]
    full, covering, small = rows
    assert full["decode_speedup"] == 1.0 and full["agreement"] == 1.0
    assert covering["agreement"] == 1.0  # exact attention: the same greedy tokens
    for r in rows:
        assert r["decode_ms"] > r["attention_ms"] > 0 and r["attention_speedup"] > 0
        assert r["cached_tokens"] == len(ids) // 16 * 16  # the prompt's full blocks, cached


def test_bench_selection_span_errors_and_longer_positions():
    """`bench selection`: a context past the model's positions, --positions below the
    context and --windows 0 with nothing else to measure are one-line errors naming the
    field; --positions P raises the model's limit to P."""
    from types import SimpleNamespace

    from kvstrata.bench.selection import _check_span

    cfg = SimpleNamespace(max_position_embeddings=8192)
    with pytest.raises(ConfigError, match=r"^context=32768 is invalid: at most .*\(8192\)"):
        _check_span(cfg, 32768, 1, 0, 0)
    with pytest.raises(ConfigError, match=r"^positions=16384 is invalid: at least the context"):
        _check_span(cfg, 32768, 0, 16384, 8)
    with pytest.raises(ConfigError, match=r"^windows=0 is invalid: .*--engine N or --needle"):
        _check_span(cfg, 4096, 0, 0, 0)
    _check_span(cfg, 8192, 1, 0, 0)
    assert cfg.max_position_embeddings == 8192
    _check_span(cfg, 32768, 0, 32768, 8)
    assert cfg.max_position_embeddings == 32768


@pytest.mark.parametrize("engine", ["1", "-2"])
def test_bench_selection_engine_of_one_token_is_a_one_line_error(engine, capsys):
    """--engine 1 decodes no step after the first token: nothing to time (it used to
    end in a StatisticsError traceback)."""
    from kvstrata.cli import main

    assert main(["bench", "selection", "--windows", "0", "--engine", engine]) == 2
    err = capsys.readouterr().err
    assert f"engine={engine} is invalid" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("field", "value"),
    [("attention_page", 0), ("attention_page", 257), ("attention_page", True),
     ("attention_page", 4.0), ("attention_page", "4"), ("attention_score", "mean"),
     ("attention_score", None)],
)  # fmt: skip
def test_a_bad_page_or_score_is_one_line_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"^{field}=.* is invalid: (keys per|one of max)"):
        CacheConfig(**{field: value})


def test_page_and_score_limits_and_defaults():
    """Pages of 1 and 256 keys are accepted; the defaults are the measured best (4, max)."""
    assert CacheConfig(attention_page=1).attention_page == 1
    assert CacheConfig(attention_page=256, attention_score="sum").attention_score == "sum"
    assert (CacheConfig().attention_page, CacheConfig().attention_score) == (PAGE_TOKENS, "max")
    sel = KeySelector(0.125, "minmax", 4, torch.device("cpu"), page=16)
    assert sel.bounds(0, 1024) == (16, 992, (128 - 16 - 32) // 16)


def test_max_and_sum_scores_choose_by_the_best_row_or_the_rows_summed():
    """A page one query row scores far above the rest wins under "max"; under "sum" a
    page every row scores moderately wins (the rows' other scores cancel it)."""
    dim = 4
    q = torch.tensor([[[10.0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0]]])  # [1 head, 3 rows, D]
    mean = torch.zeros(1, 2, dim)
    mean[0, 0] = torch.tensor([1.0, -4, -4, 0])  # row 0: 10, rows 1-2: -4 each -> sum 2
    mean[0, 1] = torch.tensor([0.5, 1, 1, 0])  # 5, 1, 1 -> sum 7
    assert choose_pages(mean, q, 1, "max").tolist() == [[0]]
    assert choose_pages(mean, q, 1, "sum").tolist() == [[1]]


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("attention_coarse", 1, "pages per group summary: 0"),
        ("attention_coarse", -2, "pages per group summary: 0"),
        ("attention_coarse", 300, "pages per group summary: 0"),
        ("attention_coarse", True, "pages per group summary: 0"),
        ("attention_refine", 0.5, "groups refined per page chosen"),
        ("attention_refine", float("nan"), "groups refined per page chosen"),
        ("attention_refine", float("inf"), "groups refined per page chosen"),
        ("attention_refine", "2", "groups refined per page chosen"),
        ("attention_channels", -1, "query channels each row scores"),
        ("attention_channels", 1.5, "query channels each row scores"),
        ("attention_channels", 5000, "query channels each row scores"),
    ],
)
def test_bad_two_level_or_channel_settings_are_one_line_errors(field, value, match):
    with pytest.raises(ConfigError, match=rf"^{field}=.* is invalid: {match}") as err:
        CacheConfig(**{field: value})
    assert "\n" not in str(err.value)
    cc = CacheConfig(attention_coarse=16, attention_refine=4, attention_channels=0)
    assert (cc.attention_coarse, cc.attention_refine, cc.attention_channels) == (16, 4.0, 0)
    assert CacheConfig().attention_channels == 16 and CacheConfig().attention_coarse == 0


def test_a_truncated_sequence_is_summarised_again_from_its_new_keys(tmp_path):
    """Truncating a sequence (crop, a failed forward undone) drops the summaries of the
    pages it cut: keys written at those positions afterwards are scored from their own
    summaries, not from the old keys'."""
    store = _store("host", tmp_path, attention_budget=96, attention_channels=0)
    seq, _ = store.add_sequence([])
    old, new = _history(1), _history(2)
    _prefill(store, seq, old, attend=True)  # pages 0 .. 79 summarised from `old`
    cut = 100
    store.truncate(seq, cut)
    kv = [(torch.cat([ko[:, :cut], kn[:, cut:]], 1), torch.cat([vo[:, :cut], vn[:, cut:]], 1))
          for (ko, vo), (kn, vn) in zip(old, new, strict=True)]  # fmt: skip
    _step(store, seq, kv, cut, HISTORY + 1)
    g = torch.Generator().manual_seed(4)
    for layer in range(LAYERS):
        k, v = kv[layer]
        q = torch.randn(HEADS, 1, DIM, generator=g)
        store.runtime.attend(
            layer, seq, q, k[:, HISTORY:], v[:, HISTORY:], 0.3, None, None, None, None
        )
    selector = store.runtime.selector
    entry = next(iter(selector._seqs.values()))
    page = selector.page
    for layer in range(LAYERS):
        k = kv[layer][0][:, : HISTORY // page * page].reshape(KV_HEADS, -1, page, DIM)
        want = torch.cat([k.amax(2), k.amin(2)], -1)  # [Hkv, pages, 2D]
        got = entry.data[layer].transpose(1, 2)[:, : want.shape[1]].float()
        torch.testing.assert_close(got, want.to(got.dtype).float(), atol=1e-2, rtol=1e-3)
    store.close()
