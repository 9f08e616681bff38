/* Same-run baseline for bench/run.sh: the ceiling of one copy per byte on
 * the host, a design where the trainer's tensors already live in shared
 * memory and the worker copies them once into its staging (no pack on
 * the trainer). With checksums the trainer must still hash what it
 * announces, and the worker what it copies.
 *
 * One process, two threads, chunks of BUF bytes (SIZE in all) from a
 * shared mapping into warm memory: a "trainer" hashes chunk k+1 (XXH3,
 * from memory) while a "worker" copies chunk k with non-temporal stores
 * in 256 KiB pieces, hashing them in the same pass (wtx__copy_hash), as
 * wtx's assembler does; chunk k+1 is announced once chunk k is done, as the
 * engine waits for each chunk's answer. No control plane. Prints GB/s with
 * checksums and without, each the best of three after one warm-up.
 * usage: onecopy_baseline BYTES [BUF_MIB]   (default 4 MiB) */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "bench/pair.h"
#include "common/copy.h"
#include "common/hash.h"

#define PIECE ((size_t)256 << 10)

typedef struct pass {
  const uint8_t *src;
  uint8_t *dst;
  size_t n, buf, count;
  int hash;
  XXH3_state_t *st; /* the worker's */
  atomic_size_t announced, done; /* chunks, from the start */
} pass;

static size_t len_of(const pass *p, size_t k) {
  return wtx__bench_chunk_len(p->n, p->buf, k);
}

static void *trainer(void *arg) {
  pass *p = arg;
  for (size_t k = 0; k < p->count; k++) {
    if (p->hash) (void)XXH3_64bits(p->src + k * p->buf, len_of(p, k));
    while (k > 0 && atomic_load(&p->done) < k) { /* chunk k-1's answer */
    }
    atomic_store(&p->announced, k + 1);
  }
  return NULL;
}

static void *worker(void *arg) {
  pass *p = arg;
  XXH3_state_t *st = p->st;
  for (size_t k = 0; k < p->count; k++) {
    while (atomic_load(&p->announced) <= k) {
    }
    size_t off = k * p->buf, end = off + len_of(p, k);
    if (p->hash) XXH3_64bits_reset(st);
    for (size_t o = off; o < end; o += PIECE) {
      size_t m = end - o < PIECE ? end - o : PIECE;
      wtx__copy_hash(p->dst + o, p->src + o, m, p->hash ? st : NULL, 1);
    }
    if (p->hash) (void)XXH3_64bits_digest(st);
    atomic_store(&p->done, k + 1);
  }
  return NULL;
}

/* One pass; its seconds. */
static double run(void *arg) {
  pass *p = arg;
  atomic_store(&p->announced, 0);
  atomic_store(&p->done, 0);
  return wtx__bench_pair_s(trainer, worker, p);
}

static double best_gbps(pass *p, int hash) {
  p->hash = hash;
  double best = wtx__bench_best_s(run, p, 1, 3);
  return best < 0 ? -1 : p->n / best / 1e9; /* -1: no thread */
}

int main(int argc, char **argv) {
  pass p = {.n = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)1 << 30,
            .buf = (argc > 2 ? strtoull(argv[2], NULL, 10) : 4) << 20};
  if (p.n == 0 || p.buf == 0) return 1;
  p.count = (p.n + p.buf - 1) / p.buf;
  /* The trainer's tensors in shared memory, as a worker would map them. */
  uint8_t *src = mmap(NULL, p.n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  uint8_t *dst = malloc(p.n);
  p.st = XXH3_createState();
  if (src == MAP_FAILED || dst == NULL || p.st == NULL) return 1;
  memset(src, 7, p.n);
  memset(dst, 1, p.n); /* warm, as a worker's reused staging memory */
  p.src = src;
  p.dst = dst;
  double on = best_gbps(&p, 1), off = best_gbps(&p, 0);
  if (on < 0 || off < 0) return 1;
  if (memcmp(dst, src, p.n) != 0) return 2;
  printf("onecopy_gbps checksums %.3f none %.3f\n", on, off);
  XXH3_freeState(p.st);
  munmap(src, p.n);
  free(dst);
  return 0;
}
