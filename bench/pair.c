#include "bench/pair.h"

#include <pthread.h>

#include "common/clock.h"

size_t wtx__bench_chunk_len(size_t total, size_t buf, size_t k) {
  size_t off = k * buf;
  return total - off < buf ? total - off : buf;
}

double wtx__bench_pair_s(void *(*first)(void *), void *(*second)(void *), void *arg) {
  pthread_t a, b;
  double t0 = wtx_clock_s();
  if (pthread_create(&a, NULL, first, arg) != 0) return -1;
  int own = pthread_create(&b, NULL, second, arg) == 0;
  if (!own) second(arg);
  pthread_join(a, NULL);
  if (own) pthread_join(b, NULL);
  return wtx_clock_s() - t0;
}
