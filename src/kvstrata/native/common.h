// Types and scalar conversions shared by the kvstrata native kernels.
#pragma once

#include <cstdint>
#include <cstring>
#ifdef __F16C__
#include <immintrin.h>
#endif

typedef int64_t i64;
typedef uint8_t u8;
typedef uint16_t u16;
typedef uint32_t u32;
typedef uint64_t u64;
typedef _Float16 f16;
struct bf16 {
  u16 v;
};

static inline float ld(const float *p, i64 i) { return p[i]; }
static inline float ld(const f16 *p, i64 i) { return (float)p[i]; }
static inline float ld(const bf16 *p, i64 i) {
  u32 b = (u32)p[i].v << 16;
  float f;
  memcpy(&f, &b, 4);
  return f;
}

// GCC 12 does not vectorise _Float16 <-> float conversions without AVX512-FP16, so
// fp16 rows are converted in bulk with F16C.
static inline void f16_to_f32(const f16 *__restrict x, float *__restrict y, i64 n) {
  i64 d = 0;
#ifdef __F16C__
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(y + d, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + d))));
#endif
  for (; d < n; d++) y[d] = (float)x[d];
}
