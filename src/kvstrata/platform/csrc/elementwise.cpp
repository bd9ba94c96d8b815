// Decode-sized elementwise steps of the engine's lean forward (integrations/hf/lean_ops.py),
// bit-identical to the torch eager fp32 ops they replace: compiled with -ffp-contract=off,
// so every product and every sum rounds on its own, as torch's separate kernels round
// them. They exist because a decode step runs them on a few hundred floats, where each
// torch op costs its dispatch (microseconds once the step's weights have gone through the
// caches: docs/MEASUREMENTS.md) and the arithmetic is nothing: RoPE is 7 ops per tensor,
// RMSNorm 6.

#include <cmath>

#include "common.h"

// Rotary embedding of q and k ([H, T, D] views: element stride 1, head and token strides
// in floats: x's `s`, the output's `o`), out = x * cos + rotate_half(x) * sin with
// rotate_half(x) = (-x2, x1), cos and sin [T, D] (token stride `cst`). As transformers'
// apply_rotary_pos_emb: (-a) * b is -(a * b) exactly, so negating first changes nothing.
struct strides {
  i64 hs, ts, ohs, ots;
};

static void rope_one(const float *x, float *y, i64 heads, i64 tokens, i64 dim, strides st,
                     const float *cos, const float *sin, i64 cst) {
  const i64 half = dim / 2;
  for (i64 h = 0; h < heads; h++)
    for (i64 t = 0; t < tokens; t++) {
      const float *xr = x + h * st.hs + t * st.ts;
      float *yr = y + h * st.ohs + t * st.ots;
      const float *c = cos + t * cst, *s = sin + t * cst;
      for (i64 d = 0; d < half; d++) {
        const float a = xr[d] * c[d], b = -xr[d + half] * s[d];
        yr[d] = a + b;
      }
      for (i64 d = half; d < dim; d++) {
        const float a = xr[d] * c[d], b = xr[d - half] * s[d];
        yr[d] = a + b;
      }
    }
}

// Returns 0, or -1 for arguments out of range (odd or non-positive dim, negative counts).
// qs, ks: (head stride, token stride) of q, its output, k, its output.
extern "C" int kv_rope(const float *q, float *qo, i64 hq, const i64 *qs, const float *k,
                       float *ko, i64 hk, const i64 *ks, i64 tokens, i64 dim, const float *cos,
                       const float *sin, i64 cst) {
  if (dim < 2 || dim % 2 || tokens < 0 || hq < 0 || hk < 0) return -1;
  rope_one(q, qo, hq, tokens, dim, {qs[0], qs[1], qs[2], qs[3]}, cos, sin, cst);
  rope_one(k, ko, hk, tokens, dim, {ks[0], ks[1], ks[2], ks[3]}, cos, sin, cst);
  return 0;
}

// The part of RMSNorm after the variance: y[r] = w * (x[r] * rsqrt(var[r] + eps)), x and
// y [rows, dim] contiguous, var [rows]. torch's rsqrt on fp32 is 1 / sqrt (both correctly
// rounded), and `var + eps` adds eps as a float.
extern "C" int kv_rms_scale(const float *x, const float *var, const float *w, float eps, float *y,
                            i64 rows, i64 dim) {
  if (rows < 0 || dim < 1) return -1;
  for (i64 r = 0; r < rows; r++) {
    const float inv = 1.0f / std::sqrt(var[r] + eps);
    const float *xr = x + r * dim;
    float *yr = y + r * dim;
    for (i64 d = 0; d < dim; d++) yr[d] = w[d] * (xr[d] * inv);
  }
  return 0;
}
