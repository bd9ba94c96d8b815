// kvstrata query-aware decode attention on the CPU (attention/selection/selector.py, lossy,
// opt-in): one call per layer and sequence scores every page of keys from its summary,
// chooses each KV head's best pages, and attends only those — plus the sinks and the
// newest keys — reading them where they are stored, in any format the decode kernel
// reads (attention.cpp). Python did the same in a dozen small numpy and torch calls
// per layer and a descriptor per chosen page; here it is one pass with no allocation
// per page.
//
// Summaries: channel-major [H, W, pages] per layer, fp32 or fp16, with W = 2D
// (per-channel max, then min: a query row's score is sum_d max(q_d max_d, q_d min_d) —
// for each channel only its max or its min, by the sign of q_d) or W = D (the mean:
// q . mean). A row may be scored over its largest-|q| channels only (SparQ's
// approximation: Ribar et al., "SparQ Attention", 2023), reading only those channels'
// rows. A page's score for a head is the best of its packed query rows' scores
// (row_max) or their sum (one set of terms, the rows' coefficients summed). Scores are
// accumulated 64 pages at a time in registers, one summary row after another. With two levels, a head first scores coarse summaries
// (one per group of pages, a bound of each of its pages' bounds with min/max) and then
// only the pages of its best groups: fewer summary bytes read per step than one score
// per page.
//
// Each head's chosen keys — [start, sink_end), the `choose` best pages of [c0, c1)
// (page p is keys [p * page, (p + 1) * page)), [recent_start, total) — are attended
// in key order, TILE keys at a time: runs of at least a tile straight from the part
// (as attention.cpp reads them), shorter ones copied into a tile first, so 4-key
// pages are attended at whole-tile cost.

#include <algorithm>
#include <cstdint>
#include <cstring>
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

// Rows [off, off + n) of head h of field F as fp32 rows in buf [n, dim]: copied when
// stored as fp32, else decoded.
void copy_rows(const kv_field &F, i64 h, i64 off, i64 n, i64 dim, float *buf) {
  i64 stride;
  const float *r = rows(F, h, off, n, dim, buf, &stride);
  if (r == buf) return;
  if (stride == dim) {
    memcpy(buf, r, (size_t)(n * dim) * sizeof(float));
    return;
  }
  for (i64 t = 0; t < n; t++) memcpy(buf + t * dim, r + t * stride, (size_t)dim * sizeof(float));
}

// Attend head h over keys [a, b) of its chosen segments (in their order) into st: a
// tile of one run in place, shorter runs copied into a tile first. Chosen pages lie
// apart; copying them is loads back to back, which keeps more misses in flight than
// a tile's arithmetic between them — smollm2's shapes at 8k with 4-key pages: less time
// a step than attending the rows through pointers (docs/MEASUREMENTS.md; prefetching
// the next segments, at distances 0-16, changed nothing either way).
void attend_segments(const Call &C, i64 h, const std::vector<Seg> &segs, i64 a, i64 b,
                     State &st) {
  const Job &J = C.j;
  const i64 M = J.M, D = J.D, Dv = J.Dv;
  reset_state(st, M, Dv);
  const float *q = J.q + h * M * D;
  std::vector<float> kvec((size_t)(TILE * D)), vvec((size_t)(TILE * Dv)), svec((size_t)(M * TILE));
  float *kbuf = kvec.data(), *vbuf = vvec.data(), *s = svec.data();
  i64 fill = 0, base = 0;
  for (const Seg &g : segs) {
    if (base >= b) break;
    i64 lo = std::max<i64>(a - base, 0), hi = std::min<i64>(b - base, g.n);
    base += g.n;
    const kv_part &P = C.parts[g.part];
    while (lo < hi) {
      if (fill == 0 && hi - lo >= TILE) {  // a whole tile of one run: read it in place
        i64 ks, vs;
        const float *k = rows(P.k, h, g.off + lo, TILE, D, kbuf, &ks);
        const float *v = rows(P.v, h, g.off + lo, TILE, Dv, vbuf, &vs);
        attend_tile(J, q, k, ks, v, vs, TILE, st, s);
        lo += TILE;
        continue;
      }
      const i64 n = std::min<i64>(TILE - fill, hi - lo);
      copy_rows(P.k, h, g.off + lo, n, D, kbuf + fill * D);
      copy_rows(P.v, h, g.off + lo, n, Dv, vbuf + fill * Dv);
      fill += n, lo += n;
      if (fill == TILE) {
        attend_tile(J, q, kbuf, D, vbuf, Dv, TILE, st, s);
        fill = 0;
      }
    }
  }
  if (fill) attend_tile(J, q, kbuf, D, vbuf, Dv, fill, st, s);
}

