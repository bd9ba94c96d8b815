// kvstrata decode attention over tiered parts, on the CPU.
//
// One call attends a few packed queries (pack-GQA: [Hkv, M, D], M = R * new tokens)
// over the union of any number of key/value "parts" — runs of blocks in the device
// arena, the host arena, compressed host blocks — where they live and in the format
// they are stored in: fp32 / fp16 / bf16, int8 per token, fp8 e4m3, or int4 KIVI
// (keys grouped per channel over tokens, values per token over channels). Quantized
// blocks are decoded a tile of TILE tokens at a time into an L1-resident buffer, so a
// step reads e.g. 4.5 bits per cached element (int4 g64) instead of dequantizing the
// whole history to memory and reading it back.
//
// Online softmax (flash-decoding): the tokens of all parts are split into work items
// (head, token range) over `nth` threads; each keeps a running max, sum and
// accumulator; the splits of a head are merged with log-sum-exp at the end.
//
// Output: out [Hkv, M, Dv] fp32 (normalized), lse [Hkv, M] natural log (-inf for a
// row with no keys). Masks are the caller's business: every query sees every key
// of every part (true in decode; the caller clips parts to a sliding window).
//
// Parts are an array of `struct kv_part` (common.h): a token count, then K's and V's
// `struct kv_field` (pointers, byte strides, group, first arena row, and the
// `enum kv_format` the field is stored in). Rows are arena rows: token t of the part
// is row row0 + t.

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <functional>
#include <mutex>
#include <system_error>
#include <thread>
#include <vector>

#include "common.h"
#include "parallel.h"

static const int TILE = 32;
static const int MAX_M = 64;     // packed query rows per head
static const int MAX_D = 512;    // head dim

// Threads: torch's own OpenMP team when the process has one (libgomp.so.1 is already
// loaded by torch): its workers are awake right after torch's last parallel op, so a
// parallel region costs microseconds, and the kernel never competes with a second
// pool for the cores. Otherwise std::thread (tens of microseconds per spawn).
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
typedef int (*omp_int_fn)(void);
static std::atomic<gomp_parallel_fn> g_parallel{nullptr};
static std::atomic<omp_int_fn> g_thread_num{nullptr};
static std::atomic<bool> g_omp_decided{false};  // set by kv_use_openmp: no guessing

// `path`: the libgomp file torch loaded (wheels may rename it); only a library that
// is already loaded is used (RTLD_NOLOAD), never a second OpenMP runtime. "-" turns
// it off (std::thread workers; tests use this to cover that path).
static int use_openmp(const char *path) {
  if (path && !strcmp(path, "-")) {
    g_parallel = nullptr;
    return 0;
  }
  void *h = dlopen(path && *path ? path : "libgomp.so.1", RTLD_NOLOAD | RTLD_LAZY);
  if (!h) return 0;
  auto par = (gomp_parallel_fn)dlsym(h, "GOMP_parallel");
  auto tid = (omp_int_fn)dlsym(h, "omp_get_thread_num");
  if (!par || !tid) return 0;
  g_thread_num = tid;
  g_parallel = par;
  return 1;
}

extern "C" int kv_use_openmp(const char *path) {
  g_omp_decided = true;
  return use_openmp(path);
}

static void init_gomp() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (!g_omp_decided) use_openmp(nullptr);
  });
}

static void trampoline(void *f) { (*(std::function<void(int)> *)f)(g_thread_num.load()()); }

// Run f(worker) on up to `nth` workers (worker 0 is the calling thread); f must share
// the work dynamically, so fewer workers (a thread that could not start) still finish.
// (Also the other kernels' thread runner: declared in parallel.h.)
void kv_parallel(int nth, std::function<void(int)> f) {
  if (nth <= 1) return f(0);
  init_gomp();
  if (auto par = g_parallel.load()) return par(trampoline, &f, (unsigned)nth, 0);
  std::vector<std::thread> ts;
  try {
    for (int w = 1; w < nth; w++) ts.emplace_back(f, w);
  } catch (const std::system_error &) {  // out of threads: the others do the work
  }
  f(0);
  for (auto &t : ts) t.join();
}

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
  int nparts;
  const kv_part *parts;
  const float *q;
  i64 H, M, D, Dv;
  float scale, softcap;
};

