/* Same-run baseline for the bench scripts (bench/host.sh, bench/gpu.sh): how
 * fast this machine copies SIZE bytes from fresh memory into fresh memory
 * (page faults included, as a worker's staging memory is fresh each sync),
 * from warm to warm in one call, and from warm to warm in 256 KiB pieces
 * (the warm ones the best of three). Then the trainer's pack, as the shm
 * backend's packing thread runs it (client/engine.c, take): the warm
 * source copied in 256 KiB pieces into a ring of 4 x 4 MiB, once plain,
 * once hashing (XXH3) in the same pass (wtx__copy_hash) and once hashing
 * each piece right after its copy (two passes, the engine's way before);
 * hashed / plain is what checksums add to a sync whose critical path is
 * that thread (bench/run.sh, checksums).
 * One large call lets glibc use non-temporal stores, which skip reading
 * the destination's lines before writing them; pieces below glibc's
 * threshold (set from the cache size) do not get them, which is why the
 * worker's receive streams its pieces itself (transport/rx.c). Prints GB/s.
 * With "populate" after BYTES it prints instead, in seconds, what the
 * receive's look-ahead into fresh staging rests on (transport/rx.c):
 * copying into fresh memory in 256 KiB pieces, faulted page by page and
 * populated a MiB ahead (MADV_POPULATE_WRITE), and populating memory
 * already there, piece by piece.
 * usage: memcpy_baseline BYTES [populate] */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "bench/pair.h"
#include "common/clock.h"
#include "common/copy.h"
#include "common/hash.h"

#define PIECE ((size_t)256 << 10)
#define AHEAD ((size_t)1 << 20)
#define ROUNDS 3
#define RING ((size_t)16 << 20) /* the shm backend's default 4 x 4 MiB */

/* Seconds to copy n bytes of src into fresh memory in PIECE pieces, each
 * AHEAD populated first when ahead; and in *present, to populate that
 * memory again, piece by piece, now that it is there. -1: no memory. */
static double fresh_copy(const char *src, size_t n, int ahead, double *present) {
  char *d = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (d == MAP_FAILED) return -1;
  double t0 = wtx__clock_s();
  for (size_t o = 0; o < n; o += PIECE) {
#if defined(MADV_POPULATE_WRITE)
    if (ahead && o % AHEAD == 0) madvise(d + o, n - o < AHEAD ? n - o : AHEAD, MADV_POPULATE_WRITE);
#endif
    memcpy(d + o, src + o, n - o < PIECE ? n - o : PIECE);
  }
  double t = wtx__clock_s() - t0;
  t0 = wtx__clock_s();
#if defined(MADV_POPULATE_WRITE)
  for (size_t o = 0; o < n; o += PIECE)
    madvise(d + o, n - o < PIECE ? n - o : PIECE, MADV_POPULATE_WRITE);
#endif
  if (present != NULL) *present = wtx__clock_s() - t0;
  munmap(d, n);
  return t;
}

/* The trainer's pack: n bytes of src into ring (RING bytes) in PIECE
 * pieces, each hashed into h unless h is NULL: in the same pass
 * (wtx__copy_hash, as client/engine.c does) or, twopass, after its copy,
 * from L2 (as the engine did before the fused kernels). */
typedef struct packing {
  char *ring;
  const char *src;
  size_t n;
  XXH3_state_t *h;
  int twopass;
} packing;

/* One pack; its seconds. */
static double pack(void *arg) {
  const packing *p = arg;
  double t0 = wtx__clock_s();
  if (p->h != NULL) XXH3_64bits_reset(p->h);
  for (size_t o = 0; o < p->n; o += PIECE) {
    size_t k = p->n - o < PIECE ? p->n - o : PIECE;
    uint8_t *d = (uint8_t *)p->ring + o % RING;
    const uint8_t *s = (const uint8_t *)p->src + o;
    if (!p->twopass) {
      wtx__copy_hash(d, s, k, p->h, 0);
      continue;
    }
    memcpy(d, s, k);
    XXH3_64bits_update(p->h, d, k);
  }
  return wtx__clock_s() - t0;
}

/* Prints the best of ROUNDS packs of n bytes, plain, hashed and hashed in
 * two passes, in GB/s, and the fused kernel's name. */
static int pack_rates(const char *src, size_t n) {
  packing p = {malloc(RING), src, n, NULL, 0};
  XXH3_state_t *h = XXH3_createState();
  int rc = 1;
  if (p.ring == NULL || h == NULL) goto fail;
  memset(p.ring, 0, RING);
  double plain = wtx__bench_best_s(pack, &p, 0, ROUNDS);
  p.h = h;
  double hashed = wtx__bench_best_s(pack, &p, 0, ROUNDS);
  p.twopass = 1;
  double twopass = wtx__bench_best_s(pack, &p, 0, ROUNDS);
  printf("pack_gbps %.3f\npack_hashed_gbps %.3f\npack_twopass_gbps %.3f\npack_kernel %s\n",
         n / plain / 1e9, n / hashed / 1e9, n / twopass / 1e9, wtx__copy_hash_isa());
  rc = 0;
fail:
  free(p.ring);
  XXH3_freeState(h);
  return rc;
}

int main(int argc, char **argv) {
  size_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)1 << 30;
  char *src = malloc(n);
  if (src == NULL) return 1;
  memset(src, 7, n);
  if (argc > 2 && strcmp(argv[2], "populate") == 0) {
    double present = 0, faulted = fresh_copy(src, n, 0, NULL);
    double populated = fresh_copy(src, n, 1, &present);
    printf("fresh_faulted_s %.3f\nfresh_populated_s %.3f\npopulate_present_s %.4f\n", faulted,
           populated, present);
    free(src);
    return faulted < 0 || populated < 0;
  }
  char *dst = malloc(n);
  if (dst == NULL) return 1;
  double t0 = wtx__clock_s();
  memcpy(dst, src, n); /* into fresh pages */
  double cold = wtx__clock_s() - t0;
  /* The warm copies are each the best of ROUNDS, as the bench takes the
   * best of several syncs: a ratio compares like with like. */
  double warm = 1e30, pieces = 1e30;
  for (int r = 0; r < ROUNDS; r++) {
    t0 = wtx__clock_s();
    memcpy(dst, src, n);
    double s = wtx__clock_s() - t0;
    if (s < warm) warm = s;
    t0 = wtx__clock_s();
    for (size_t o = 0; o < n; o += PIECE) memcpy(dst + o, src + o, n - o < PIECE ? n - o : PIECE);
    s = wtx__clock_s() - t0;
    if (s < pieces) pieces = s;
  }
  /* Read the copy back so the compiler cannot drop it. */
  unsigned long sum = 0;
  for (size_t i = 0; i < n; i += 4096) sum += (unsigned char)dst[i];
  if (sum == 1) puts("");
  printf("memcpy_fresh_gbps %.3f\nmemcpy_warm_gbps %.3f\nmemcpy_pieces_gbps %.3f\n",
         n / cold / 1e9, n / warm / 1e9, n / pieces / 1e9);
  free(dst);
  int rc = pack_rates(src, n);
  free(src);
  return rc;
}