// One term of a scoring vector: coefficient c times summary row w (channel w's max,
// or D + d: channel d's min; or channel w's mean).
struct Term {
  i64 w;
  float c;
};

// acc[p] = sum over the terms t of t.c * row(t.w)[first + p], p in [0, n): rows of the
// channel-major summaries `rs` elements apart from base (fp16 or fp32). Four rows at a
// time, each streamed along its pages (one contiguous run per row: what the hardware
// prefetcher follows), into acc (a few KiB: it stays in L1).
template <bool F16>
void axpy_rows(const Term *t, i64 nt, const void *base, i64 rs, i64 first, i64 n, float *acc) {
  auto row = [base, rs, first](i64 w) {
    return F16 ? (const void *)((const f16 *)base + w * rs + first)
               : (const void *)((const float *)base + w * rs + first);
  };
  auto at = [](const void *r, i64 p) {
    return F16 ? (float)((const f16 *)r)[p] : ((const float *)r)[p];
  };
  for (i64 p = 0; p < n; p++) acc[p] = 0.0f;
  for (i64 i = 0; i < nt; i += 4) {
    const int k = (int)std::min<i64>(4, nt - i);
    const void *r[4];
    float c[4];
    for (int j = 0; j < 4; j++) {  // a short group repeats its last row with weight 0
      r[j] = row(t[i + std::min(j, k - 1)].w);
      c[j] = j < k ? t[i + j].c : 0.0f;
    }
    i64 p = 0;
#ifdef KV_SIMD
    const __m256 c0 = _mm256_set1_ps(c[0]), c1 = _mm256_set1_ps(c[1]),
                 c2 = _mm256_set1_ps(c[2]), c3 = _mm256_set1_ps(c[3]);
    auto ld = [](const void *r, i64 p) {
      return F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const f16 *)r + p)))
                 : _mm256_loadu_ps((const float *)r + p);
    };
    for (; p + 8 <= n; p += 8) {
      __m256 a = _mm256_loadu_ps(acc + p);
      a = _mm256_fmadd_ps(c0, ld(r[0], p), a);
      a = _mm256_fmadd_ps(c1, ld(r[1], p), a);
      a = _mm256_fmadd_ps(c2, ld(r[2], p), a);
      a = _mm256_fmadd_ps(c3, ld(r[3], p), a);
      _mm256_storeu_ps(acc + p, a);
    }
#endif
    for (; p < n; p++)
      acc[p] += c[0] * at(r[0], p) + c[1] * at(r[1], p) + c[2] * at(r[2], p) + c[3] * at(r[3], p);
  }
}

// Scores sc[0 .. n) of pages first .. first + n - 1 against `nvec` scoring vectors (the
// terms of vector v: t[vs[v] .. vs[v + 1])): the best vector's score, NaN as +inf
// (chosen, it propagates). acc: scratch of n.
template <bool F16>
void score_rows_cm(const Term *t, const i64 *vs, i64 nvec, const void *base, i64 rs, i64 first,
                   i64 n, float *sc, float *acc) {
  for (i64 v = 0; v < nvec; v++) {
    float *out = v == 0 ? sc : acc;
    axpy_rows<F16>(t + vs[v], vs[v + 1] - vs[v], base, rs, first, n, out);
    i64 p = 0;
#ifdef KV_SIMD
    const __m256 inf = _mm256_set1_ps(INFINITY);
    for (; p + 8 <= n; p += 8) {
      __m256 x = _mm256_loadu_ps(out + p);
      if (v > 0) x = _mm256_max_ps(x, _mm256_loadu_ps(sc + p));  // NaN x: sc's (masked next)
      __m256 bad = _mm256_cmp_ps(_mm256_loadu_ps(out + p), _mm256_loadu_ps(out + p), _CMP_UNORD_Q);
      if (v > 0) bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_loadu_ps(sc + p), inf, _CMP_EQ_OQ));
      _mm256_storeu_ps(sc + p, _mm256_blendv_ps(x, inf, bad));
    }
