/* The same-run baselines' two threads: a producer and a consumer. */
#ifndef WTX_BENCH_PAIR_H
#define WTX_BENCH_PAIR_H

#include <stddef.h>

/* Runs first(arg) and second(arg) at once and waits for both: first on a
 * thread of its own, second on another (or on the caller's when no second
 * thread can start, so that the two always meet). Returns the seconds from
 * the first start to the last end, or -1 when no thread could start
 * (nothing ran). */
double wtx__bench_pair_s(void *(*first)(void *), void *(*second)(void *), void *arg);

/* Bytes of chunk k when total bytes are cut into chunks of buf (the last
 * may be shorter). */
size_t wtx__bench_chunk_len(size_t total, size_t buf, size_t k);

#endif
