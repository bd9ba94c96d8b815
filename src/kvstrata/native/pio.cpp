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
// Checksum: XXH3-64 (seed 0, the default secret; xxHash 0.8, vendored as xxhash.h) of
// each checksummed region -- one layer of one block, in file order. The pieces of a
// region are consecutive in the list and all go to one thread, which feeds them to a
// streaming XXH3 state in file order; the digest is stored to sums[out[p]] (out[p] < 0:
// not checksummed, e.g. the slot tail). The value equals xxhash.xxh3_64 of the
// region's bytes, which the Python paths compute (kvstrata/tiers/disk_format.py).
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

#define XXH_INLINE_ALL
#include "xxhash.h"

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

// The running checksum of one worker: the region it is in and its XXH3 state.
struct Hasher {
  XXH3_state_t st;
  i64 cur = -1;
  void finish(const Job &J) {
    if (cur >= 0) J.sums[cur] = (u64)XXH3_64bits_digest(&st);
    cur = -1;
  }
};

static void checksum(const Job &J, Hasher &H, i64 i, i64 j) {
  for (i64 p = i; p < j; p++) {
    if (J.out[p] < 0) continue;
    if (J.out[p] != H.cur) {
      H.finish(J);
      XXH3_64bits_reset(&H.st);
      H.cur = J.out[p];
    }
    if (!J.status[p]) XXH3_64bits_update(&H.st, (const void *)J.addr[p], (size_t)J.len[p]);
  }
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

static i64 worker(const Job &J, i64 a, i64 b) {
  Hasher H;
  i64 i = a;
  while (i < b && J.err->load() == 0) {
    i64 j = i + 1, bytes = J.len[i];
    while (j < b && j - i < iov_max() && J.foff[j] == J.foff[j - 1] + J.len[j - 1] &&
           bytes + J.len[j] <= J.batch) {
      bytes += J.len[j];
      j++;
    }
    if (J.write) checksum(J, H, i, j);
    i64 rc = transfer(J, i, j);
    if (rc < 0) {
      i64 none = 0;
      J.err->compare_exchange_strong(none, rc);
      return rc;
    }
    if (!J.write) checksum(J, H, i, j);
    i = j;
  }
  H.finish(J);
  return 0;
}

extern "C" i64 kv_pio(int fd, int write, i64 n, const i64 *addr, const i64 *len, const i64 *foff,
                      const i64 *out, u64 *sums, u8 *status, i64 batch, int nth) {
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