#endif
    for (; p < n; p++) {
      float x = out[p];
      sc[p] = x != x ? INFINITY : (v == 0 || x > sc[p] ? x : sc[p]);
    }
  }
}

}  // namespace

// Query-aware decode attention of one sequence in one layer: packed queries q
// [H, M, D] over the keys each KV head chooses (see the top of this file), read from
// `nparts` parts covering keys [start, total) back to back (part p holds keys from
// part_start[p]). Summaries, channel-major: value w of page p of head h at summ + (h *
// summ_head_stride + w * summ_row_stride + p) elements (fp16 when summ_fp16); each
// query row is scored over its `channels` largest-|q| channels only (0: all of them);
// a page scores its rows' best score when row_max, else their sum. Two levels when
// `coarse` is not null: group g's summary (of pages [g * group, (g + 1) * group), the
// same width and type) at coarse + (h * coarse_head_stride + w * coarse_row_stride +
// g); each head scores the groups wholly inside [c0, c1), keeps its `nref` best and
// chooses among their pages and the pages of the groups c0 or c1 cut (every page
// scored when no more than nref groups lie inside). Writes out [H, M, Dv], lse [H, M],
// attended[h] (keys head h attended), scored[h] (summary values head h read: pages
// and groups scored times its scoring vectors' terms) and, when `chosen` is not null,
// each head's chosen pages (relative to c0, ascending) at chosen[h * choose ..].
// Returns 0, or < 0: bad shapes (-1), a field it cannot read (-2, -3), out of memory
// (-4), keys no part covers (-5).
extern "C" int kv_attn_select_decode(int nparts, const kv_part *parts, const i64 *part_start,
                                     const float *q, float *out, float *lse, i64 H, i64 M, i64 D,
                                     i64 Dv, float scale, float softcap, const void *summ,
                                     int summ_fp16, int row_max, i64 summ_head_stride,
                                     i64 summ_row_stride, i64 W, i64 page, i64 c0, i64 c1,
                                     i64 choose, i64 start, i64 sink_end, i64 recent_start,
                                     i64 total, i64 *attended, i64 *chosen, const void *coarse,
                                     i64 coarse_head_stride, i64 coarse_row_stride, i64 group,
                                     i64 nref, i64 channels, i64 *scored, int nth) {
  const i64 npages = c1 - c0;
  if (M > MAX_M || D > MAX_D || Dv > MAX_D || M < 1 || H < 1 || D < 1 || Dv < 1 ||
      nparts < 1 || (W != D && W != 2 * D) || page < 1 || npages < 0 || choose < 0 ||
      choose > npages || !(start <= sink_end && sink_end <= recent_start && recent_start <= total) ||
      (npages > 0 && (c0 * page < start || c1 * page > recent_start)) ||
      (coarse && (group < 2 || nref < 1)) || channels < 0)
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
    // each head's scoring vectors as terms (coefficient, summary row): one per query
    // row (row_max) or one for their sum; a row's term for channel d is q_d times the
    // channel's max (q_d > 0) or min (q_d < 0) — sum_d max(q_d max_d, q_d min_d) — or
    // its mean
    const i64 nvec = row_max ? M : 1, keep = channels == 0 || channels > D ? D : channels;
    std::vector<std::vector<Term>> terms((size_t)H);
    std::vector<std::vector<i64>> vstart((size_t)H);
    if (choose > 0) {
      std::vector<i64> idx((size_t)D);
      std::vector<float> mag((size_t)D), dense((size_t)W);
      for (i64 h = 0; h < H; h++) {
        vstart[h].push_back(0);
        for (i64 m = 0; m < M; m++) {
          const float *qm = q + (h * M + m) * D;
          for (i64 d = 0; d < D; d++) idx[d] = d;
          if (keep < D) {  // the largest |q_d| (ties: the lower channel; NaN first)
            for (i64 d = 0; d < D; d++) mag[d] = qm[d] != qm[d] ? INFINITY : std::fabs(qm[d]);
            const float *mg = mag.data();
            std::nth_element(idx.begin(), idx.begin() + keep, idx.end(), [mg](i64 x, i64 y) {
              return mg[x] > mg[y] || (mg[x] == mg[y] && x < y);
            });
          }
          if (row_max || m == 0) std::fill(dense.begin(), dense.end(), 0.0f);
          for (i64 i = 0; i < keep; i++) {
            const i64 d = idx[i];
            const float x = qm[d];
            dense[W == D || x > 0 ? d : D + d] += x;
          }
          if (row_max || m == M - 1) {
            for (i64 w = 0; w < W; w++)
              if (dense[w] != 0.0f || dense[w] != dense[w]) terms[h].push_back(Term{w, dense[w]});
            vstart[h].push_back((i64)terms[h].size());
          }
        }
      }
    }
    // the scores of n pages (or groups) of head h from `first` on (of `base`, head
    // stride `hs`, row stride `rs`) into sc[0 .. n)
    auto score_rows = [&](i64 h, const void *base, i64 hs, i64 rs, i64 first, i64 n, float *sc,
                          float *acc) {
      if (fp16)
        score_rows_cm<true>(terms[h].data(), vstart[h].data(), nvec, (const f16 *)base + h * hs,
                            rs, first, n, sc, acc);
      else
        score_rows_cm<false>(terms[h].data(), vstart[h].data(), nvec,
                             (const float *)base + h * hs, rs, first, n, sc, acc);
    };
    // runs of pages scored over the threads: head, base, head and row strides, pages
    // [first, first + n), their scores' place
    struct Run {
      i64 h;
      const void *base;
      i64 hs, rs, first, n;
      float *out;
    };
    // the longest run: up to 2,048 pages, so a row is read in runs of 4 KiB (fp16),
    // not 1 KiB (smollm2 at 8k: one run per head, faster than runs of 512 pages,
    // docs/MEASUREMENTS.md), but at least one run per thread where the pages allow
    // (one KV head)
    const i64 most_rows = 2048;
    const i64 run_pages = std::min<i64>(most_rows, std::max<i64>(512, (npages * H + nth - 1) / std::max(nth, 1)));
    auto score_all = [&](const std::vector<Run> &runs) {
      std::atomic<size_t> next{0};
      kv_parallel((int)std::min<size_t>((size_t)nth, runs.size()), [&](int) {
        std::vector<float> acc((size_t)most_rows);
        for (size_t i = next++; i < runs.size(); i = next++) {
          const Run &r = runs[i];
          score_rows(r.h, r.base, r.hs, r.rs, r.first, r.n, r.out, acc.data());
        }
      });
    };
    // runs of at most `chunk` pages: [first, first + n) of head h into out
    auto add_runs = [](std::vector<Run> &runs, i64 h, const void *base, i64 hs, i64 rs,
                       i64 first, i64 n, float *out, i64 chunk) {
      for (i64 a = 0; a < n; a += chunk)
        runs.push_back(Run{h, base, hs, rs, first + a, std::min(chunk, n - a), out + a});
    };
    // the `k` best of scores sc[0 .. n) (ties: the lower index) into dst, ascending
    // (one 64-bit key per score, larger = better: the score's bits in an order that
    // compares as the floats do, then the complement of the index — a plain integer
    // selection, no comparator reading the scores)
    auto best = [](const float *sc, i64 n, i64 k, std::vector<i64> &dst) {
      std::vector<uint64_t> key((size_t)n);
      for (i64 p = 0; p < n; p++) {
        uint32_t u;
        memcpy(&u, sc + p, 4);
        u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
        key[p] = ((uint64_t)u << 32) | (uint32_t)(0xFFFFFFFFu - (uint32_t)p);
      }
      if (k < n) std::nth_element(key.begin(), key.begin() + k, key.end(), std::greater<uint64_t>());
      dst.resize((size_t)k);
      for (i64 i = 0; i < k; i++) dst[i] = (i64)(0xFFFFFFFFu - (uint32_t)key[i]);
      std::sort(dst.begin(), dst.end());
    };
    std::vector<std::vector<i64>> picks((size_t)H);
    // one level: every page's score [H, npages], its runs scored in the attention's
    // parallel region (below)
    const bool fused = choose > 0 && !two;
    std::vector<float> scores(fused ? (size_t)(H * npages) : 0);
    std::vector<Run> first_runs;
    if (fused) {
      for (i64 h = 0; h < H; h++) {
        add_runs(first_runs, h, summ, summ_head_stride, summ_row_stride, c0, npages,
                 scores.data() + h * npages, run_pages);
        if (scored) scored[h] = npages * (i64)terms[h].size();
      }
    } else if (two) {
      // the groups' scores [H, g1 - g0], each head's nref best
      const i64 ng = g1 - g0, ncand = edges + nref * group;
      std::vector<float> gs((size_t)(H * ng)), cs((size_t)(H * ncand));
      std::vector<Run> runs;
      for (i64 h = 0; h < H; h++)
        add_runs(runs, h, coarse, coarse_head_stride, coarse_row_stride, g0, ng,
                 gs.data() + h * ng, 128);
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
          add_runs(runs, h, summ, summ_head_stride, summ_row_stride, first, n, out + j, 128);
          for (i64 p = 0; p < n; p++) ch[j++] = first + p - c0;
        };
        take(c0, g0 * group - c0);
        for (i64 g : groups) take((g0 + g) * group, group);
        take(g1 * group, c1 - g1 * group);
        if (scored) scored[h] = (ng + ncand) * (i64)terms[h].size();
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
    // each head's ranges in key order, then its segments of parts: 0, or -5 (keys no
    // part covers)
    std::vector<std::vector<Seg>> segs((size_t)H);
    auto build = [&](i64 h) -> int {
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
      return 0;
    };
    // every head attends as many keys: its sinks, pages and newest keys are disjoint
    const i64 most = (sink_end - start) + choose * page + (total - recent_start);
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
    int workers = (int)std::min<i64>(nth, items + (i64)first_runs.size());
    if (most * H * D < (1 << 14) && first_runs.size() <= 1) workers = 1;
    auto attend_item = [&](i64 i) {
      i64 h = i / splits, sp = i % splits;
      attend_segments(C, h, segs[h], sp * per, std::min(attended[h], (sp + 1) * per),
                      states[(size_t)i]);
    };
    if (!fused) {
      for (i64 h = 0; h < H; h++)
        if (int rc = build(h)) return rc;
    }
    // One parallel region (each wakes sleeping workers under OMP_WAIT_POLICY=PASSIVE,
    // kvstrata's default: one region fewer per layer measurably shortened a step,
    // docs/MEASUREMENTS.md): one level scores its runs
    // first; the thread scoring a head's last run chooses its pages and builds its
    // segments, and its attention items wait (spinning: at most one run) until then.
    std::vector<std::atomic<i64>> left((size_t)H);
    std::vector<std::atomic<int>> ready((size_t)H);  // 0: not yet, 1: built, < 0: error
    for (i64 h = 0; h < H; h++) left[h].store(0), ready[h].store(fused ? 0 : 1);
    for (const Run &r : first_runs) left[r.h].fetch_add(1);
    std::atomic<size_t> next_run{0};
    kv_parallel(workers, [&](int) {
      try {
        std::vector<float> acc(first_runs.empty() ? 0 : (size_t)most_rows);
        for (size_t r = next_run++; r < first_runs.size(); r = next_run++) {
          const Run &u = first_runs[r];
          score_rows(u.h, u.base, u.hs, u.rs, u.first, u.n, u.out, acc.data());
          if (left[u.h].fetch_sub(1) == 1) {  // the head's last run: choose and build
            best(scores.data() + u.h * npages, npages, choose, picks[u.h]);
            ready[u.h].store(build(u.h) == 0 ? 1 : -5, std::memory_order_release);
          }
        }
        for (i64 i = item++; i < items; i = item++) {
          const i64 h = i / splits;
          int state;
          while ((state = ready[h].load(std::memory_order_acquire)) == 0 && !failed) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
          }
          if (state == 1 && !failed) attend_item(i);
        }
      } catch (...) {  // out of memory: report, never unwind through OpenMP
        failed = true;
      }
    });
    if (failed) return -4;
    for (i64 h = 0; h < H; h++)
      if (ready[h].load() < 0) return -5;
    merge_splits(states.data(), splits, H, M, Dv, out, lse);
  } catch (...) {
    return -4;
  }
  return 0;
}
