/* How fast `rep movsb` copies 128 KiB (the tcp worker's receive piece)
 * for a given source and destination offset within a page: the kernel's
 * copy_to_user and copy_from_user use it on CPUs with FSRM, so this is the
 * speed of a recv into a buffer at that offset. On AMD Zen 3 it runs at a
 * fifteenth of its speed where the destination lies 1-31 bytes past the
 * source modulo 4 KiB, which is why the tcp worker's piece buffer starts
 * on a page (transport/tcp.c, PIECE; bench/results/2026-12-02-c-kernels.md).
 * Both buffers are page-aligned and stay in cache; each figure is the best
 * of five rounds of 2000 copies. Prints one line per pair, in GB/s.
 * usage: movsb_offsets [SRC_OFFSET DST_OFFSET ...]   (each under 8192;
 *        default: a table) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/pair.h"
#include "common/clock.h"

#define LEN ((size_t)128 << 10)
#define COPIES 2000

typedef struct pair {
  uint8_t *dst;
  const uint8_t *src;
} pair;

static void movsb(void *d, const void *s, size_t n) {
#if defined(__x86_64__)
  __asm__ volatile("rep movsb" : "+D"(d), "+S"(s), "+c"(n) : : "memory");
#else
  memcpy(d, s, n);
#endif
}

static double copies(void *arg) {
  const pair *p = arg;
  double t0 = wtx__clock_s();
  for (int k = 0; k < COPIES; k++)
    movsb(p->dst, p->src, LEN);
  return wtx__clock_s() - t0;
}

int main(int argc, char **argv) {
  static const int table[][2] = {
      {0, 0},    {0, 16},   {0, 31},  {0, 32},  {0, 63},  {0, 64}, {0, 2048},
      {0, 4080}, {0, 4112}, {32, 48}, {32, 64}, {16, 24}, {16, 48}};
  size_t n = argc > 1 ? (size_t)(argc - 1) / 2 : sizeof table / sizeof table[0];
  uint8_t *s = aligned_alloc(4096, LEN + 8192),
          *d = aligned_alloc(4096, LEN + 8192);
  if (s == NULL || d == NULL || (argc > 1 && argc % 2 == 0))
    return 2;
  memset(s, 1, LEN + 8192);
  memset(d, 2, LEN + 8192);
  for (size_t i = 0; i < n; i++) {
    int so = argc > 1 ? atoi(argv[1 + 2 * i]) : table[i][0];
    int dof = argc > 1 ? atoi(argv[2 + 2 * i]) : table[i][1];
    if (so < 0 || so >= 8192 || dof < 0 || dof >= 8192)
      return 2; /* the slack above */
    pair p = {d + dof, s + so};
    double best = wtx__bench_best_s(copies, &p, 1, 5);
    printf("movsb src %4d dst %4d: %.1f GB/s\n", so, dof,
           (double)COPIES * LEN / best / 1e9);
  }
  return 0;
}
