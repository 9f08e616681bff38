/* Same-run baseline for bench/run.sh: the ceiling of a two-copy design
 * such as shm (the trainer packs into shared buffers, the worker copies
 * out). One process, two threads: a producer copies SIZE bytes from warm
 * memory into a ring of NBUF buffers of BUF bytes, a consumer copies each
 * filled buffer into warm memory, and neither waits for more than the ring
 * forces (the producer runs up to NBUF buffers ahead). No control plane,
 * no checksums. Prints GB/s, the best of three runs. With "shm" the ring
 * is a POSIX shared-memory object, as shm's region is, instead of
 * malloc'd memory.
 * usage: pipeline_baseline BYTES [BUF_MIB NBUF [shm]]   (default 4 MiB x 4) */
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "bench/pair.h"

typedef struct ring {
  const char *src;
  char *dst, *bufs;
  size_t n, buf, nbuf;
  atomic_size_t filled, emptied; /* buffers, from the start */
} ring;

static size_t piece(const ring *r, size_t k) {
  return wtx__bench_chunk_len(r->n, r->buf, k);
}

static void *produce(void *arg) {
  ring *r = arg;
  for (size_t k = 0; k * r->buf < r->n; k++) {
    while (k - atomic_load(&r->emptied) >= r->nbuf) {
    }
    memcpy(r->bufs + (k % r->nbuf) * r->buf, r->src + k * r->buf, piece(r, k));
    atomic_store(&r->filled, k + 1);
  }
  return NULL;
}

static void *consume(void *arg) {
  ring *r = arg;
  for (size_t k = 0; k * r->buf < r->n; k++) {
    while (atomic_load(&r->filled) <= k) {
    }
    memcpy(r->dst + k * r->buf, r->bufs + (k % r->nbuf) * r->buf, piece(r, k));
    atomic_store(&r->emptied, k + 1);
  }
  return NULL;
}

/* One pass through the ring; its seconds. */
static double run(void *arg) {
  ring *r = arg;
  atomic_store(&r->filled, 0);
  atomic_store(&r->emptied, 0);
  return wtx__bench_pair_s(produce, consume, r);
}

/* The ring: len bytes of a shared-memory object (unlinked at once), or
 * malloc'd. NULL when out of memory. */
static char *ring_alloc(size_t len, int shm) {
  if (!shm) return malloc(len);
  char name[64];
  snprintf(name, sizeof name, "/wtx-pipeline-baseline-%d", (int)getpid());
  int fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0) return NULL;
  shm_unlink(name);
  void *p = ftruncate(fd, (off_t)len) == 0
                ? mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  close(fd);
  return p == MAP_FAILED ? NULL : p;
}

int main(int argc, char **argv) {
  ring r = {.n = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)1 << 30,
            .buf = (argc > 2 ? strtoull(argv[2], NULL, 10) : 4) << 20,
            .nbuf = argc > 3 ? strtoull(argv[3], NULL, 10) : 4};
  int shm = argc > 4 && strcmp(argv[4], "shm") == 0;
  char *src = malloc(r.n), *dst = malloc(r.n), *bufs = ring_alloc(r.buf * r.nbuf, shm);
  if (src == NULL || dst == NULL || bufs == NULL || r.buf == 0 || r.nbuf == 0) return 1;
  memset(src, 7, r.n);
  memset(dst, 1, r.n); /* warm, as a worker's reused staging memory */
  memset(bufs, 3, r.buf * r.nbuf);
  r.src = src;
  r.dst = dst;
  r.bufs = bufs;
  double best = wtx__bench_best_s(run, &r, 0, 3);
  if (best < 0) return 1; /* no thread */
  if (memcmp(dst, src, r.n) != 0) return 2;
  printf("pipelined_gbps %.3f\n", r.n / best / 1e9);
  free(src);
  free(dst);
  if (shm) munmap(bufs, r.buf * r.nbuf);
  else free(bufs);
  return 0;
}
