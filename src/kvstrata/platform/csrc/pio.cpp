// kvstrata disk tier: vectored positional I/O of many pieces with their checksums.
//
// A disk-tier operation moves n "pieces" (contiguous byte ranges in memory: one head
// of one field of one layer of one block, a padding gap, ...) to or from their places
// in the arena file. Pieces come in file order. Runs of pieces that are contiguous in
// the file go to one preadv/pwritev (at most IOV_MAX buffers, at most `batch` bytes, so
// a batch just read is still in cache when it is checksummed, and a batch about to be
// written was just brought into cache by its checksum). The pieces are split over up to
// `nth` threads by bytes, at region boundaries: copying between the page cache and user
// memory is the cost of a warm disk tier, and one thread does not saturate memory
// bandwidth.
//
// Checksum: XXH3-64 (seed 0, the default secret) of each checksummed region -- one
// layer of one block, in file order. The pieces of a region are consecutive in the list
// and all go to one thread, which feeds them to a streaming XXH3 state in file order;
// the digest is stored to sums[out[p]] (out[p] < 0: not checksummed, e.g. the slot
// tail). The value equals xxhash.xxh3_64 of the region's bytes, which the Python paths
// compute (kvstrata/tiers/disk_format.py).
//
// The XXH3 functions are not compiled here: they are the ones the `xxhash` package's
// extension module exports, handed over once at load time (kv_pio_set_xxh3, called by
// kvstrata/_native.py), which checks them on a sample against the package's own value.
// Until that succeeds kv_pio moves nothing and returns -ENOSYS.
//
// status[i] = 1 when a read found the end of the file before piece i was complete.
// Returns 0, or -errno of the first failed system call; the other workers stop at
// their next batch (sums are then meaningless).

#include <errno.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "common.h"

// ---- XXH3-64, through the xxhash package's exported functions (xxHash's stable ABI:
// the state is opaque and only handled by pointer, XXH_errorcode is an int-sized enum
// with XXH_OK = 0).
struct XXH3_state_s;
typedef struct XXH3_state_s XXH3_state_t;
typedef u64 (*xxh3_oneshot_fn)(const void *input, size_t length);
typedef XXH3_state_t *(*xxh3_create_fn)(void);
typedef int (*xxh3_free_fn)(XXH3_state_t *state);
typedef int (*xxh3_reset_fn)(XXH3_state_t *state);
typedef int (*xxh3_update_fn)(XXH3_state_t *state, const void *input, size_t length);
typedef u64 (*xxh3_digest_fn)(const XXH3_state_t *state);

struct Xxh3 {
  xxh3_create_fn create;
  xxh3_free_fn free;
  xxh3_reset_fn reset;
  xxh3_update_fn update;
  xxh3_digest_fn digest;
  xxh3_oneshot_fn oneshot;
};

static Xxh3 g_xxh3;                            // written once, before g_xxh3_ready
static std::atomic<bool> g_xxh3_ready{false};  // kv_pio runs only when set

// The streamed XXH3-64 of `data` fed in uneven pieces (1, 2, 3, ... bytes, so the
// state's internal buffering and its stripe and block boundaries are crossed).
static bool xxh3_streamed(const Xxh3 &x, const u8 *data, i64 n, u64 *out) {
  XXH3_state_t *st = x.create();
  if (!st) return false;
  bool ok = x.reset(st) == 0;
  for (i64 at = 0, step = 1; ok && at < n; at += step, step = step % 97 + 1)
    ok = x.update(st, data + at, (size_t)std::min(step, n - at)) == 0;
  if (ok) *out = x.digest(st);
  x.free(st);
  return ok;
}

