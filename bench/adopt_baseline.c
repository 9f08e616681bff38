/* Same-run baseline for bench/run.sh: the ceiling of shm with one copy per
 * byte, where the worker adopts the trainer's pages instead of copying them
 * out (issue 11's suggestion). The worker may only adopt pages the trainer
 * can no longer write, or the trainer could change weights after they were
 * verified and published: so each chunk is a fresh memfd that the trainer
 * fills, unmaps and seals against writes, and sealed pages are never
 * writable again, so nothing is recycled and every version is fresh memory.
 *
 * One process, two threads: a producer fills and seals one memfd per chunk
 * of BUF bytes (SIZE in all), a consumer maps each read-only and hashes it
 * (XXH3, as a worker verifies what it publishes) and keeps it mapped as the
 * published version; at the start of each version the one before last is
 * unmapped (the release a worker would make). No control plane and no fd
 * passing between processes, which the real thing would add. Prints GB/s,
 * the best of three versions after one warm-up.
 * usage: adopt_baseline BYTES [BUF_MIB]   (default 4 MiB) */
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "bench/pair.h"
#include "common/clock.h"
#include "common/hash.h"

typedef struct chunks {
  const char *src;
  size_t n, buf, count;
  int *fds;           /* sealed memfds, producer to consumer */
  void **now, **prev; /* this version's mappings, the one before */
  atomic_size_t filled;
  atomic_int failed;
  uint64_t hash;
} chunks;

static size_t len_of(const chunks *c, size_t k) {
  return wtx__bench_chunk_len(c->n, c->buf, k);
}

/* Chunk k in a new memfd the trainer can no longer write; -1 on failure. */
static int sealed(const chunks *c, size_t k) {
  size_t len = len_of(c, k);
  int fd = memfd_create("wtx-adopt", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0 || ftruncate(fd, (off_t)len) != 0) goto fail;
  char *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) goto fail;
  memcpy(m, c->src + k * c->buf, len);
  munmap(m, len);
  if (fcntl(fd, F_ADD_SEALS, F_SEAL_WRITE | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0)
    goto fail;
  return fd;
fail:
  if (fd >= 0) close(fd);
  return -1;
}

static void *produce(void *arg) {
  chunks *c = arg;
  for (size_t k = 0; k < c->count; k++) {
    c->fds[k] = sealed(c, k);
    atomic_store(&c->filled, k + 1);
  }
  return NULL;
}

static void *consume(void *arg) {
  chunks *c = arg;
  for (size_t k = 0; k < c->count; k++) {
    while (atomic_load(&c->filled) <= k) {
    }
    void *m = c->fds[k] < 0 ? MAP_FAILED
                            : mmap(NULL, len_of(c, k), PROT_READ, MAP_SHARED | MAP_POPULATE,
                                   c->fds[k], 0);
    if (c->fds[k] >= 0) close(c->fds[k]);
    if (m == MAP_FAILED) {
      atomic_store(&c->failed, 1);
      c->now[k] = NULL;
      continue;
    }
    c->hash ^= XXH3_64bits(m, len_of(c, k));
    c->now[k] = m;
  }
  return NULL;
}

/* One version: release the one before last, then fill, seal, map and hash
 * every chunk. Its seconds. */
static double version(void *arg) {
  chunks *c = arg;
  double t0 = wtx__clock_s();
  for (size_t k = 0; k < c->count; k++)
    if (c->prev[k] != NULL) munmap(c->prev[k], len_of(c, k));
  void **t = c->prev;
  c->prev = c->now;
  c->now = t;
  atomic_store(&c->filled, 0);
  double s = wtx__bench_pair_s(produce, consume, c);
  return s < 0 ? s : wtx__clock_s() - t0;
}

int main(int argc, char **argv) {
  chunks c = {.n = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)1 << 30,
              .buf = (argc > 2 ? strtoull(argv[2], NULL, 10) : 4) << 20};
  if (c.n == 0 || c.buf == 0) return 1;
  c.count = (c.n + c.buf - 1) / c.buf;
  char *src = malloc(c.n);
  c.fds = calloc(c.count, sizeof *c.fds);
  c.now = calloc(c.count, sizeof *c.now);
  c.prev = calloc(c.count, sizeof *c.prev);
  if (src == NULL || c.fds == NULL || c.now == NULL || c.prev == NULL) return 1;
  memset(src, 7, c.n);
  c.src = src;
  double best = wtx__bench_best_s(version, &c, 1, 3);
  if (best < 0) return 1; /* no thread */
  if (atomic_load(&c.failed)) return 2;
  for (size_t k = 0; k < c.count; k++) /* what the worker would publish */
    if (memcmp(c.now[k], src + k * c.buf, len_of(&c, k)) != 0) return 3;
  printf("adopt_gbps %.3f\n", c.n / best / 1e9);
  return 0;
}
