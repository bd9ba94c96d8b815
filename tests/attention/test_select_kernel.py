"""The native query-aware decode kernel (platform/csrc/select.cpp) on its own: it chooses
the pages the numpy scoring chooses, attends exactly those keys with the sinks and the
newest ones — across part boundaries, with fp32 and fp16 summaries, a page scored by its
best query row or by their sum, on one thread and on several — and refuses what it
cannot do. (Quantized parts: test_attention_selection's
host-int8 placement goes through this kernel.)"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from kvstrata.attention.native import native_select_attention, raw_field
from kvstrata.attention.selection.scores import _scoring, choose_pages, choose_two_level
from kvstrata.attention.selection.selector import _ranges
from kvstrata.core.formats import PartDesc
from kvstrata.platform.native import available

pytestmark = pytest.mark.skipif(not available(), reason="the native library did not build")

HKV, M, D, PAGE = 3, 4, 16, 8


def _summaries(k: torch.Tensor, kind: str, dtype: torch.dtype, page: int = PAGE) -> torch.Tensor:
    pages = k.reshape(HKV, -1, page, D)
    minmax = torch.cat([pages.amax(2), pages.amin(2)], dim=-1)
    return (minmax if kind == "minmax" else pages.mean(2)).to(dtype).contiguous()


def _cm(summaries: torch.Tensor) -> torch.Tensor:
    """Summaries [Hkv, pages, W] as the kernel reads them: channel-major [Hkv, W, pages]."""
    return summaries.transpose(1, 2).contiguous()


def _terms(q, summaries, score="max", channels=0) -> int:
    """Summary values each page's scoring reads, over the heads (nonzero coefficients)."""
    vectors = _scoring(q, summaries.shape[-1], score, torch.device("cpu"), channels)
    return int(torch.count_nonzero(vectors))


def _reference(q, k, v, rows, scale):
    """fp64 attention of each KV head's packed queries over its ranges (rows head, lo, hi)."""
    out = torch.empty(HKV, M, D, dtype=torch.float64)
    for h in range(HKV):
        idx = torch.cat([torch.arange(a, b) for hh, a, b in rows.tolist() if hh == h])
        logits = q[h].double() @ k[h, idx].double().T * scale
        out[h] = torch.softmax(logits, -1) @ v[h, idx].double()
    return out


def _parts(k, v, cuts):
    """Raw parts of keys [cuts[i], cuts[i + 1]) as a PartDesc array and its first keys."""
    parts = [
        (b - a, raw_field(k[:, a:b]), raw_field(v[:, a:b]))
        for a, b in zip(cuts, cuts[1:], strict=False)
    ]
    return (PartDesc * len(parts))(*parts), np.array(cuts[:-1], dtype=np.int64)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["minmax", "mean"])
