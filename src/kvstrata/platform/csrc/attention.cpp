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

#include "attend.h"
#include "parallel.h"

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

struct Seq {  // one sequence of a call: its parts, its packed queries
  int nparts;
  const kv_part *parts;
  Job j;
};

// Attend head h over tokens [a, b) of the concatenated parts, into st.
static void attend_range(const Seq &S, i64 h, i64 a, i64 b, State &st) {
  const Job &J = S.j;
  const i64 M = J.M, D = J.D, Dv = J.Dv;
  reset_state(st, M, Dv);
  const float *q = J.q + h * M * D;
  // tile buffers on the heap (a few KiB): OpenMP workers may have small stacks
  std::vector<float> kvec((size_t)(TILE * D)), vvec((size_t)(TILE * Dv)), svec((size_t)(M * TILE));
  float *kbuf = kvec.data(), *vbuf = vvec.data(), *s = svec.data();
  i64 base = 0;
  for (int p = 0; p < S.nparts && base < b; p++) {
    const kv_part &P = S.parts[p];
    const kv_field K = P.k, V = P.v;  // copies: no aliasing questions in the loops
    i64 ntok = P.tokens, lo = std::max<i64>(a - base, 0), hi = std::min<i64>(b - base, ntok);
    for (i64 t0 = lo; t0 < hi; t0 += TILE) {
      i64 n = std::min<i64>(TILE, hi - t0), ks, vs;
      const float *k = rows(K, h, t0, n, D, kbuf, &ks);
      const float *v = rows(V, h, t0, n, Dv, vbuf, &vs);
      attend_tile(J, q, k, ks, v, vs, n, st, s);
    }
    base += ntok;
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
  std::vector<Seq> jobs;
  std::vector<i64> totals((size_t)S), splits((size_t)S), chunks((size_t)S), first((size_t)S + 1);
  jobs.reserve((size_t)S);
  first[0] = 0;
  i64 work = 0;
  for (int s = 0; s < S; s++) {
    jobs.push_back(Seq{nparts[s], parts[s], Job{q + s * H * M * D, M, D, Dv, scale, softcap}});
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
