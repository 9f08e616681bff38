/* The monotonic clock every timeout, watchdog and duration in wtx reads. */
#ifndef WTX_COMMON_CLOCK_H
#define WTX_COMMON_CLOCK_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Milliseconds and seconds of CLOCK_MONOTONIC (unrelated to wall time). */
int64_t wtx__clock_ms(void);
double wtx__clock_s(void);
/* Seconds since the Unix epoch (CLOCK_REALTIME): timestamps for people and
 * metrics, never for durations. */
double wtx__clock_unix_s(void);
/* A condition variable whose timed waits read CLOCK_MONOTONIC (a wall
 * clock set back would stretch them); 0 or an errno of pthread_cond_init. */
int wtx__clock_cond_init(pthread_cond_t *cv);
/* The CLOCK_MONOTONIC time ms from now, for such a condition's
 * pthread_cond_timedwait. */
void wtx__clock_deadline(struct timespec *ts, int64_t ms);

#ifdef __cplusplus
}
#endif
#endif /* WTX_COMMON_CLOCK_H */
