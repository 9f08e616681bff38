#include "bench/pair.h"

#include <pthread.h>

#include "common/clock.h"

size_t wtx__bench_chunk_len(size_t total, size_t buf, size_t k) {
  size_t off = k * buf;
  return total - off < buf ? total - off : buf;
}

double wtx__bench_pair_s(void *(*first)(void *), void *(*second)(void *), void *arg) {
  pthread_t a, b;
  double t0 = wtx__clock_s();
  if (pthread_create(&a, NULL, first, arg) != 0) return -1;
  int own = pthread_create(&b, NULL, second, arg) == 0;
  if (!own) second(arg);
  pthread_join(a, NULL);
  if (own) pthread_join(b, NULL);
  return wtx__clock_s() - t0;
}

double wtx__bench_best_s(double (*run)(void *), void *arg, int warm_up, int rounds) {
  double best = -1;
  for (int i = 0; i < warm_up + rounds; i++) {
    double s = run(arg);
    if (s < 0) return -1;
    if (i >= warm_up && (best < 0 || s < best)) best = s;
  }
  return best;
}