// Installs the XXH3 functions (addresses of XXH3_createState, XXH3_freeState,
// XXH3_64bits_reset, XXH3_64bits_update, XXH3_64bits_digest, XXH3_64bits) after
// checking that the one-shot and the streamed hash of `sample` [n bytes] and of the
// empty input both equal the caller's values (`expect`, `expect_empty`, from the
// xxhash package). Returns 0, or -1 (then kv_pio stays disabled). Call once, before
// any kv_pio.
extern "C" int kv_pio_set_xxh3(void *create, void *free, void *reset, void *update,
                               void *digest, void *oneshot, const void *sample, i64 n,
                               u64 expect, u64 expect_empty) {
  if (g_xxh3_ready.load()) return 0;
  if (!create || !free || !reset || !update || !digest || !oneshot || n < 0 ||
      (n > 0 && !sample))
    return -1;
  Xxh3 x{(xxh3_create_fn)create, (xxh3_free_fn)free,     (xxh3_reset_fn)reset,
         (xxh3_update_fn)update, (xxh3_digest_fn)digest, (xxh3_oneshot_fn)oneshot};
  const u8 *data = (const u8 *)sample;
  u64 streamed = 0, streamed_empty = 0;
  if (x.oneshot(data, (size_t)n) != expect || x.oneshot(data, 0) != expect_empty ||
      !xxh3_streamed(x, data, n, &streamed) || streamed != expect ||
      !xxh3_streamed(x, data, 0, &streamed_empty) || streamed_empty != expect_empty)
    return -1;
  g_xxh3 = x;
  g_xxh3_ready.store(true);
  return 0;
}

static int iov_max() {
  static const int n = [] {
    long v = sysconf(_SC_IOV_MAX);
    return (int)std::min<long>(1024, v > 0 ? v : 16);
  }();
  return n;
}

struct Job {
  std::atomic<i64> *err;  // first failure (-errno); the other workers stop early
  int fd, write;
  const i64 *addr, *len, *foff, *out;
  u64 *sums;
  u8 *status;
  i64 batch;
};

// The running checksum of one worker: the region it is in and its XXH3 state (one
// allocation per worker and call, from the xxhash package's XXH3_createState).
struct Hasher {
  XXH3_state_t *st = g_xxh3.create();
  i64 cur = -1;
  Hasher() = default;
  Hasher(const Hasher &) = delete;
  Hasher &operator=(const Hasher &) = delete;
  ~Hasher() {
    if (st) g_xxh3.free(st);
  }
  void finish(const Job &J) {
    if (cur >= 0) J.sums[cur] = g_xxh3.digest(st);
    cur = -1;
  }
};

// Feeds the checksummed pieces of [i, j) to H. Returns 0 or -EINVAL (a failed
// reset/update: the sums would be wrong).
static i64 checksum(const Job &J, Hasher &H, i64 i, i64 j) {
  for (i64 p = i; p < j; p++) {
    if (J.out[p] < 0) continue;
    if (J.out[p] != H.cur) {
      H.finish(J);
      if (g_xxh3.reset(H.st) != 0) return -EINVAL;
      H.cur = J.out[p];
    }
    if (!J.status[p] && g_xxh3.update(H.st, (const void *)J.addr[p], (size_t)J.len[p]) != 0)
      return -EINVAL;
  }
  return 0;
}

// Test hook: when > 0, every system call is asked to move at most this many bytes,
// so the short-transfer resume below runs on every batch.
static std::atomic<i64> g_max_call_bytes{0};

extern "C" void kv_pio_limit_call_bytes(i64 n) { g_max_call_bytes = n; }

static ssize_t call(const Job &J, struct iovec *cur, i64 left, i64 off) {
  i64 cap = g_max_call_bytes.load();
  if (cap > 0) {  // hand the kernel a prefix of the iovecs, cut to `cap` bytes
    struct iovec head[1024];
    i64 k = 0, bytes = 0;
    for (; k < left && bytes < cap; k++) {
      head[k] = cur[k];
      if (bytes + (i64)head[k].iov_len > cap) head[k].iov_len = (size_t)(cap - bytes);
      bytes += (i64)head[k].iov_len;
    }
    return J.write ? pwritev(J.fd, head, (int)k, off) : preadv(J.fd, head, (int)k, off);
  }
  return J.write ? pwritev(J.fd, cur, (int)left, off) : preadv(J.fd, cur, (int)left, off);
}

