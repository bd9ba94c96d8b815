// kvstrata query-aware decode attention on the CPU (attention/select.py, lossy,
// opt-in): one call per layer and sequence scores every page of keys from its summary,
// chooses each KV head's best pages, and attends only those — plus the sinks and the
// newest keys — reading them where they are stored, in any format the decode kernel
// reads (attention.cpp). Python did the same in a dozen small numpy and torch calls
// per layer and a descriptor per chosen page; here it is one pass with no allocation
// per page.
//
// Summaries: [H, pages, W] per layer, fp32 or fp16, with W = 2D (per-channel max, then
// min: a query row's score is sum_d max(q_d max_d, q_d min_d), linear in the row's
// positive and negative parts) or W = D (the mean: q . mean). A page's score for a head
// is the best of its packed query rows' scores (row_max) or their sum (one product with
// the rows' parts summed first). With two levels, a head first scores coarse summaries
// (one per group of pages, a bound of each of its pages' bounds with min/max) and then
// only the pages of its best groups: fewer summary bytes read per step than one score
// per page.
//
// Each head's chosen keys — [start, sink_end), the `choose` best pages of [c0, c1)
// (page p is keys [p * page, (p + 1) * page)), [recent_start, total) — are attended
// in key order, TILE keys at a time: runs of at least a tile straight from the part
// (as attention.cpp reads them), shorter ones gathered into a tile first, so 8-key
// pages are attended at whole-tile cost.

#include <algorithm>
#include <atomic>
#include <vector>

#include "attend.h"
#include "parallel.h"

