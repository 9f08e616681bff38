/* What a first touch of fresh memory costs on this machine: the floor of a
 * new worker's first sync, which holds its tables in pages never touched
 * before. Times 32 MiB of anonymous memory touched a page at a time, then
 * written again once there; first touched after MADV_POPULATE_WRITE; and
 * first touched under MADV_HUGEPAGE. Prints microseconds per 4 KiB page,
 * the best of three mappings each.
 * usage: pagefault_baseline */
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>

#include "common/clock.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

#define BYTES ((size_t)32 << 20)
#define PAGE 4096

enum { PLAIN, POPULATE, HUGE };

/* Seconds to first-touch a fresh mapping prepared as `how` (and, when
 * again is not NULL, to memset it once its pages are there). */
static double touch(int how, double *again) {
  char *p = mmap(NULL, BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return -1;
  double t0 = wtx__clock_s();
  if (how == POPULATE) madvise(p, BYTES, MADV_POPULATE_WRITE);
  if (how == HUGE) madvise(p, BYTES, MADV_HUGEPAGE);
  for (size_t i = 0; i < BYTES; i += PAGE) p[i] = 1;
  double t1 = wtx__clock_s();
  if (again != NULL) {
    memset(p, 2, BYTES);
    *again = wtx__clock_s() - t1;
  }
  munmap(p, BYTES);
  return t1 - t0;
}

int main(void) {
  const char *names[] = {"fresh", "populate_write", "hugepage"};
  double warm = 1e9;
  for (int how = PLAIN; how <= HUGE; how++) {
    double best = 1e9;
    for (int r = 0; r < 3; r++) {
      double w = 0, s = touch(how, how == PLAIN ? &w : NULL);
      if (s >= 0 && s < best) best = s;
      if (how == PLAIN && w < warm) warm = w;
    }
    printf("%s_us_per_page %.3f\n", names[how], best * 1e6 / (BYTES / PAGE));
  }
  printf("faulted_memset_us_per_page %.3f\n", warm * 1e6 / (BYTES / PAGE));
  return 0;
}
