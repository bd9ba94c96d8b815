// The decode attention kernels' shared pieces (attention.cpp: every key of every part;
// select.cpp: the keys query-aware selection chooses): reading a tile of K/V rows in
// any stored format, the online-softmax update of one tile, splitting a head's keys
// over threads and merging the splits. Static: each kernel file gets its own copy.
#pragma once

#include <algorithm>
#include <cmath>
#include <mutex>
#include <vector>

#include "common.h"

static const int TILE = 32;
static const int MAX_M = 64;     // packed query rows per head
static const int MAX_D = 512;    // head dim

// exp(x) for x <= 0, vectorizable: 2^(x*log2e) split into 2^n * 2^f, f in
// [-0.5, 0.5], degree-6 polynomial; relative error ~1e-6 (~9 ulp), plenty for softmax
// weights. x < -87 (-inf included) gives 0; NaN stays NaN.
static inline float fast_exp(float x0) {
  float x = x0 >= -87.0f ? x0 : -87.0f;  // NaN -> -87 too: no NaN-to-int cast below
  float t = x * 1.44269504088896341f;
  float n = __builtin_roundf(t);
  float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  uint32_t bits;
  memcpy(&bits, &p, 4);
  bits += (uint32_t)(int32_t)n << 23;  // n in [-126, 0]: scale by 2^n, no overflow
  float r;
  memcpy(&r, &bits, 4);
  r = x0 < -87.0f ? 0.0f : r;
  return x0 != x0 ? x0 : r;
}

static float g_e4m3[256];  // fp8 e4m3fn code -> float (0x7f/0xff are NaN, never stored)

static void init_e4m3() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (int c = 0; c < 256; c++) {
      int e = (c >> 3) & 15, m = c & 7;
      float v = e == 0 ? std::ldexp((float)m, -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
      g_e4m3[c] = (c & 0x80) ? -v : v;
    }
  });
}

// Rows [t0, t0 + n) of head h of field F as floats in out [n, dim]; returns a pointer
// to them (the arena itself for contiguous fp32 rows, else `out`) and its row stride.
static const float *rows(const kv_field &F, i64 h, i64 t0, i64 n, i64 dim, float *out,
                         i64 *stride) {
  i64 r0 = F.row0 + t0;
  const i64 drs = F.data_row_stride;
  const u8 *base = (const u8 *)F.data + h * F.data_head_stride;
  const u8 *scale = (const u8 *)F.scale + h * F.scale_head_stride;
  const u8 *zero = (const u8 *)F.zero + h * F.zero_head_stride;
  switch (F.format) {
    case KV_FMT_F32:
      *stride = drs / 4;
      return (const float *)(base + r0 * drs);
    case KV_FMT_F16:
      for (i64 t = 0; t < n; t++)
        f16_to_f32((const f16 *)(base + (r0 + t) * drs), out + t * dim, dim);
      break;
    case KV_FMT_BF16:
      for (i64 t = 0; t < n; t++) {
        const bf16 *src = (const bf16 *)(base + (r0 + t) * drs);
        for (i64 d = 0; d < dim; d++) out[t * dim + d] = ld(src, d);
      }
      break;
    case KV_FMT_INT8: {
      const f16 *s = (const f16 *)scale, *z = (const f16 *)zero;
      for (i64 t = 0; t < n; t++) {
        const u8 *src = base + (r0 + t) * drs;
        float sc = (float)s[r0 + t], zp = (float)z[r0 + t];
        for (i64 d = 0; d < dim; d++) out[t * dim + d] = (float)src[d] * sc + zp;
      }
      break;
    }
    case KV_FMT_INT4_TOKEN: {  // groups of `group` channels
      const f16 *s = (const f16 *)scale, *z = (const f16 *)zero;
      i64 half = dim / 2, ng = dim / F.group;
      for (i64 t = 0; t < n; t++) {
        const u8 *src = base + (r0 + t) * drs;
        const f16 *sr = s + (r0 + t) * ng, *zr = z + (r0 + t) * ng;
        float *o = out + t * dim;
        for (i64 d = 0; d < half; d++) o[d] = (float)(src[d] & 15);
        for (i64 d = 0; d < half; d++) o[half + d] = (float)(src[d] >> 4);
        for (i64 g = 0; g < ng; g++) {
          float sc = (float)sr[g], zp = (float)zr[g];
          float *og = o + g * F.group;
          for (i64 d = 0; d < F.group; d++) og[d] = og[d] * sc + zp;
        }
      }
      break;
    }
    case KV_FMT_FP8_E4M3: {  // one fp32 scale per `group` rows
      const float *s = (const float *)scale;
      for (i64 t = 0; t < n; t++) {
        const u8 *src = base + (r0 + t) * drs;
        float sc = s[(r0 + t) / F.group];
        for (i64 d = 0; d < dim; d++) out[t * dim + d] = g_e4m3[src[d]] * sc;
      }
      break;
    }
    case KV_FMT_INT4_CHANNEL: {  // groups of `group` tokens
      const f16 *s = (const f16 *)scale, *z = (const f16 *)zero;
      i64 half = dim / 2;
      float sc[MAX_D], zp[MAX_D];
      i64 cur = -1;
      for (i64 t = 0; t < n; t++) {
        i64 g = (r0 + t) / F.group;
        if (g != cur) {
          for (i64 d = 0; d < dim; d++) {
            sc[d] = (float)s[g * dim + d];
            zp[d] = (float)z[g * dim + d];
          }
          cur = g;
        }
        const u8 *src = base + (r0 + t) * drs;
        float *o = out + t * dim;
        for (i64 d = 0; d < half; d++) o[d] = (float)(src[d] & 15) * sc[d] + zp[d];
        for (i64 d = 0; d < half; d++)
          o[half + d] = (float)(src[d] >> 4) * sc[half + d] + zp[half + d];
      }
      break;
    }
  }
  *stride = dim;
  return out;
}