namespace {

struct Seg {  // n keys of part `part` from its key `off` on
  int part;
  i64 off, n;
};

struct Call {
  int nparts;
  const kv_part *parts;
  const i64 *part_start;  // first key of each part (sorted, parts back to back)
  Job j;
};

// Rows [off, off + n) of head h of field F as fp32 rows: their addresses into ptr[0..n)
// (in place for raw fp32 rows, else decoded into buf [n, dim]).
void gather(const kv_field &F, i64 h, i64 off, i64 n, i64 dim, float *buf, const float **ptr) {
  i64 stride;
  const float *r = rows(F, h, off, n, dim, buf, &stride);
  for (i64 t = 0; t < n; t++) ptr[t] = r + t * stride;
}

// Ask for the stored rows of n keys of part P from key `off` (K's and V's codes or raw
// rows: what the read needs most) in head h: chosen pages lie apart, so the hardware
// prefetcher cannot guess them.
inline void prefetch(const kv_part &P, i64 h, i64 off, i64 n) {
  for (const kv_field *F : {&P.k, &P.v}) {
    const char *p = (const char *)F->data + h * F->data_head_stride + (F->row0 + off) * F->data_row_stride;
    const i64 bytes = n * F->data_row_stride;
    for (i64 b = 0; b < bytes; b += 64) __builtin_prefetch(p + b);
  }
}

// Attend head h over keys [a, b) of its chosen segments (in their order) into st.
void attend_segments(const Call &C, i64 h, const std::vector<Seg> &segs, i64 a, i64 b,
                     State &st) {
  const Job &J = C.j;
  const i64 M = J.M, D = J.D, Dv = J.Dv;
  reset_state(st, M, Dv);
  const float *q = J.q + h * M * D;
  std::vector<float> kvec((size_t)(TILE * D)), vvec((size_t)(TILE * Dv)), svec((size_t)(M * TILE));
  float *kbuf = kvec.data(), *vbuf = vvec.data(), *s = svec.data();
  const float *kp[TILE], *vp[TILE];  // a gathered tile's rows
  auto krow = [&kp](i64 t) { return kp[t]; };
  auto vrow = [&vp](i64 t) { return vp[t]; };
  i64 fill = 0, base = 0;
  const size_t ahead = 4;  // segments prefetched ahead of the one attended
  size_t first = 0;
  for (i64 skip = 0; first < segs.size() && skip + segs[first].n <= a; first++) skip += segs[first].n;
  for (size_t i = first; i < first + ahead && i < segs.size(); i++)
    prefetch(C.parts[segs[i].part], h, segs[i].off, segs[i].n);
  for (size_t i = 0; i < segs.size(); i++) {
    const Seg &g = segs[i];
    if (base >= b) break;
    if (i >= first && i + ahead < segs.size() && g.n < TILE)
      prefetch(C.parts[segs[i + ahead].part], h, segs[i + ahead].off, segs[i + ahead].n);
    i64 lo = std::max<i64>(a - base, 0), hi = std::min<i64>(b - base, g.n);
    base += g.n;
    const kv_part &P = C.parts[g.part];
    while (lo < hi) {
      i64 n = std::min<i64>(TILE - fill, hi - lo);
      if (fill == 0 && n == TILE) {  // a whole tile of one run: read it in place
        i64 ks, vs;
        const float *k = rows(P.k, h, g.off + lo, n, D, kbuf, &ks);
        const float *v = rows(P.v, h, g.off + lo, n, Dv, vbuf, &vs);
        attend_tile(J, q, k, ks, v, vs, n, st, s);
      } else {
        gather(P.k, h, g.off + lo, n, D, kbuf + fill * D, kp + fill);
        gather(P.v, h, g.off + lo, n, Dv, vbuf + fill * Dv, vp + fill);
        fill += n;
        if (fill == TILE) {
          attend_rows(J, q, krow, vrow, fill, st, s);
          fill = 0;
        }
      }
      lo += n;
    }
  }
  if (fill) attend_rows(J, q, krow, vrow, fill, st, s);
}

#ifdef KV_SIMD
// The scores of 4 pages (their W summary values at rows[u], fp16 or fp32) against RB
// scoring vectors qr[j * W ..] into out[j * 4 + u] (W % 8 == 0), as attend.h's qk_block.
template <int RB, bool F16>
inline void score4(const float *qr, i64 W, const void *const *rows, float *out) {
  __m256 acc[RB][4];
  for (int j = 0; j < RB; j++)
    for (int u = 0; u < 4; u++) acc[j][u] = _mm256_setzero_ps();
  for (i64 d = 0; d < W; d += 8) {
    __m256 qv[RB];
    for (int j = 0; j < RB; j++) qv[j] = _mm256_loadu_ps(qr + j * W + d);
    for (int u = 0; u < 4; u++) {
      __m256 sv = F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const f16 *)rows[u] + d)))
                      : _mm256_loadu_ps((const float *)rows[u] + d);
      for (int j = 0; j < RB; j++) acc[j][u] = _mm256_fmadd_ps(qv[j], sv, acc[j][u]);
    }
  }
  for (int j = 0; j < RB; j++)
    _mm_storeu_ps(out + j * 4, hsum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
}

// Scores of pages [p0, p1) (summary rows of W at base + (first + p) * W) against R
// scoring vectors qh [R, W] into sc[p]: the best row's (R > 1) or the one row's, NaN
// as +inf (chosen, it propagates).
template <bool F16>
void score_pages(const float *qh, i64 R, i64 W, const void *base, i64 first, i64 p0, i64 p1,
                 float *sc) {
  const i64 esize = F16 ? 2 : 4;
  float part[3 * 4];
  for (i64 p = p0; p < p1; p += 4) {
    const void *rows[4];
    for (int u = 0; u < 4; u++)
      rows[u] = (const char *)base + (first + std::min(p + u, p1 - 1)) * W * esize;
    float best[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    bool nan[4] = {false, false, false, false};
    for (i64 r = 0; r < R; r += 3) {
      i64 rb = std::min<i64>(3, R - r);
      if (rb == 3)
        score4<3, F16>(qh + r * W, W, rows, part);
      else if (rb == 2)
        score4<2, F16>(qh + r * W, W, rows, part);
      else
        score4<1, F16>(qh + r * W, W, rows, part);
      for (i64 j = 0; j < rb; j++)
        for (int u = 0; u < 4; u++) {
          float x = part[j * 4 + u];
          nan[u] |= x != x;
          best[u] = x > best[u] ? x : best[u];
        }
    }
    for (int u = 0; u < 4 && p + u < p1; u++) sc[p + u] = nan[u] ? INFINITY : best[u];
  }
}
#endif

}  // namespace

