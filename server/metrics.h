/* Prometheus metrics of a worker (wtx-worker --metrics-listen), in the text
 * exposition format, served over libmicrohttpd. The operation histogram has
 * the labels and bucket edges of vLLM's
 * vllm:rl_weight_update_operation_duration_seconds, so dashboards can put
 * the two side by side. Every function takes a NULL metrics (metrics off)
 * and does nothing. Thread-safe. Internal to server/. */
#ifndef WTX_SERVER_METRICS_H
#define WTX_SERVER_METRICS_H

#include <stddef.h>
#include <stdint.h>

/* The operation label: vLLM's names, plus prepare (wtx's first phase). */
typedef enum wtx__op {
  WTX__OP_INIT,
  WTX__OP_START,
  WTX__OP_START_DRAFT,
  WTX__OP_UPDATE,
  WTX__OP_PREPARE,
  WTX__OP_FINISH,
  WTX__OP_COUNT,
} wtx__op;

/* Why an update ended without publishing. The first ones are aborts (the
 * reason label of wtx_updates_aborted_total), the others failures
 * (wtx_updates_failed_total). */
typedef enum wtx__end {
  WTX__END_TRAINER,  /* AbortWeightUpdate */
  WTX__END_WATCHDOG,
  WTX__END_DRAIN,    /* SIGTERM, shutdown */
  WTX__END_CHECKSUM, /* failures from here */
  WTX__END_REFUSED,  /* a chunk the worker or its model refused */
  WTX__END_LIMIT,
  WTX__END_DATA_PLANE,
  WTX__END_MODEL,    /* the model failed: staging, loading, prepare, commit */
  WTX__END_COUNT,
} wtx__end;

typedef struct wtx__metrics wtx__metrics;

int wtx__metrics_create(wtx__metrics **out);
void wtx__metrics_destroy(wtx__metrics *m);

/* An operation began / ended (after seconds): the in-flight gauge and the
 * duration histogram. */
void wtx__metrics_begin(wtx__metrics *m, wtx__op op);
void wtx__metrics_end(wtx__metrics *m, wtx__op op, double seconds);
/* Bytes a chunk brought over backend ("shm", ...). */
void wtx__metrics_received(wtx__metrics *m, const char *backend, uint64_t bytes);
/* An update was published at unix time t. */
void wtx__metrics_published(wtx__metrics *m, double t);
/* A published update was undone (AbortWeightUpdate naming it). */
void wtx__metrics_reverted(wtx__metrics *m);
void wtx__metrics_ended(wtx__metrics *m, wtx__end why);
/* The last vLLM bridge result (1: vLLM loaded the version). */
void wtx__metrics_bridge(wtx__metrics *m, int ok, double t);

/* The gauges the worker knows at scrape time. */
typedef struct wtx__metrics_now {
  uint64_t generation, bytes;
  int state; /* wtx.v1.SessionState */
} wtx__metrics_now;

/* The exposition text, malloc'd (NULL when out of memory). */
char *wtx__metrics_render(wtx__metrics *m, const wtx__metrics_now *now);

#endif /* WTX_SERVER_METRICS_H */
