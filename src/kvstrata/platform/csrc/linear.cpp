// y = x @ w^T (+ bias) for a few rows of x: the model's projections in a decode step.
//
// x [M, K], w [N, K] (torch.nn.Linear's layout), y [M, N], all fp32 and contiguous.
// With few rows (M <= 16) the product is bound by reading w: each call streams w once,
// a few rows at a time, against the rows of x held in cache (it reads w several times
// as fast as the BLAS sgemm, made for large M, which packs w first:
// docs/MEASUREMENTS.md). Rows of w are shared out among `nth` workers in chunks; each
// output is a dot product of 8-wide (16-wide with AVX-512) lanes added in a fixed order,
// so the result does not depend on the thread count or on M.
//
// With AVX-512 four rows of w are read at once, 16 floats each, with no software
// prefetch: measured faster than two rows of 8 floats with prefetch on a decode step's
// projections, and level with MKL's sgemv (docs/MEASUREMENTS.md).

#include <algorithm>
#include <atomic>
#include <cstring>

#include "common.h"
#ifdef __FMA__
#include <immintrin.h>
#endif
#include "parallel.h"

#ifdef __FMA__
typedef __m256 v8;
static inline v8 load8(const float *p) { return _mm256_loadu_ps(p); }
static inline v8 zero8() { return _mm256_setzero_ps(); }
// acc + a * b with one rounding (the same in every instantiation: the tests compare
// rows computed alone and in a batch bit for bit)
static inline v8 fma8(v8 a, v8 b, v8 acc) { return _mm256_fmadd_ps(a, b, acc); }
static inline float fma1(float a, float b, float acc) { return __builtin_fmaf(a, b, acc); }
#else
typedef float v8 __attribute__((vector_size(32)));
static inline v8 load8(const float *p) {
  v8 r;
  memcpy(&r, p, sizeof r);
  return r;
}
static inline v8 zero8() { return v8{}; }
static inline v8 fma8(v8 a, v8 b, v8 acc) { return acc + a * b; }
static inline float fma1(float a, float b, float acc) { return acc + a * b; }
#endif

static inline float hsum(v8 a) {
  alignas(32) float t[8];
  memcpy(t, &a, sizeof t);
  return ((t[0] + t[4]) + (t[1] + t[5])) + ((t[2] + t[6]) + (t[3] + t[7]));
}

#ifndef PF
#define PF 128  // floats of w prefetched ahead
#endif