// Query-aware decode attention of one sequence in one layer: packed queries q
// [H, M, D] over the keys each KV head chooses (see the top of this file), read from
// `nparts` parts covering keys [start, total) back to back (part p holds keys from
// part_start[p]). Summaries: page p of head h at summ + (h * summ_head_stride + p * W)
// elements (fp16 when summ_fp16); a page scores its rows' best score when row_max, else
// their sum. Two levels when `coarse` is not null: group g's summary (of pages
// [g * group, (g + 1) * group), the same width and type) at coarse + (h *
// coarse_head_stride + g * W); each head scores the groups wholly inside [c0, c1),
// keeps its `nref` best and chooses among their pages and the pages of the groups c0
// or c1 cut (every page scored when no more than nref groups lie inside). Writes out
// [H, M, Dv], lse [H, M], attended[h] (keys head h attended), scored[h] (summary rows
// head h scored) and, when `chosen` is not null, each head's chosen pages (relative to
// c0, ascending) at chosen[h * choose ..]. Returns 0, or < 0: bad shapes (-1), a
// field it cannot read (-2, -3), out of memory (-4), keys no part covers (-5).
extern "C" int kv_attn_select_decode(int nparts, const kv_part *parts, const i64 *part_start,
                                     const float *q, float *out, float *lse, i64 H, i64 M, i64 D,
                                     i64 Dv, float scale, float softcap, const void *summ,
                                     int summ_fp16, int row_max, i64 summ_head_stride, i64 W, i64 page, i64 c0, i64 c1, i64 choose, i64 start,
                                     i64 sink_end, i64 recent_start, i64 total, i64 *attended,
                                     i64 *chosen, const void *coarse, i64 coarse_head_stride,
                                     i64 group, i64 nref, i64 *scored, int nth) {
  const i64 npages = c1 - c0;
  if (M > MAX_M || D > MAX_D || Dv > MAX_D || M < 1 || H < 1 || D < 1 || Dv < 1 ||
      nparts < 1 || (W != D && W != 2 * D) || page < 1 || npages < 0 || choose < 0 ||
      choose > npages || !(start <= sink_end && sink_end <= recent_start && recent_start <= total) ||
      (npages > 0 && (c0 * page < start || c1 * page > recent_start)) ||
      (coarse && (group < 2 || nref < 1)))
    return -1;
  for (int p = 0; p < nparts; p++) {
    if (int rc = check_field(parts[p].k, D)) return rc;
    if (int rc = check_field(parts[p].v, Dv)) return rc;
  }
  init_e4m3();
  const bool fp16 = summ_fp16 != 0;
  // the groups wholly inside [c0, c1): two levels when more than nref of them
  const i64 g0 = coarse ? (c0 + group - 1) / group : 0, g1 = coarse ? c1 / group : 0;
  const bool two = coarse && choose > 0 && g1 - g0 > nref;
  const i64 edges = two ? g0 * group - c0 + c1 - g1 * group : 0;
  if (two && edges + nref * group < choose) return -1;
  try {
    // each head's scoring vectors [H, R, W]: every query row's (row_max), or one with
    // the rows summed
    const i64 R = row_max ? M : 1;
    std::vector<float> qs((size_t)(H * R * W), 0.0f);
    for (i64 h = 0; h < H; h++)
      for (i64 m = 0; m < M; m++)
        for (i64 d = 0; d < D; d++) {
          float x = q[(h * M + m) * D + d], *qr = qs.data() + (h * R + (row_max ? m : 0)) * W;
          if (W == D) {
            qr[d] += x;
          } else {
            qr[d] += x > 0 ? x : 0.0f;
            qr[D + d] += x < 0 ? x : 0.0f;
          }
        }
    // the scores of n summary rows of head h from row `first` on (of `base`, head
    // stride `hs`) into sc[0 .. n): the best row's, NaN as +inf (chosen, it propagates)
    auto score_rows = [&](i64 h, const void *base, i64 hs, i64 first, i64 n, float *sc,
                          float *row) {
      const float *qh = qs.data() + h * R * W;
      const void *hb = fp16 ? (const void *)((const f16 *)base + h * hs)
                            : (const void *)((const float *)base + h * hs);
#ifdef KV_SIMD
      if (W % 8 == 0) {
        if (fp16)
          score_pages<true>(qh, R, W, hb, first, 0, n, sc);
        else
          score_pages<false>(qh, R, W, hb, first, 0, n, sc);
        return;
      }
#endif
      for (i64 p = 0; p < n; p++) {
        const float *sv = (const float *)hb + (first + p) * W;
        if (fp16) {
          f16_to_f32((const f16 *)hb + (first + p) * W, row, W);
          sv = row;
        }
        float x = dot(qh, sv, W);
        for (i64 r = 1; r < R; r++) {
          float y = dot(qh + r * W, sv, W);
          x = y > x || y != y ? y : x;
        }
        sc[p] = x != x ? INFINITY : x;
      }
    };
    // score runs of rows over the threads: (head, base, head stride, first, n, out)
    struct Run {
      i64 h;
      const void *base;
      i64 hs, first, n;
      float *out;
    };
    auto score_all = [&](const std::vector<Run> &runs) {
      std::atomic<size_t> next{0};
      kv_parallel((int)std::min<size_t>((size_t)nth, runs.size()), [&](int) {
        std::vector<float> row((size_t)W);
        for (size_t i = next++; i < runs.size(); i = next++) {
          const Run &r = runs[i];
          score_rows(r.h, r.base, r.hs, r.first, r.n, r.out, row.data());
        }
      });
    };
    // runs of at most `chunk` rows: [first, first + n) of head h into out
    auto add_runs = [](std::vector<Run> &runs, i64 h, const void *base, i64 hs, i64 first,
                       i64 n, float *out, i64 chunk) {
      for (i64 a = 0; a < n; a += chunk)
        runs.push_back(Run{h, base, hs, first + a, std::min(chunk, n - a), out + a});
    };
    // the `k` best of scores sc[0 .. n) (ties: the lower index) into dst, ascending
    auto best = [](const float *sc, i64 n, i64 k, std::vector<i64> &dst) {
      std::vector<i64> pick((size_t)n);
      for (i64 p = 0; p < n; p++) pick[p] = p;
      auto better = [sc](i64 x, i64 y) { return sc[x] > sc[y] || (sc[x] == sc[y] && x < y); };
      if (k < n) std::nth_element(pick.begin(), pick.begin() + k, pick.end(), better);
      dst.assign(pick.begin(), pick.begin() + k);
      std::sort(dst.begin(), dst.end());
    };
    std::vector<std::vector<i64>> picks((size_t)H);
    if (choose > 0 && !two) {  // every page's score [H, npages]
      std::vector<float> scores((size_t)(H * npages));
      std::vector<Run> runs;
      for (i64 h = 0; h < H; h++)
        add_runs(runs, h, summ, summ_head_stride, c0, npages, scores.data() + h * npages, 256);
      score_all(runs);
      for (i64 h = 0; h < H; h++) {
        best(scores.data() + h * npages, npages, choose, picks[h]);
        if (scored) scored[h] = npages;
      }
    } else if (two) {
      // the groups' scores [H, g1 - g0], each head's nref best
      const i64 ng = g1 - g0, ncand = edges + nref * group;
      std::vector<float> gs((size_t)(H * ng)), cs((size_t)(H * ncand));
      std::vector<Run> runs;
      for (i64 h = 0; h < H; h++)
        add_runs(runs, h, coarse, coarse_head_stride, g0, ng, gs.data() + h * ng, 64);
      score_all(runs);
      // candidates, ascending: the pages before g0's, those of the best groups, those
      // from g1's on; cand[h * ncand + j] = page - c0
      std::vector<i64> cand((size_t)(H * ncand)), groups;
      runs.clear();
      for (i64 h = 0; h < H; h++) {
        best(gs.data() + h * ng, ng, nref, groups);
        i64 *ch = cand.data() + h * ncand, j = 0;
        float *out = cs.data() + h * ncand;
        auto take = [&](i64 first, i64 n) {  // pages [first, first + n)
          add_runs(runs, h, summ, summ_head_stride, first, n, out + j, 64);
          for (i64 p = 0; p < n; p++) ch[j++] = first + p - c0;
        };
        take(c0, g0 * group - c0);
        for (i64 g : groups) take((g0 + g) * group, group);
        take(g1 * group, c1 - g1 * group);
        if (scored) scored[h] = ng + ncand;
      }
      score_all(runs);
      std::vector<i64> idx;
      for (i64 h = 0; h < H; h++) {
        best(cs.data() + h * ncand, ncand, choose, idx);
        picks[h].resize((size_t)choose);
        for (i64 i = 0; i < choose; i++) picks[h][i] = cand[h * ncand + idx[i]];
      }
    } else if (scored) {
      for (i64 h = 0; h < H; h++) scored[h] = 0;
    }
    // each head's ranges in key order, then its segments of parts
    std::vector<std::vector<Seg>> segs((size_t)H);
    i64 most = 0;
    for (i64 h = 0; h < H; h++) {
      const std::vector<i64> &pick = picks[h];
      if (chosen)
        for (i64 i = 0; i < choose; i++) chosen[h * choose + i] = pick[i];
      std::vector<std::pair<i64, i64>> ranges;
      auto add = [&ranges](i64 lo, i64 hi) {
        if (lo >= hi) return;
        if (!ranges.empty() && lo <= ranges.back().second)
          ranges.back().second = std::max(ranges.back().second, hi);
        else
          ranges.emplace_back(lo, hi);
      };
      add(start, sink_end);
      for (i64 i = 0; i < choose; i++) add((c0 + pick[i]) * page, (c0 + pick[i] + 1) * page);
      add(recent_start, total);
      i64 count = 0;
      for (auto [lo, hi] : ranges) {
        int p = (int)(std::upper_bound(part_start, part_start + nparts, lo) - part_start) - 1;
        while (lo < hi) {
          if (p < 0 || p >= nparts || lo >= part_start[p] + parts[p].tokens) return -5;
          i64 n = std::min(hi, part_start[p] + parts[p].tokens) - lo;
          segs[h].push_back(Seg{p, lo - part_start[p], n});
          lo += n, count += n, p++;
        }
      }
      attended[h] = count;
      most = std::max(most, count);
    }
    // attention: each head's keys split over the threads, merged per head
    // (at least 128 keys a split: a selected head's keys are few, and H items on nth
    // threads leave some idle)
    const i64 splits = nth <= 1 ? 1 : std::min<i64>((4 * nth + H - 1) / H, std::max<i64>(1, most / 128));
    const i64 per = (most + splits - 1) / splits;
    std::vector<State> states((size_t)(H * splits));
    const Call C{nparts, parts, part_start, Job{q, M, D, Dv, scale, softcap}};
    std::atomic<i64> item{0};
    std::atomic<bool> failed{false};
    const i64 items = H * splits;
    int workers = (int)std::min<i64>(nth, items);
    if (most * H * D < (1 << 14)) workers = 1;
    kv_parallel(workers, [&](int) {
      try {
        for (i64 i = item++; i < items; i = item++) {
          i64 h = i / splits, sp = i % splits;
          attend_segments(C, h, segs[h], sp * per, std::min(attended[h], (sp + 1) * per),
                          states[(size_t)i]);
        }
      } catch (...) {  // out of memory: report, never unwind through OpenMP
        failed = true;
      }
    });
    if (failed) return -4;
    merge_splits(states.data(), splits, H, M, Dv, out, lse);
  } catch (...) {
    return -4;
  }
  return 0;
}
