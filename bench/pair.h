/* The same-run baselines' harness: two threads at once, and a best of runs. */
#ifndef WTX_BENCH_PAIR_H
#define WTX_BENCH_PAIR_H

#include <stddef.h>

/* Runs first(arg) and second(arg) at once and waits for both: first on a
 * thread of its own, second on another (or on the caller's when no second
 * thread can start, so that the two always meet). Returns the seconds from
 * the first start to the last end, or -1 when no thread could start
 * (nothing ran). */
double wtx__bench_pair_s(void *(*first)(void *), void *(*second)(void *), void *arg);

/* The best (least) of rounds calls of run(arg), after warm_up calls not
 * counted: each baseline's figure is a best of several, as wtx's are.
 * -1 when a call returns a negative (it could not run). */
double wtx__bench_best_s(double (*run)(void *), void *arg, int warm_up, int rounds);

/* Bytes of chunk k when total bytes are cut into chunks of buf (the last
 * may be shorter). */
size_t wtx__bench_chunk_len(size_t total, size_t buf, size_t k);

#endif