// (compiled with -fassociative-math: these reductions vectorise)
static inline float dot(const float *__restrict a, const float *__restrict b, i64 n) {
  float s = 0;
  for (i64 d = 0; d < n; d++) s += a[d] * b[d];
  return s;
}

// max(init, x[0..n)); NaN if any x is NaN (NaN input must come out NaN, not as an
// empty row).
static inline float vmax(const float *x, i64 n, float init) {
  float lanes[16];
  for (int j = 0; j < 16; j++) lanes[j] = init;
  i64 t = 0;
  for (; t + 16 <= n; t += 16)
    for (int j = 0; j < 16; j++) lanes[j] = x[t + j] > lanes[j] ? x[t + j] : lanes[j];
  for (; t < n; t++) lanes[0] = x[t] > lanes[0] ? x[t] : lanes[0];
  float m = lanes[0];
  int bad = 0;  // (not x*0: -fno-signed-zeros lets the compiler fold that to 0)
  for (int j = 1; j < 16; j++) m = lanes[j] > m ? lanes[j] : m;
  for (i64 u = 0; u < n; u++) bad |= x[u] != x[u];
  return bad ? NAN : m;
}

struct State {  // one work item's running softmax
  float m[MAX_M], l[MAX_M];
  std::vector<float> acc;  // [M, Dv]
};

struct Job {
  const float *q;
  i64 M, D, Dv;
  float scale, softcap;
};

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KV_SIMD 1