// One batch [i, j) contiguous in the file: transfer it fully, resuming after short
// transfers. Returns 0, -errno, or 1 when a read hits the end of the file.
static i64 transfer(const Job &J, i64 i, i64 j) {
  struct iovec iov[1024];
  i64 n = j - i;
  for (i64 p = 0; p < n; p++) {
    iov[p].iov_base = (void *)J.addr[i + p];
    iov[p].iov_len = (size_t)J.len[i + p];
  }
  struct iovec *cur = iov;
  i64 left = n, off = J.foff[i], piece = i;
  while (left > 0) {
    ssize_t got = call(J, cur, left, off);
    if (got < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    if (got == 0) {
      if (J.write) return -EIO;
      for (i64 p = piece; p < j; p++) J.status[p] = 1;  // end of file
      return 1;
    }
    off += got;
    while (left > 0 && (size_t)got >= cur->iov_len) {
      got -= (ssize_t)cur->iov_len;
      cur++, left--, piece++;
    }
    if (left > 0 && got > 0) {
      cur->iov_base = (char *)cur->iov_base + got;
      cur->iov_len -= (size_t)got;
    }
  }
  return 0;
}

static i64 fail(const Job &J, i64 rc) {
  i64 none = 0;
  J.err->compare_exchange_strong(none, rc);
  return rc;
}

static i64 worker(const Job &J, i64 a, i64 b) {
  Hasher H;
  if (!H.st) return fail(J, -ENOMEM);
  i64 i = a;
  while (i < b && J.err->load() == 0) {
    i64 j = i + 1, bytes = J.len[i];
    while (j < b && j - i < iov_max() && J.foff[j] == J.foff[j - 1] + J.len[j - 1] &&
           bytes + J.len[j] <= J.batch) {
      bytes += J.len[j];
      j++;
    }
    i64 rc = J.write ? checksum(J, H, i, j) : 0;
    if (rc < 0 || (rc = transfer(J, i, j)) < 0) return fail(J, rc);  // rc 1: end of file
    if (!J.write && (rc = checksum(J, H, i, j)) < 0) return fail(J, rc);
    i = j;
  }
  H.finish(J);
  return 0;
}

extern "C" i64 kv_pio(int fd, int write, i64 n, const i64 *addr, const i64 *len, const i64 *foff,
                      const i64 *out, u64 *sums, u8 *status, i64 batch, int nth) {
  if (!g_xxh3_ready.load()) return -ENOSYS;  // no verified XXH3: never a wrong sum
  std::atomic<i64> err{0};
  Job J{&err, fd, write, addr, len, foff, out, sums, status, std::max<i64>(batch, 1)};
  i64 total = 0;
  for (i64 p = 0; p < n; p++) total += len[p];
  nth = (int)std::max<i64>(1, std::min<i64>(nth, total / (4 << 20)));
  if (nth <= 1 || n < 2) return worker(J, 0, n);
  // Split into nth ranges of about equal bytes, at region boundaries (a region's
  // pieces are hashed in order by one thread).
  std::vector<i64> cut{0};
  i64 acc = 0;
  for (i64 p = 0; p < n && (int)cut.size() < nth; p++) {
    acc += len[p];
    if (acc * nth >= total * (i64)cut.size() &&
        (p + 1 == n || out[p + 1] < 0 || out[p + 1] != out[p]))
      cut.push_back(p + 1);
  }
  if (cut.back() != n) cut.push_back(n);
  std::vector<std::thread> ts;
  std::vector<std::pair<i64, i64>> inline_ranges{{cut[0], cut[1]}};
  for (size_t t = 1; t + 1 < cut.size(); t++) {
    i64 a = cut[t], b = cut[t + 1];
    try {
      ts.emplace_back([&J, a, b] { worker(J, a, b); });
    } catch (const std::system_error &) {  // out of threads: do it on this one
      inline_ranges.emplace_back(a, b);
    }
  }
  for (auto [a, b] : inline_ranges) worker(J, a, b);
  for (auto &t : ts) t.join();
  return err.load();
}