@pytest.mark.parametrize("score", ["max", "sum"])
def test_it_attends_the_pages_numpy_chooses_with_the_sinks_and_the_newest(
    score, kind, dtype, threads
):
    g = torch.Generator().manual_seed(1)
    total = 1000
    k = torch.randn(HKV, total, D, generator=g) * 2
    v = torch.randn(HKV, total, D, generator=g)
    q = torch.randn(HKV, M, D, generator=g)
    summ = _summaries(k[:, : total // PAGE * PAGE], kind, dtype)
    desc, starts = _parts(k, v, [0, 37, 512, 513, 900, total])  # cuts inside pages
    sink_end, recent_start = 8, 936
    c0, c1, choose = 1, recent_start // PAGE, 20
    chosen = np.empty((HKV, choose), dtype=np.int64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse, attended, scored = native_select_attention(
            q, ctypes.addressof(desc), len(starts), starts, _cm(summ), PAGE, (c0, c1, choose),
            (0, sink_end, recent_start, total), D, 0.25, None, chosen=chosen, score=score,
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    want = choose_pages(summ[:, c0:c1], q, choose, score)
    np.testing.assert_array_equal(chosen, want)  # random scores: no ties
    other = choose_pages(summ[:, c0:c1], q, choose, "sum" if score == "max" else "max")
    assert (other != want).any()  # the two scores choose differently here
    rows = _ranges(chosen, c0, 0, sink_end, recent_start, total, PAGE)
    assert attended == HKV * (sink_end + choose * PAGE + total - recent_start)
    assert scored == (c1 - c0) * _terms(q, summ, score)
    ref = _reference(q, k, v, rows, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    assert lse.shape == (HKV, M) and torch.isfinite(lse).all()


def test_its_limits_choose_every_page_or_none():
    """choose = every page: all keys (exact attention); choose = 0: sinks and newest only."""
    g = torch.Generator().manual_seed(2)
    total = 256
    k, v = torch.randn(HKV, total, D, generator=g), torch.randn(HKV, total, D, generator=g)
    q = torch.randn(HKV, M, D, generator=g)
    summ = _summaries(k, "minmax", torch.float16)
    desc, starts = _parts(k, v, [0, total])
    for choose, rows in [
        (30, np.array([[h, 0, total] for h in range(HKV)])),
        (0, np.array([[h, a, b] for h in range(HKV) for a, b in ((0, 8), (248, total))])),
    ]:
        out, _, attended, _ = native_select_attention(
            q, ctypes.addressof(desc), 1, starts, _cm(summ), PAGE, (1, 31, choose),
            (0, 8, 248, total), D, 0.25, None,
        )  # fmt: skip
        assert attended == int((rows[:, 2] - rows[:, 1]).sum())
        torch.testing.assert_close(
            out.double(), _reference(q, k, v, rows, 0.25), atol=2e-5, rtol=2e-5
        )


def test_keys_no_part_covers_and_bad_shapes_are_errors():
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(HKV, 128, D, generator=g), torch.randn(HKV, 128, D, generator=g)
    q = torch.randn(HKV, M, D, generator=g)
    summ = _summaries(k, "minmax", torch.float32)
    desc, starts = _parts(k, v, [0, 128])
    with pytest.raises(RuntimeError, match="status -5"):  # keys up to 200: no part has them
        native_select_attention(
            q, ctypes.addressof(desc), 1, starts, _cm(summ), PAGE, (1, 15, 4), (0, 8, 120, 200), D,
            0.25, None,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="status -1"):  # more pages chosen than scored
        native_select_attention(
            q, ctypes.addressof(desc), 1, starts, _cm(summ), PAGE, (1, 15, 20), (0, 8, 120, 128), D,
            0.25, None,
        )  # fmt: skip


@pytest.mark.parametrize("score", ["max", "sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_page_whose_summary_is_nan_is_chosen_as_numpy_chooses_it(score, dtype):
    """A NaN summary (what a NaN key gives) scores above every page, in the kernel as in
    numpy: its keys are attended, so a NaN reaches the output instead of being skipped."""
    g = torch.Generator().manual_seed(5)
    total = 512
    k, v = torch.randn(HKV, total, D, generator=g), torch.randn(HKV, total, D, generator=g)
    q = torch.randn(HKV, M, D, generator=g)
    summ = _summaries(k, "minmax", dtype)
    summ[1, 9, 3] = float("nan")
    desc, starts = _parts(k, v, [0, total])
    c0, c1, choose = 1, 60, 4
    chosen = np.empty((HKV, choose), dtype=np.int64)
    native_select_attention(
        q, ctypes.addressof(desc), 1, starts, _cm(summ), PAGE, (c0, c1, choose), (0, 8, 480, total),
        D, 0.25, None, chosen=chosen, score=score,
    )  # fmt: skip
    assert 9 - c0 in chosen[1].tolist()
    np.testing.assert_array_equal(chosen, choose_pages(summ[:, c0:c1], q, choose, score))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["minmax", "mean"])
@pytest.mark.parametrize("score", ["max", "sum"])
def test_two_levels_choose_as_numpy_among_the_best_groups_pages(score, kind, dtype, threads):
    """Two levels: each head scores the groups inside [c0, c1), refines its best and
    chooses among their pages and those of the groups c0 and c1 cut — the pages
    `choose_two_level` chooses, fewer summary rows scored than one level."""
    g = torch.Generator().manual_seed(6)
    total, group, refine = 2000, 4, 6
    k = torch.randn(HKV, total, D, generator=g) * 2
    v = torch.randn(HKV, total, D, generator=g)
    q = torch.randn(HKV, M, D, generator=g)
    usable = total // (PAGE * group) * PAGE * group
    summ = _summaries(k[:, : total // PAGE * PAGE], kind, dtype)
    groups = _summaries(k[:, :usable], kind, dtype, PAGE * group)
    desc, starts = _parts(k, v, [0, 37, 1024, total])
    sink_end, recent_start = 8, 1936
    c0, c1, choose = 1, 242, 20  # c0 and c1 cut groups 0 and 60
    chosen = np.empty((HKV, choose), dtype=np.int64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, _, attended, scored = native_select_attention(
            q, ctypes.addressof(desc), len(starts), starts, _cm(summ), PAGE, (c0, c1, choose),
            (0, sink_end, recent_start, total), D, 0.25, None, chosen=chosen, score=score,
            coarse=(_cm(groups), group, refine),
        )  # fmt: skip
    finally:
        torch.set_num_threads(before)
    want, rows = choose_two_level(summ, groups, q, c0, c1, choose, group, refine, score)
    np.testing.assert_array_equal(chosen, want)
    g0, g1 = 1, 60
    assert rows == (g1 - g0) + (g0 * group - c0) + refine * group + (c1 - g1 * group)
    assert scored == rows * _terms(q, summ, score) and rows < c1 - c0
    # every chosen page lies in a group cut by c0 or c1 or in one of the head's best
    # groups by their summaries; and that is not one level's choice
    best = choose_pages(groups[:, g0:g1], q, refine, score) + g0
    for h in range(HKV):
        for p in (chosen[h] + c0).tolist():
            assert p < g0 * group or p >= g1 * group or p // group in best[h].tolist()
    assert (chosen != choose_pages(summ[:, c0:c1], q, choose, score)).any()
    rows_ = _ranges(chosen, c0, 0, sink_end, recent_start, total, PAGE)
    assert attended == int((rows_[:, 2] - rows_[:, 1]).sum())
    torch.testing.assert_close(out.double(), _reference(q, k, v, rows_, 0.25), atol=2e-5, rtol=2e-5)


def test_two_levels_with_few_groups_inside_score_every_page():
    """No more groups inside [c0, c1) than are refined: every page is scored, the choice is
    one level's."""
    g = torch.Generator().manual_seed(7)
    total, group = 512, 4
    k, v = torch.randn(HKV, total, D, generator=g), torch.randn(HKV, total, D, generator=g)
    q = torch.randn(HKV, M, D, generator=g)
    summ = _summaries(k, "minmax", torch.float32)
    groups = _summaries(k, "minmax", torch.float32, PAGE * group)
    desc, starts = _parts(k, v, [0, total])
    c0, c1, choose = 1, 60, 4  # 14 groups inside: refining 14 of them is all
    chosen = np.empty((HKV, choose), dtype=np.int64)
    _, _, _, scored = native_select_attention(
        q, ctypes.addressof(desc), 1, starts, _cm(summ), PAGE, (c0, c1, choose), (0, 8, 480, total),
        D, 0.25, None, chosen=chosen, coarse=(_cm(groups), group, 14),
    )  # fmt: skip
    assert scored == (c1 - c0) * _terms(q, summ)
    np.testing.assert_array_equal(chosen, choose_pages(summ[:, c0:c1], q, choose, "max"))
    want, rows = choose_two_level(summ, groups, q, c0, c1, choose, group, 14)
    np.testing.assert_array_equal(chosen, want)
    assert rows == c1 - c0
    with pytest.raises(RuntimeError, match="status -1"):  # fewer candidates than chosen
        native_select_attention(
            q, ctypes.addressof(desc), 1, starts, _cm(summ), PAGE, (c0, c1, 30), (0, 8, 480, total),
            D, 0.25, None, coarse=(_cm(groups), group, 1),
        )  # fmt: skip


@pytest.mark.parametrize("kind", ["minmax", "mean"])
@pytest.mark.parametrize("score", ["max", "sum"])
def test_a_row_scored_over_its_largest_channels_reads_only_those(score, kind):
    """channels = 4 of 16: each query row scores pages over its 4 largest-|q| channels —
    the pages numpy chooses with the same channels, not those of every channel — and
    reads only those channels' summary values; a NaN in a channel no row reads does not
    make its page chosen, one in a channel a row reads does."""
    g = torch.Generator().manual_seed(8)
    total = 1024
    k, v = torch.randn(HKV, total, D, generator=g) * 2, torch.randn(HKV, total, D, generator=g)
    q = torch.randn(HKV, M, D, generator=g)
    summ = _summaries(k, kind, torch.float32)
    c0, c1, choose = 1, 120, 12
    order = q.abs().argsort(dim=-1, descending=True)
    unread = [d for d in range(D) if d not in order[0, :, :4].flatten().tolist()][0]
    read = int(order[0, 0, 0])
    summ[0, 50, unread] = summ[0, 50, D + unread if kind == "minmax" else unread] = float("nan")
    summ[0, 70, read] = summ[0, 70, D + read if kind == "minmax" else read] = float("nan")
    desc, starts = _parts(k, v, [0, total])
    chosen = np.empty((HKV, choose), dtype=np.int64)
    _, _, _, scored = native_select_attention(
        q, ctypes.addressof(desc), 1, starts, _cm(summ), PAGE, (c0, c1, choose),
        (0, 8, 960, total), D, 0.25, None, chosen=chosen, score=score, channels=4,
    )  # fmt: skip
    want = choose_pages(summ[:, c0:c1], q, choose, score, channels=4)
    np.testing.assert_array_equal(chosen, want)
    assert 70 - c0 in chosen[0].tolist() and 50 - c0 not in chosen[0].tolist()
    assert (want != choose_pages(summ[:, c0:c1], q, choose, score)).any()
    assert scored == (c1 - c0) * _terms(q, summ, score, 4) < (c1 - c0) * _terms(q, summ, score)
