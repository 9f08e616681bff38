/* Same-run baseline for the bench scripts (bench/host.sh, bench/gpu.sh): how
 * fast this machine copies SIZE bytes from fresh memory into fresh memory
 * (page faults included, as a worker's staging memory is fresh each sync),
 * from warm to warm in one call, and from warm to warm in 256 KiB pieces.
 * One large call lets glibc use non-temporal stores, which skip reading
 * the destination's lines before writing them; pieces below glibc's
 * threshold (set from the cache size) do not get them, which is why the
 * worker's receive streams its pieces itself (transport/rx.c). Prints GB/s.
 * usage: memcpy_baseline BYTES */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"

int main(int argc, char **argv) {
  size_t n = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)1 << 30;
  char *src = malloc(n);
  if (src == NULL) return 1;
  memset(src, 7, n);
  char *dst = malloc(n);
  if (dst == NULL) return 1;
  double t0 = wtx_clock_s();
  memcpy(dst, src, n); /* into fresh pages */
  double cold = wtx_clock_s() - t0;
  t0 = wtx_clock_s();
  memcpy(dst, src, n);
  double warm = wtx_clock_s() - t0;
  const size_t piece = (size_t)256 << 10;
  t0 = wtx_clock_s();
  for (size_t o = 0; o < n; o += piece) memcpy(dst + o, src + o, n - o < piece ? n - o : piece);
  double pieces = wtx_clock_s() - t0;
  /* Read the copy back so the compiler cannot drop it. */
  unsigned long sum = 0;
  for (size_t i = 0; i < n; i += 4096) sum += (unsigned char)dst[i];
  if (sum == 1) puts("");
  printf("memcpy_fresh_gbps %.3f\nmemcpy_warm_gbps %.3f\nmemcpy_pieces_gbps %.3f\n",
         n / cold / 1e9, n / warm / 1e9, n / pieces / 1e9);
  free(src);
  free(dst);
  return 0;
}
