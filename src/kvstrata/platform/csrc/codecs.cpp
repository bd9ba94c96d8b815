// kvstrata codec kernels: int8 / int4 (KIVI) / fp8 quantize and dequantize on CPU.
//
// Plain C ABI (no torch headers: compiles an order of magnitude faster), called through
// ctypes from kvstrata/codecs/_kernels.py; the eager torch reference these kernels
// must match bit for bit is kvstrata/codecs/_reference.py.
//
// Addressing: every tensor is [H, rows, cols] with the innermost dim contiguous;
// `*_sh` is the stride between heads, `*_st` the stride between rows of x/out
// (codec fields are row-contiguous: their row stride is their column count).
// `dt`: the element type of x / out, an `enum kv_dtype` (common.h).
// Return value: bit 0 = non-finite input, bit 1 = fp16 scale/zero overflow.
//
// Compiled with -ffinite-math-only -fno-signed-zeros (so min/max reductions
// vectorise) and -ffp-contract=off (so a*b+c rounds twice, exactly as torch eager
// does). Finiteness is therefore checked on the raw bits, never with isfinite().

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>
#include <type_traits>
#include <vector>

#include "common.h"

static inline void st(float *p, i64 i, float f) { p[i] = f; }
static inline void st(f16 *p, i64 i, float f) { p[i] = (f16)f; }
static inline void st(bf16 *p, i64 i, float f) {
  u32 b;
  memcpy(&b, &f, 4);
  b += 0x7FFFu + ((b >> 16) & 1u);  // round to nearest even (inputs are finite)
  p[i].v = (u16)(b >> 16);
}
static inline int bad(const float *p, i64 i) {
  u32 b;
  memcpy(&b, p + i, 4);
  return (b & 0x7F800000u) == 0x7F800000u;
}
static inline int bad(const f16 *p, i64 i) {
  u16 b;
  memcpy(&b, p + i, 2);
  return (b & 0x7C00u) == 0x7C00u;
}
static inline int bad(const bf16 *p, i64 i) { return (p[i].v & 0x7F80u) == 0x7F80u; }
static inline int bad16(f16 h) {
  u16 b;
  memcpy(&b, &h, 2);
  return (b & 0x7C00u) == 0x7C00u;
}

