/* The same-run baselines' two threads: a producer and a consumer. */
#ifndef WTX_BENCH_PAIR_H
#define WTX_BENCH_PAIR_H

/* Runs first(arg) and second(arg) at once and waits for both: first on a
 * thread of its own, second on another (or on the caller's when no second
 * thread can start, so that the two always meet). Returns the seconds from
 * the first start to the last end, or -1 when no thread could start
 * (nothing ran). */
double wtx__bench_pair_s(void *(*first)(void *), void *(*second)(void *), void *arg);

#endif