// Attend head h over tokens [a, b) of the concatenated parts, into st.
static void attend_range(const Job &J, i64 h, i64 a, i64 b, State &st) {
  const i64 M = J.M, D = J.D, Dv = J.Dv;
  for (i64 m = 0; m < M; m++) st.m[m] = -INFINITY, st.l[m] = 0.0f;
  st.acc.assign((size_t)(M * Dv), 0.0f);
  const float *q = J.q + h * M * D;
  // tile buffers on the heap (a few KiB): OpenMP workers may have small stacks
  std::vector<float> kvec((size_t)(TILE * D)), vvec((size_t)(TILE * Dv)), svec((size_t)(M * TILE));
  float *kbuf = kvec.data(), *vbuf = vvec.data(), *s = svec.data();
  i64 base = 0;
  for (int p = 0; p < J.nparts && base < b; p++) {
    const kv_part &P = J.parts[p];
    const kv_field K = P.k, V = P.v;  // copies: no aliasing questions in the loops
    i64 ntok = P.tokens, lo = std::max<i64>(a - base, 0), hi = std::min<i64>(b - base, ntok);
    for (i64 t0 = lo; t0 < hi; t0 += TILE) {
      i64 n = std::min<i64>(TILE, hi - t0), ks, vs;
      const float *k = rows(K, h, t0, n, D, kbuf, &ks);
      for (i64 m = 0; m < M; m++) {
        float *sm = s + m * TILE;
        for (i64 t = 0; t < n; t++) sm[t] = dot(q + m * D, k + t * ks, D) * J.scale;
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
      const float *v = rows(V, h, t0, n, Dv, vbuf, &vs);
      for (i64 t = 0; t < n; t++) {
        const float *vt = v + t * vs;
        for (i64 m = 0; m < M; m++) {
          float w = s[m * TILE + t];
          float *o = st.acc.data() + m * Dv;
          for (i64 d = 0; d < Dv; d++) o[d] += w * vt[d];
        }
      }
    }
    base += ntok;
  }
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

// Decode attention of S sequences in one call: sequence s's packed queries
// q[s] ([H, M, D]) over its own `nparts[s]` parts at `parts[s]`, into out[s]
// ([H, M, Dv]) and lse[s] ([H, M]). The work items of every sequence (heads x its
// token splits) share one parallel region, so a step of many short decodes costs one
// thread wake-up instead of one per sequence and layer.
extern "C" int kv_attn_decode_batch(int S, const int *nparts, const kv_part *const *parts,
                                    const float *q, float *out, float *lse, i64 H, i64 M, i64 D,
                                    i64 Dv, float scale, float softcap, int nth) {
  if (M > MAX_M || D > MAX_D || Dv > MAX_D || M < 1 || H < 1 || D < 1 || Dv < 1 || S < 0)
    return -1;
  for (int s = 0; s < S; s++) {
    if (nparts[s] < 0) return -1;
    for (int p = 0; p < nparts[s]; p++) {
      if (int rc = check_field(parts[s][p].k, D)) return rc;
      if (int rc = check_field(parts[s][p].v, Dv)) return rc;
    }
  }
  init_e4m3();
  std::vector<Job> jobs;
  std::vector<i64> totals((size_t)S), splits((size_t)S), chunks((size_t)S), first((size_t)S + 1);
  jobs.reserve((size_t)S);
  first[0] = 0;
  i64 work = 0;
  for (int s = 0; s < S; s++) {
    jobs.push_back(Job{nparts[s], parts[s], q + s * H * M * D, H, M, D, Dv, scale, softcap});
    i64 total = 0;
    for (int p = 0; p < nparts[s]; p++) total += parts[s][p].tokens;
    totals[s] = total;
    splits[s] = num_splits(nth, H, total);
    chunks[s] = (total + splits[s] - 1) / splits[s];
    first[s + 1] = first[s] + H * splits[s];
    work += total * H * D;
  }
  const i64 items = first[(size_t)S];
  std::vector<State> states((size_t)items);
  auto run = [&](i64 i) {
    // the sequence of item i: the last s with first[s] <= i
    i64 s = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
    i64 j = i - first[s], sp = j % splits[s], h = j / splits[s];
    attend_range(jobs[s], h, sp * chunks[s], std::min(totals[s], (sp + 1) * chunks[s]),
                 states[(size_t)i]);
  };
  int workers = (int)std::min<i64>(nth, items);
  if (work < (1 << 14)) workers = 1;
  std::atomic<i64> next{0};
  std::atomic<bool> failed{false};
  kv_parallel(workers, [&](int) {
    try {
      for (i64 i = next++; i < items; i = next++) run(i);
    } catch (...) {  // out of memory: report, never unwind through OpenMP
      failed = true;
    }
  });
  if (failed) return -4;
  for (int s = 0; s < S; s++)
    merge_splits(states.data() + first[s], splits[s], H, M, Dv, out + s * H * M * Dv,
                 lse + s * H * M);
  return 0;
}

extern "C" int kv_attn_decode(int nparts, const kv_part *parts, const float *q, float *out,
                              float *lse, i64 H, i64 M, i64 D, i64 Dv, float scale, float softcap,
                              int nth) {
  return kv_attn_decode_batch(1, &nparts, &parts, q, out, lse, H, M, D, Dv, scale, softcap, nth);
}

// The layout the compiler gave the shared structs (common.h), for the test that checks
// kvstrata.formats against it: sizeof(kv_field), the offset of each of its members in
// declaration order, sizeof(kv_part), then the offsets of tokens, k and v. Writes at
// most `cap` values; returns how many there are.
extern "C" int kv_abi_layout(i64 *out, int cap) {
  const i64 v[] = {
      (i64)sizeof(kv_field),
      (i64)offsetof(kv_field, data),
      (i64)offsetof(kv_field, scale),
      (i64)offsetof(kv_field, zero),
      (i64)offsetof(kv_field, data_head_stride),
      (i64)offsetof(kv_field, data_row_stride),
      (i64)offsetof(kv_field, scale_head_stride),
      (i64)offsetof(kv_field, zero_head_stride),
      (i64)offsetof(kv_field, group),
      (i64)offsetof(kv_field, row0),
      (i64)offsetof(kv_field, format),
      (i64)sizeof(kv_part),
      (i64)offsetof(kv_part, tokens),
      (i64)offsetof(kv_part, k),
      (i64)offsetof(kv_part, v),
  };
  const int n = (int)(sizeof(v) / sizeof(v[0]));
  for (int i = 0; i < n && i < cap; i++) out[i] = v[i];
  return n;
}