// [sum(a0), sum(a1), sum(a2), sum(a3)]
static inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Scores of MB query rows (q, q + D, ...) with the 4 keys k[0..3] into s[j * TILE + u]
// (D % 8 == 0): each key row is loaded once for all MB rows, the 4 * MB sums are
// independent chains, and one reduction gives a row's 4 scores.
template <int MB>
static inline void qk_block(const float *q, i64 D, const float *const *k, float *s) {
  __m256 acc[MB][4];
  for (int j = 0; j < MB; j++)
    for (int u = 0; u < 4; u++) acc[j][u] = _mm256_setzero_ps();
  for (i64 d = 0; d < D; d += 8) {
    __m256 qv[MB];
    for (int j = 0; j < MB; j++) qv[j] = _mm256_loadu_ps(q + j * D + d);
    for (int u = 0; u < 4; u++) {
      __m256 kv = _mm256_loadu_ps(k[u] + d);
      for (int j = 0; j < MB; j++) acc[j][u] = _mm256_fmadd_ps(qv[j], kv, acc[j][u]);
    }
  }
  for (int j = 0; j < MB; j++)
    _mm_storeu_ps(s + j * TILE, hsum4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
}

// o[j * Dv + c * 8 ..] += sum over t < n of w[j * TILE + t] * v(t)[c * 8 ..] for MB rows
// and C chunks of 8 channels at v's offset d0, accumulated in registers over the tile.
template <int MB, int C, class VRow>
static inline void pv_block(const float *w, VRow vrow, i64 n, i64 d0, float *o, i64 Dv) {
  __m256 acc[MB][C];
  for (int j = 0; j < MB; j++)
    for (int c = 0; c < C; c++) acc[j][c] = _mm256_loadu_ps(o + j * Dv + d0 + c * 8);
  for (i64 t = 0; t < n; t++) {
    const float *v = vrow(t) + d0;
    __m256 wt[MB];
    for (int j = 0; j < MB; j++) wt[j] = _mm256_broadcast_ss(w + j * TILE + t);
    for (int c = 0; c < C; c++) {
      __m256 vv = _mm256_loadu_ps(v + c * 8);
      for (int j = 0; j < MB; j++) acc[j][c] = _mm256_fmadd_ps(wt[j], vv, acc[j][c]);
    }
  }
  for (int j = 0; j < MB; j++)
    for (int c = 0; c < C; c++) _mm256_storeu_ps(o + j * Dv + d0 + c * 8, acc[j][c]);
}

// Scores s[m * TILE + t] = q_m . k_t of a tile (D % 8 == 0), rows in blocks of 3.
template <class KRow>
static inline void qk_tile(const float *q, i64 M, i64 D, KRow krow, i64 n, float *s) {
  float tmp[3 * TILE];
  for (i64 t = 0; t < n; t += 4) {
    const float *k[4];
    for (int u = 0; u < 4; u++) k[u] = krow(t + u < n ? t + u : n - 1);  // tail: repeats
    for (i64 m = 0; m < M; m += 3) {
      i64 mb = std::min<i64>(3, M - m);
      float *dst = t + 4 <= n ? s + m * TILE + t : tmp;  // a tail's 4 go to scratch
      if (mb == 3)
        qk_block<3>(q + m * D, D, k, dst);
      else if (mb == 2)
        qk_block<2>(q + m * D, D, k, dst);
      else
        qk_block<1>(q + m * D, D, k, dst);
      if (dst == tmp)
        for (i64 j = 0; j < mb; j++)
          for (i64 u = t; u < n; u++) s[(m + j) * TILE + u] = tmp[j * TILE + u - t];
    }
  }
}

// acc[m] += sum_t s[m * TILE + t] * v_t for every row m (Dv % 8 == 0).
template <class VRow>
static inline void pv_tile(const float *s, i64 M, i64 Dv, VRow vrow, i64 n, float *acc) {
  for (i64 m = 0; m < M; m += 3) {
    i64 mb = std::min<i64>(3, M - m);
    const float *w = s + m * TILE;
    float *o = acc + m * Dv;
    i64 d0 = 0;
    for (; d0 + 32 <= Dv; d0 += 32) {
      if (mb == 3)
        pv_block<3, 4>(w, vrow, n, d0, o, Dv);
      else if (mb == 2)
        pv_block<2, 4>(w, vrow, n, d0, o, Dv);
      else
        pv_block<1, 4>(w, vrow, n, d0, o, Dv);
    }
    for (; d0 < Dv; d0 += 8) {
      if (mb == 3)
        pv_block<3, 1>(w, vrow, n, d0, o, Dv);
      else if (mb == 2)
        pv_block<2, 1>(w, vrow, n, d0, o, Dv);
      else
        pv_block<1, 1>(w, vrow, n, d0, o, Dv);
    }
  }
}
#endif

// One tile of n keys into head h's running softmax st: key t's row at krow(t), its
// value's at vrow(t) (strided rows of one run, or rows gathered from many); s is an
// [M, TILE] scratch. q: the head's packed queries [M, D]. With AVX2 and FMA (and head
// dims that are multiples of 8) the scores and the weighted values are computed in
// register blocks of 3 query rows (qk_tile / pv_tile); otherwise in plain loops.
template <class KRow, class VRow>
static inline void attend_rows(const Job &J, const float *q, KRow krow, VRow vrow, i64 n,
                               State &st, float *s) {
  const i64 M = J.M, D = J.D, Dv = J.Dv;
#ifdef KV_SIMD
  const bool simd = D % 8 == 0 && Dv % 8 == 0;
  if (simd) qk_tile(q, M, D, krow, n, s);
#else
  const bool simd = false;
#endif
  for (i64 m = 0; m < M; m++) {
    float *sm = s + m * TILE;
    if (!simd)
      for (i64 t = 0; t < n; t++) sm[t] = dot(q + m * D, krow(t), D);
    for (i64 t = 0; t < n; t++) sm[t] *= J.scale;
    if (J.softcap > 0)
      for (i64 t = 0; t < n; t++) sm[t] = std::tanh(sm[t] / J.softcap) * J.softcap;
    float mx = vmax(sm, n, st.m[m]);
    float alpha = st.m[m] == -INFINITY ? 0.0f : fast_exp(st.m[m] - mx);
    float sum = 0;
    for (i64 t = 0; t < n; t++) sm[t] = fast_exp(sm[t] - mx);
    for (i64 t = 0; t < n; t++) sum += sm[t];
    st.l[m] = st.l[m] * alpha + sum;
    st.m[m] = mx;
    if (alpha != 1.0f) {
      float *o = st.acc.data() + m * Dv;
      for (i64 d = 0; d < Dv; d++) o[d] *= alpha;
    }
  }
#ifdef KV_SIMD
  if (simd) {
    pv_tile(s, M, Dv, vrow, n, st.acc.data());
    return;
  }
#endif
  for (i64 t = 0; t < n; t++) {
    const float *vt = vrow(t);
    for (i64 m = 0; m < M; m++) {
      float w = s[m * TILE + t];
      float *o = st.acc.data() + m * Dv;
      for (i64 d = 0; d < Dv; d++) o[d] += w * vt[d];
    }
  }
}

// attend_rows over n strided rows: k at stride ks, v at stride vs.
static inline void attend_tile(const Job &J, const float *q, const float *k, i64 ks,
                               const float *v, i64 vs, i64 n, State &st, float *s) {
  attend_rows(J, q, [k, ks](i64 t) { return k + t * ks; }, [v, vs](i64 t) { return v + t * vs; },
              n, st, s);
}

// An empty running softmax of M rows of Dv.
static inline void reset_state(State &st, i64 M, i64 Dv) {
  for (i64 m = 0; m < M; m++) st.m[m] = -INFINITY, st.l[m] = 0.0f;
  st.acc.assign((size_t)(M * Dv), 0.0f);
}

// 0 when field F (head dim `dim`) can be read, else the kv_attn_decode status.
static int check_field(const kv_field &F, i64 dim) {
  const i64 g = F.group;
  switch (F.format) {
    case KV_FMT_F32:
    case KV_FMT_F16:
    case KV_FMT_BF16:
    case KV_FMT_INT8:
      return 0;
    case KV_FMT_INT4_TOKEN:
      return g < 1 || dim % 2 || dim % g ? -3 : 0;
    case KV_FMT_INT4_CHANNEL:
      return g < 1 || dim % 2 ? -3 : 0;
    case KV_FMT_FP8_E4M3:
      return g < 1 ? -3 : 0;
  }
  return -2;
}

// How many token splits the work of one call's heads gets: about 4 items per thread
// (a worker that wakes late finds work left), each >= 512 tokens. A sequence's splits
// depend only on its own tokens, so a batched call gives each sequence the bits a
// call of its own gives it.
static i64 num_splits(int nth, i64 H, i64 total) {
  if (nth <= 1) return 1;
  return std::min<i64>((4 * nth + H - 1) / H, std::max<i64>(1, total / 512));
}

// Merge the `splits` states of each head (states[h * splits + sp]) into out / lse.
static void merge_splits(const State *states, i64 splits, i64 H, i64 M, i64 Dv, float *out,
                         float *lse) {
  for (i64 h = 0; h < H; h++) {
    for (i64 m = 0; m < M; m++) {
      float mx = -INFINITY;
      bool nan = false;
      for (i64 sp = 0; sp < splits; sp++) {
        float v = states[h * splits + sp].m[m];
        nan |= v != v;
        mx = std::max(mx, v);
      }
      float *o = out + (h * M + m) * Dv;
      for (i64 d = 0; d < Dv; d++) o[d] = nan ? NAN : 0.0f;
      if (nan) {
        lse[h * M + m] = NAN;
        continue;
      }
      if (mx == -INFINITY) {
        lse[h * M + m] = -INFINITY;
        continue;
      }
      float l = 0;
      for (i64 sp = 0; sp < splits; sp++) {
        const State &st = states[h * splits + sp];
        if (st.m[m] == -INFINITY) continue;
        float w = std::exp(st.m[m] - mx);
        l += st.l[m] * w;
        const float *a = st.acc.data() + m * Dv;
        for (i64 d = 0; d < Dv; d++) o[d] += w * a[d];
      }
      for (i64 d = 0; d < Dv; d++) o[d] /= l;
      lse[h * M + m] = mx + std::log(l);
    }
  }
}