// fp16 rows are converted in bulk (f16_to_f32 / f32_to_f16, F16C) and the fp32 loops
// run on the copy.
static inline void f32_to_f16(const float *__restrict y, f16 *__restrict x, i64 n) {
  i64 d = 0;
#ifdef __F16C__
  for (; d + 8 <= n; d += 8)
    _mm_storeu_si128((__m128i *)(x + d),
                     _mm256_cvtps_ph(_mm256_loadu_ps(y + d),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; d < n; d++) x[d] = (f16)y[d];
}

#define IS_F16 std::is_same<T, f16>::value

// Split [0, n) over up to nth threads; small jobs stay on the calling thread.
template <class F>
static int pfor(i64 n, i64 work, int nth, F f) {
  std::atomic<int> flags{0};
  if (nth <= 1 || n < 2 || work < (1 << 18)) return f(0, n);
  nth = (int)std::min<i64>(nth, n);
  i64 chunk = (n + nth - 1) / nth;
  std::vector<std::thread> ts;
  for (int t = 1; t < nth; t++) {
    i64 a = t * chunk, b = std::min(n, a + chunk);
    if (a < b) ts.emplace_back([&, a, b] { flags |= f(a, b); });
  }
  flags |= f(0, std::min(n, chunk));
  for (auto &t : ts) t.join();
  return flags.load();
}

// Asymmetric min/max parameters in fp16: scale = (max - min) / levels, zero = min.
static inline int params(float mn, float mx, float levels, f16 *s, f16 *z, float *sf, float *zf,
                         float *inv) {
  f16 s16 = (f16)((mx - mn) / levels), z16 = (f16)mn;
  *s = s16;
  *z = z16;
  *sf = (float)s16;
  *zf = (float)z16;
  *inv = *sf > 0.0f ? 1.0f / *sf : 0.0f;  // all-equal group: every code is 0, value = zero
  return (bad16(s16) | bad16(z16)) << 1;
}

static inline u8 quant(float v, float zf, float inv, float top) {
  float q = rintf((v - zf) * inv);
  q = q < 0.0f ? 0.0f : q;
  q = q > top ? top : q;
  return (u8)(int)q;
}

// Row helpers. Loop bounds and pointers are plain parameters (never lambda captures):
// a uint8_t store may alias anything, so captured bounds would be reloaded after
// every store and the loops would not vectorise.
template <class T>
static inline int minmax_row(const T *__restrict x, i64 n, float *mn_out, float *mx_out) {
  if constexpr (IS_F16) {
    float tmp[4096];
    f16_to_f32((const f16 *)x, tmp, n);
    return minmax_row<float>(tmp, n, mn_out, mx_out);
  } else {
  float mn = ld(x, 0), mx = mn;
  int bd = 0;
  for (i64 d = 0; d < n; d++) {
    float v = ld(x, d);
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
    bd |= bad(x, d);
  }
  *mn_out = mn;
  *mx_out = mx;
  return bd;
  }
}

template <class T>
static inline void quant_row(const T *__restrict x, u8 *__restrict q, i64 n, float zf, float inv,
                             float top) {
  if constexpr (IS_F16) {
    float tmp[4096];
    f16_to_f32((const f16 *)x, tmp, n);
    quant_row<float>(tmp, q, n, zf, inv, top);
    return;
  } else {
  for (i64 d = 0; d < n; d++) q[d] = quant(ld(x, d), zf, inv, top);
  }
}

template <class T>
static inline int minmax_col(const T *__restrict x, i64 n, float *__restrict mn,
                             float *__restrict mx) {
  if constexpr (IS_F16) {
    float tmp[4096];
    f16_to_f32((const f16 *)x, tmp, n);
    return minmax_col<float>(tmp, n, mn, mx);
  } else {
  int bd = 0;
  for (i64 d = 0; d < n; d++) {
    float v = ld(x, d);
    mn[d] = v < mn[d] ? v : mn[d];
    mx[d] = v > mx[d] ? v : mx[d];
    bd |= bad(x, d);
  }
  return bd;
  }
}

template <class T>
static inline void quant_row_ch(const T *__restrict x, u8 *__restrict q, i64 n,
                                const float *__restrict zf, const float *__restrict inv) {
  if constexpr (IS_F16) {
    float tmp[4096];
    f16_to_f32((const f16 *)x, tmp, n);
    quant_row_ch<float>(tmp, q, n, zf, inv);
    return;
  } else {
  for (i64 d = 0; d < n; d++) q[d] = quant(ld(x, d), zf[d], inv[d], 15.0f);
  }
}

static inline void pack_row(const u8 *__restrict tmp, u8 *__restrict q, i64 half) {
  for (i64 j = 0; j < half; j++) q[j] = (u8)(tmp[j] | (tmp[j + half] << 4));
}

template <class T>
static inline void dequant_row(const u8 *__restrict q, T *__restrict o, i64 n, float sf,
                               float zf) {
  if constexpr (IS_F16) {
    float tmp[4096];
    dequant_row<float>(q, tmp, n, sf, zf);
    f32_to_f16(tmp, (f16 *)o, n);
  } else {
  for (i64 d = 0; d < n; d++) st(o, d, (float)q[d] * sf + zf);
  }
}

template <class T>
static inline void dequant_lo(const u8 *__restrict q, T *__restrict o, i64 n, float sf, float zf) {
  if constexpr (IS_F16) {
    float tmp[4096];
    dequant_lo<float>(q, tmp, n, sf, zf);
    f32_to_f16(tmp, (f16 *)o, n);
  } else {
  for (i64 d = 0; d < n; d++) st(o, d, (float)(q[d] & 15) * sf + zf);
  }
}

template <class T>
static inline void dequant_hi(const u8 *__restrict q, T *__restrict o, i64 n, float sf, float zf) {
  if constexpr (IS_F16) {
    float tmp[4096];
    dequant_hi<float>(q, tmp, n, sf, zf);
    f32_to_f16(tmp, (f16 *)o, n);
  } else {
  for (i64 d = 0; d < n; d++) st(o, d, (float)(q[d] >> 4) * sf + zf);
  }
}

template <class T>
static inline void dequant_lo_ch(const u8 *__restrict q, T *__restrict o, i64 n,
                                 const float *__restrict sf, const float *__restrict zf) {
  if constexpr (IS_F16) {
    float tmp[4096];
    dequant_lo_ch<float>(q, tmp, n, sf, zf);
    f32_to_f16(tmp, (f16 *)o, n);
  } else {
  for (i64 d = 0; d < n; d++) st(o, d, (float)(q[d] & 15) * sf[d] + zf[d]);
  }
}

template <class T>
static inline void dequant_hi_ch(const u8 *__restrict q, T *__restrict o, i64 n,
                                 const float *__restrict sf, const float *__restrict zf) {
  if constexpr (IS_F16) {
    float tmp[4096];
    dequant_hi_ch<float>(q, tmp, n, sf, zf);
    f32_to_f16(tmp, (f16 *)o, n);
  } else {
  for (i64 d = 0; d < n; d++) st(o, d, (float)(q[d] >> 4) * sf[d] + zf[d]);
  }
}

// ---------------------------------------------------------------- int8, per token
template <class T>
static int int8_enc(const T *x, i64 xsh, i64 xst, u8 *q, i64 qsh, f16 *s, i64 ssh, f16 *z,
                    i64 zsh, i64 H, i64 R, i64 D, int nth) {
  return pfor(H * R, H * R * D, nth, [=](i64 a, i64 b) {
    int flags = 0;
    for (i64 u = a; u < b; u++) {
      i64 h = u / R, r = u % R;
      const T *xr = x + h * xsh + r * xst;
      float mn, mx, sf, zf, inv;
      if (minmax_row(xr, D, &mn, &mx)) return flags | 1;
      flags |= params(mn, mx, 255.0f, s + h * ssh + r, z + h * zsh + r, &sf, &zf, &inv);
      quant_row(xr, q + h * qsh + r * D, D, zf, inv, 255.0f);
    }
    return flags;
  });
}

template <class T>
static int int8_dec(const u8 *q, i64 qsh, const f16 *s, i64 ssh, const f16 *z, i64 zsh, T *o,
                    i64 osh, i64 ost, i64 H, i64 R, i64 D, int nth) {
  return pfor(H * R, H * R * D, nth, [=](i64 a, i64 b) {
    for (i64 u = a; u < b; u++) {
      i64 h = u / R, r = u % R;
      float sf = (float)s[h * ssh + r], zf = (float)z[h * zsh + r];
      dequant_row(q + h * qsh + r * D, o + h * osh + r * ost, D, sf, zf);
    }
    return 0;
  });
}

// ------------------------------------- int4 values: per token, groups of G channels
// Packing: byte j holds channel j (low nibble) and channel j + D/2 (high nibble).
template <class T>
static int int4v_enc(const T *x, i64 xsh, i64 xst, u8 *q, i64 qsh, f16 *s, i64 ssh, f16 *z,
                     i64 zsh, i64 H, i64 R, i64 D, i64 G, int nth) {
  return pfor(H * R, H * R * D, nth, [=](i64 a, i64 b) {
    int flags = 0;
    u8 tmp[4096];
    const i64 NG = D / G, half = D / 2;
    for (i64 u = a; u < b; u++) {
      i64 h = u / R, r = u % R;
      const T *xr = x + h * xsh + r * xst;
      f16 *sr = s + h * ssh + r * NG, *zr = z + h * zsh + r * NG;
      for (i64 g = 0; g < NG; g++) {
        const T *xg = xr + g * G;
        float mn, mx, sf, zf, inv;
        if (minmax_row(xg, G, &mn, &mx)) return flags | 1;
        flags |= params(mn, mx, 15.0f, sr + g, zr + g, &sf, &zf, &inv);
        quant_row(xg, tmp + g * G, G, zf, inv, 15.0f);
      }
      pack_row(tmp, q + h * qsh + r * half, half);
    }
    return flags;
  });
}

template <class T>
static int int4v_dec(const u8 *q, i64 qsh, const f16 *s, i64 ssh, const f16 *z, i64 zsh, T *o,
                     i64 osh, i64 ost, i64 H, i64 R, i64 D, i64 G, int nth) {
  return pfor(H * R, H * R * D, nth, [=](i64 a, i64 b) {
    const i64 NG = D / G, half = D / 2;
    for (i64 u = a; u < b; u++) {
      i64 h = u / R, r = u % R;
      const u8 *qr = q + h * qsh + r * half;
      const f16 *sr = s + h * ssh + r * NG, *zr = z + h * zsh + r * NG;
      T *orow = o + h * osh + r * ost;
      for (i64 g = 0; g < NG; g++) {
        float sf = (float)sr[g], zf = (float)zr[g];
        // A group may straddle the low-/high-nibble boundary at D/2: two segments.
        i64 lo0 = g * G, lo1 = std::min(lo0 + G, half);
        if (lo1 > lo0) dequant_lo(qr + lo0, orow + lo0, lo1 - lo0, sf, zf);
        i64 hi0 = std::max(lo0, half), hi1 = lo0 + G;
        if (hi1 > hi0) dequant_hi(qr + hi0 - half, orow + hi0, hi1 - hi0, sf, zf);
      }
    }
    return 0;
  });
}

// -------------------------------------- int4 keys: per channel, groups of G tokens
template <class T>
static int int4k_enc(const T *x, i64 xsh, i64 xst, u8 *q, i64 qsh, f16 *s, i64 ssh, f16 *z,
                     i64 zsh, i64 H, i64 R, i64 D, i64 G, int nth) {
  const i64 NGR = R / G;
  return pfor(H * NGR, H * R * D, nth, [=](i64 a, i64 b) {
    int flags = 0;
    float mn[4096], mx[4096], zf[4096], inv[4096];
    u8 tmp[4096];
    const i64 half = D / 2;
    for (i64 u = a; u < b; u++) {
      i64 h = u / NGR, gr = u % NGR;
      const T *x0 = x + h * xsh + gr * G * xst;
      int bd = 0;
      for (i64 d = 0; d < D; d++) mn[d] = mx[d] = ld(x0, d);
      for (i64 r = 0; r < G; r++) bd |= minmax_col(x0 + r * xst, D, mn, mx);
      if (bd) return flags | 1;
      f16 *sr = s + h * ssh + gr * D, *zr = z + h * zsh + gr * D;
      int ov = 0;
      for (i64 d = 0; d < D; d++) {
        f16 s16 = (f16)((mx[d] - mn[d]) / 15.0f), z16 = (f16)mn[d];
        sr[d] = s16;
        zr[d] = z16;
        ov |= bad16(s16) | bad16(z16);
        float sf = (float)s16;
        zf[d] = (float)z16;
        inv[d] = sf > 0.0f ? 1.0f / sf : 0.0f;
      }
      flags |= ov << 1;
      for (i64 r = 0; r < G; r++) {
        const T *xr = x0 + r * xst;
        quant_row_ch(xr, tmp, D, zf, inv);
        pack_row(tmp, q + h * qsh + (gr * G + r) * half, half);
      }
    }
    return flags;
  });
}

template <class T>
static int int4k_dec(const u8 *q, i64 qsh, const f16 *s, i64 ssh, const f16 *z, i64 zsh, T *o,
                     i64 osh, i64 ost, i64 H, i64 R, i64 D, i64 G, int nth) {
  const i64 NGR = R / G;
  return pfor(H * NGR, H * R * D, nth, [=](i64 a, i64 b) {
    float sf[4096], zf[4096];
    const i64 half = D / 2;
    for (i64 u = a; u < b; u++) {
      i64 h = u / NGR, gr = u % NGR;
      const f16 *sr = s + h * ssh + gr * D, *zr = z + h * zsh + gr * D;
      for (i64 d = 0; d < D; d++) {
        sf[d] = (float)sr[d];
        zf[d] = (float)zr[d];
      }
      for (i64 r = gr * G; r < (gr + 1) * G; r++) {
        const u8 *qr = q + h * qsh + r * half;
        T *orow = o + h * osh + r * ost;
        dequant_lo_ch(qr, orow, half, sf, zf);
        dequant_hi_ch(qr, orow + half, half, sf + half, zf + half);
      }
    }
    return 0;
  });
}

// ------------------------------------------ fp8 e4m3fn, one fp32 scale per block
// fp32 -> e4m3fn, round to nearest even, |v| <= 448 (the caller clamps).
static inline u8 to_e4m3(float v) {
  u32 b;
  memcpy(&b, &v, 4);
  u32 sign = (b >> 24) & 0x80u, a = b & 0x7FFFFFFFu;
  float av;
  memcpy(&av, &a, 4);
  u32 normal = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;  // exponent|3 mantissa bits, RNE
  normal -= (127u - 7u) << 3;
  u32 sub = (u32)(int)rintf(av * 512.0f);  // units of 2^-9; 8 is the smallest normal
  u32 r = a < 0x3C800000u ? sub : normal;  // 0x3C800000 = 2^-6
  return (u8)(sign | r);
}

static inline float from_e4m3(u8 c) {
  u32 sign = (u32)(c & 0x80u) << 24, e = (c >> 3) & 15u, m = c & 7u;
  u32 nb = sign | ((e + 120u) << 23) | (m << 20);
  float fn, fs = (float)m * (1.0f / 512.0f);
  memcpy(&fn, &nb, 4);
  return e == 0 ? (sign ? -fs : fs) : fn;
}

template <class T>
static inline int absmax_row(const T *__restrict x, i64 n, float *amax_io) {
  if constexpr (IS_F16) {
    float tmp[4096];
    f16_to_f32((const f16 *)x, tmp, n);
    return absmax_row<float>(tmp, n, amax_io);
  } else {
  float amax = *amax_io;
  int bd = 0;
  for (i64 d = 0; d < n; d++) {
    float v = fabsf(ld(x, d));
    amax = v > amax ? v : amax;
    bd |= bad(x, d);
  }
  *amax_io = amax;
  return bd;
  }
}

template <class T>
static inline void fp8_row(const T *__restrict x, u8 *__restrict q, i64 n, float inv) {
  if constexpr (IS_F16) {
    float tmp[4096];
    f16_to_f32((const f16 *)x, tmp, n);
    fp8_row<float>(tmp, q, n, inv);
    return;
  } else {
  for (i64 d = 0; d < n; d++) {
    float v = ld(x, d) * inv;
    v = v < -448.0f ? -448.0f : (v > 448.0f ? 448.0f : v);
    q[d] = to_e4m3(v);
  }
  }
}

template <class T>
static inline void fp8_dec_row(const u8 *__restrict q, T *__restrict o, i64 n, float sc) {
  if constexpr (IS_F16) {
    float tmp[4096];
    fp8_dec_row<float>(q, tmp, n, sc);
    f32_to_f16(tmp, (f16 *)o, n);
  } else {
  for (i64 d = 0; d < n; d++) st(o, d, from_e4m3(q[d]) * sc);
  }
}

template <class T>
static int fp8_enc(const T *x, i64 xsh, i64 xst, u8 *q, i64 qsh, float *s, i64 ssh, i64 H,
                   i64 R, i64 D, i64 BS, int nth) {
  const i64 NB = R / BS;
  return pfor(H * NB, H * R * D, nth, [=](i64 a, i64 b) {
    for (i64 u = a; u < b; u++) {
      i64 h = u / NB, blk = u % NB;
      const T *x0 = x + h * xsh + blk * BS * xst;
      float amax = 0.0f;
      int bd = 0;
      for (i64 r = 0; r < BS; r++) bd |= absmax_row(x0 + r * xst, D, &amax);
      if (bd) return 1;
      float sc = amax / 448.0f, inv = sc > 0.0f ? 1.0f / sc : 0.0f;
      s[h * ssh + blk] = sc;
      for (i64 r = 0; r < BS; r++) fp8_row(x0 + r * xst, q + h * qsh + (blk * BS + r) * D, D, inv);
    }
    return 0;
  });
}

template <class T>
static int fp8_dec(const u8 *q, i64 qsh, const float *s, i64 ssh, T *o, i64 osh, i64 ost, i64 H,
                   i64 R, i64 D, i64 BS, int nth) {
  const i64 NB = R / BS;
  return pfor(H * NB, H * R * D, nth, [=](i64 a, i64 b) {
    for (i64 u = a; u < b; u++) {
      i64 h = u / NB, blk = u % NB;
      float sc = s[h * ssh + blk];
      for (i64 r = blk * BS; r < (blk + 1) * BS; r++) {
        fp8_dec_row(q + h * qsh + r * D, o + h * osh + r * ost, D, sc);
      }
    }
    return 0;
  });
}

// ------------------------------------------------------------ C entry points
#define DISPATCH(dt, CALL)             \
  switch (dt) {                        \
    case KV_DTYPE_F32: {               \
      typedef float T;                 \
      return CALL;                     \
    }                                  \
    case KV_DTYPE_F16: {               \
      typedef f16 T;                   \
      return CALL;                     \
    }                                  \
    case KV_DTYPE_BF16: {              \
      typedef bf16 T;                  \
      return CALL;                     \
    }                                  \
  }                                    \
  return -1;

extern "C" {
int kv_int8_enc(int dt, const void *x, i64 xsh, i64 xst, void *q, i64 qsh, void *s, i64 ssh,
                void *z, i64 zsh, i64 H, i64 R, i64 D, i64 G, int nth) {
  (void)G;
  DISPATCH(dt, int8_enc((const T *)x, xsh, xst, (u8 *)q, qsh, (f16 *)s, ssh, (f16 *)z, zsh, H,
                        R, D, nth))
}
int kv_int8_dec(int dt, const void *q, i64 qsh, const void *s, i64 ssh, const void *z, i64 zsh,
                void *o, i64 osh, i64 ost, i64 H, i64 R, i64 D, i64 G, int nth) {
  (void)G;
  DISPATCH(dt, int8_dec((const u8 *)q, qsh, (const f16 *)s, ssh, (const f16 *)z, zsh, (T *)o,
                        osh, ost, H, R, D, nth))
}
int kv_int4v_enc(int dt, const void *x, i64 xsh, i64 xst, void *q, i64 qsh, void *s, i64 ssh,
                 void *z, i64 zsh, i64 H, i64 R, i64 D, i64 G, int nth) {
  DISPATCH(dt, int4v_enc((const T *)x, xsh, xst, (u8 *)q, qsh, (f16 *)s, ssh, (f16 *)z, zsh, H,
                         R, D, G, nth))
}
int kv_int4v_dec(int dt, const void *q, i64 qsh, const void *s, i64 ssh, const void *z, i64 zsh,
                 void *o, i64 osh, i64 ost, i64 H, i64 R, i64 D, i64 G, int nth) {
  DISPATCH(dt, int4v_dec((const u8 *)q, qsh, (const f16 *)s, ssh, (const f16 *)z, zsh, (T *)o,
                         osh, ost, H, R, D, G, nth))
}
int kv_int4k_enc(int dt, const void *x, i64 xsh, i64 xst, void *q, i64 qsh, void *s, i64 ssh,
                 void *z, i64 zsh, i64 H, i64 R, i64 D, i64 G, int nth) {
  DISPATCH(dt, int4k_enc((const T *)x, xsh, xst, (u8 *)q, qsh, (f16 *)s, ssh, (f16 *)z, zsh, H,
                         R, D, G, nth))
}
int kv_int4k_dec(int dt, const void *q, i64 qsh, const void *s, i64 ssh, const void *z, i64 zsh,
                 void *o, i64 osh, i64 ost, i64 H, i64 R, i64 D, i64 G, int nth) {
  DISPATCH(dt, int4k_dec((const u8 *)q, qsh, (const f16 *)s, ssh, (const f16 *)z, zsh, (T *)o,
                         osh, ost, H, R, D, G, nth))
}
int kv_fp8_enc(int dt, const void *x, i64 xsh, i64 xst, void *q, i64 qsh, void *s, i64 ssh,
               void *z, i64 zsh, i64 H, i64 R, i64 D, i64 G, int nth) {
  (void)z;
  (void)zsh;
  DISPATCH(dt, fp8_enc((const T *)x, xsh, xst, (u8 *)q, qsh, (float *)s, ssh, H, R, D, G, nth))
}
int kv_fp8_dec(int dt, const void *q, i64 qsh, const void *s, i64 ssh, const void *z, i64 zsh,
               void *o, i64 osh, i64 ost, i64 H, i64 R, i64 D, i64 G, int nth) {
  (void)z;
  (void)zsh;
  DISPATCH(dt, fp8_dec((const u8 *)q, qsh, (const float *)s, ssh, (T *)o, osh, ost, H, R, D, G,
                       nth))
}
}
