/* Why a bounded wait of the data plane may end early: a flag another thread
 * sets (cancel, abort, drain) and a predicate polled while waiting (a
 * worker already refused the chunk being waited for). Either may be unset;
 * a NULL wtx_stop never stops. */
#ifndef WTX_COMMON_STOP_H
#define WTX_COMMON_STOP_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#else
#include <stdatomic.h>
#endif

typedef struct wtx_stop {
#ifdef __cplusplus
  const void *flag; /* C's const atomic_int * (C++ code only passes it on) */
#else
  const atomic_int *flag;
#endif
  int (*poll)(void *arg);
  void *arg;
} wtx_stop;

#ifndef __cplusplus
static inline int wtx_stop_now(const wtx_stop *s) {
  if (s == NULL) return 0;
  if (s->flag != NULL && atomic_load(s->flag)) return 1;
  return s->poll != NULL && s->poll(s->arg);
}
#endif

#ifdef __cplusplus
}
#endif
#endif /* WTX_COMMON_STOP_H */
