/* The monotonic clock every timeout, watchdog and duration in wtx reads. */
#ifndef WTX_COMMON_CLOCK_H
#define WTX_COMMON_CLOCK_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Milliseconds and seconds of CLOCK_MONOTONIC (unrelated to wall time). */
int64_t wtx__clock_ms(void);
double wtx__clock_s(void);
/* Seconds since the Unix epoch (CLOCK_REALTIME): timestamps for people and
 * metrics, never for durations. */
double wtx__clock_unix_s(void);

#ifdef __cplusplus
}
#endif
#endif /* WTX_COMMON_CLOCK_H */