template <int MBR, bool TWO>
static void tile(const float *x, const float *w, const float *bias, float *y, i64 m0, i64 K,
                 i64 N, i64 n) {
  v8 a0[MBR], a1[MBR];
  for (int m = 0; m < MBR; m++) a0[m] = a1[m] = zero8();
  const float *w0 = w + n * K, *w1 = TWO ? w0 + K : w0;
  const float *xb = x + m0 * K;
  const i64 K8 = K & ~(i64)7;
  for (i64 k = 0; k < K8; k += 8) {
    __builtin_prefetch(w0 + k + PF);
    if (TWO) __builtin_prefetch(w1 + k + PF);
    v8 u = load8(w0 + k), v = TWO ? load8(w1 + k) : u;
#pragma GCC unroll 4
    for (int m = 0; m < MBR; m++) {
      v8 xm = load8(xb + m * K + k);
      a0[m] = fma8(xm, u, a0[m]);
      if (TWO) a1[m] = fma8(xm, v, a1[m]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MBR; m++) {
    const float *xm = xb + m * K;
    float s0 = hsum(a0[m]), s1 = TWO ? hsum(a1[m]) : 0.0f;
    for (i64 k = K8; k < K; k++) {
      s0 = fma1(xm[k], w0[k], s0);
      if (TWO) s1 = fma1(xm[k], w1[k], s1);
    }
    float *ym = y + (m0 + m) * N;
    ym[n] = bias ? s0 + bias[n] : s0;
    if (TWO) ym[n + 1] = bias ? s1 + bias[n + 1] : s1;
  }
}

template <bool TWO>
static void rows_times_pair(const float *x, const float *w, const float *bias, float *y, i64 M,
                            i64 K, i64 N, i64 n) {
  i64 m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) tile<4, TWO>(x, w, bias, y, m0, K, N, n);
  switch (M - m0) {
    case 3: return tile<3, TWO>(x, w, bias, y, m0, K, N, n);
    case 2: return tile<2, TWO>(x, w, bias, y, m0, K, N, n);
    case 1: return tile<1, TWO>(x, w, bias, y, m0, K, N, n);
  }
}

#ifdef __AVX512F__
// The 16-lane path: lane sums added in a fixed order, then the tail K % 16 in order.
static inline float hsum16(__m512 a) {
  alignas(64) float t[16];
  _mm512_store_ps(t, a);
  float s[8];
  for (int i = 0; i < 8; i++) s[i] = t[i] + t[i + 8];
  return ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
}

// Rows m0 .. m0 + MB - 1 of x times rows n .. n + cnt - 1 (cnt <= R) of w.
template <int MB, int R>
static void tile16(const float *x, const float *w, const float *bias, float *y, i64 m0, i64 K,
                   i64 N, i64 n, int cnt) {
  __m512 a[MB][R];
  for (int m = 0; m < MB; m++)
    for (int r = 0; r < R; r++) a[m][r] = _mm512_setzero_ps();
  const float *wr[R];
  for (int r = 0; r < R; r++) wr[r] = w + (n + (r < cnt ? r : 0)) * K;  // spare lanes: row n again
  const float *xb = x + m0 * K;
  const i64 K16 = K & ~(i64)15;
  for (i64 k = 0; k < K16; k += 16) {
    __m512 u[R];
    for (int r = 0; r < R; r++) u[r] = _mm512_loadu_ps(wr[r] + k);
    for (int m = 0; m < MB; m++) {
      const __m512 xm = _mm512_loadu_ps(xb + m * K + k);
      for (int r = 0; r < R; r++) a[m][r] = _mm512_fmadd_ps(xm, u[r], a[m][r]);
    }
  }
  for (int m = 0; m < MB; m++) {
    const float *xm = xb + m * K;
    float *ym = y + (m0 + m) * N;
    for (int r = 0; r < cnt; r++) {
      float s = hsum16(a[m][r]);
      for (i64 k = K16; k < K; k++) s = fma1(xm[k], wr[r][k], s);
      ym[n + r] = bias ? s + bias[n + r] : s;
    }
  }
}

static void rows_times_four(const float *x, const float *w, const float *bias, float *y, i64 M,
                            i64 K, i64 N, i64 n, int cnt) {
  i64 m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) tile16<4, 4>(x, w, bias, y, m0, K, N, n, cnt);
  switch (M - m0) {
    case 3: return tile16<3, 4>(x, w, bias, y, m0, K, N, n, cnt);
    case 2: return tile16<2, 4>(x, w, bias, y, m0, K, N, n, cnt);
    case 1: return tile16<1, 4>(x, w, bias, y, m0, K, N, n, cnt);
  }
}
#endif

// Returns 0, or -1 for arguments out of range (M < 1 or > 16, K or N < 1).
extern "C" int kv_linear_small(const float *x, const float *w, const float *bias, float *y,
                               i64 M, i64 K, i64 N, int nth) {
  if (M < 1 || M > 16 || K < 1 || N < 1) return -1;
  const i64 CHUNK = 16;  // rows of w per work item (a multiple of 4: groups never straddle)
  const i64 items = (N + CHUNK - 1) / CHUNK;
  std::atomic<i64> next{0};
  int workers = (int)std::max<i64>(1, std::min<i64>(nth, items / 4));
  kv_parallel(workers, [&](int) {
    for (i64 it; (it = next.fetch_add(1)) < items;) {
      i64 n0 = it * CHUNK, n1 = std::min(N, n0 + CHUNK);
#ifdef __AVX512F__
      for (i64 n = n0; n < n1; n += 4)
        rows_times_four(x, w, bias, y, M, K, N, n, (int)std::min<i64>(4, n1 - n));
#else
      i64 n = n0;
      for (; n + 2 <= n1; n += 2) rows_times_pair<true>(x, w, bias, y, M, K, N, n);
      if (n < n1) rows_times_pair<false>(x, w, bias, y, M, K, N, n);
#endif
    }
  });
  return 0;
}
