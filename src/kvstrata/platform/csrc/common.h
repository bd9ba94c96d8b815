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

// ---- shared with Python: kvstrata/formats.py mirrors everything in this section and
// tests/test_formats.py checks that the two agree. Change both together.

// Element type of raw K/V rows: the codec kernels' `dt` (kvstrata.formats.DType).
enum kv_dtype { KV_DTYPE_F32 = 0, KV_DTYPE_F16 = 1, KV_DTYPE_BF16 = 2 };

// How the decode attention reads one field in place (kvstrata.formats.FieldFormat).
//   F32 / F16 / BF16: raw rows (same numbers as kv_dtype).
//   INT8: u8 codes [rows, D], fp16 scale and zero [rows, 1] (per token).
//   INT4_TOKEN: values, per token: nibbles [rows, D/2] (byte j = channel j low,
//     channel j + D/2 high), fp16 scale/zero [rows, D/group].
//   INT4_CHANNEL: keys, per channel: same nibbles, fp16 scale/zero [rows/group, D].
//   FP8_E4M3: e4m3fn codes [rows, D], one fp32 scale per `group` rows, no zero point.
enum kv_format {
  KV_FMT_F32 = 0,
  KV_FMT_F16 = 1,
  KV_FMT_BF16 = 2,
  KV_FMT_INT8 = 3,
  KV_FMT_INT4_TOKEN = 4,
  KV_FMT_INT4_CHANNEL = 5,
  KV_FMT_FP8_E4M3 = 6,
};
static_assert(KV_FMT_F32 == (int)KV_DTYPE_F32 && KV_FMT_F16 == (int)KV_DTYPE_F16 &&
                  KV_FMT_BF16 == (int)KV_DTYPE_BF16,
              "raw formats are numbered as their dtypes");

// One field (K or V) of one part of a decode attention call (kvstrata.formats.
// FieldDesc). Strides in bytes; token t of the part is arena row row0 + t; pointers
// and strides a format does not use are 0.
struct kv_field {
  const void *data;  // rows or codes, [H, rows, ...]
  const void *scale;
  const void *zero;
  i64 data_head_stride, data_row_stride;
  i64 scale_head_stride, zero_head_stride;
  i64 group;  // int4: group size; fp8: rows per scale
  i64 row0;
  int32_t format;  // enum kv_format
};

// One part (kvstrata.formats.PartDesc): `tokens` keys, their K and V fields.
struct kv_part {
  i64 tokens;
  kv_field k, v;
};
// ---- end of the shared section

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
