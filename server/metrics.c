/* Prometheus metrics of a worker (see metrics.h). */
#include "server/metrics.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wtx/error.h"

/* vLLM's bucket edges for rl_weight_update_operation_duration_seconds. */
static const double edges[] = {0.01, 0.1, 1, 10, 30, 60, 120, 300, 600};
#define N_EDGES (sizeof edges / sizeof edges[0])
#define MAX_BACKENDS 8

static const char *const op_names[WTX__OP_COUNT] = {"init", "start", "start_draft", "update",
                                                    "prepare", "finish"};
static const char *const end_names[WTX__END_COUNT] = {
    "trainer", "watchdog", "drain", "checksum", "refused", "limit", "data_plane", "model"};

struct wtx__metrics {
  pthread_mutex_t mu;
  int64_t in_flight[WTX__OP_COUNT];
  uint64_t buckets[WTX__OP_COUNT][N_EDGES]; /* cumulative at render, not here */
  uint64_t count[WTX__OP_COUNT];
  double sum[WTX__OP_COUNT];
  char backend[MAX_BACKENDS][32];
  uint64_t received[MAX_BACKENDS];
  uint64_t published, reverted;
  double last_publish;
  uint64_t ended[WTX__END_COUNT];
  int bridge_ok; /* -1: no result yet */
  double bridge_time;
};

int wtx__metrics_create(wtx__metrics **out) {
  wtx__metrics *m = calloc(1, sizeof *m);
  if (m == NULL) return WTX_ENOMEM;
  pthread_mutex_init(&m->mu, NULL);
  m->bridge_ok = -1;
  *out = m;
  return 0;
}

void wtx__metrics_destroy(wtx__metrics *m) {
  if (m == NULL) return;
  pthread_mutex_destroy(&m->mu);
  free(m);
}

void wtx__metrics_begin(wtx__metrics *m, wtx__op op) {
  if (m == NULL) return;
  pthread_mutex_lock(&m->mu);
  m->in_flight[op]++;
  pthread_mutex_unlock(&m->mu);
}

void wtx__metrics_end(wtx__metrics *m, wtx__op op, double seconds) {
  if (m == NULL) return;
  pthread_mutex_lock(&m->mu);
  m->in_flight[op]--;
  for (size_t i = 0; i < N_EDGES; i++)
    if (seconds <= edges[i]) {
      m->buckets[op][i]++;
      break;
    }
  m->count[op]++;
  m->sum[op] += seconds;
  pthread_mutex_unlock(&m->mu);
}

void wtx__metrics_received(wtx__metrics *m, const char *backend, uint64_t bytes) {
  if (m == NULL) return;
  pthread_mutex_lock(&m->mu);
  size_t i = 0;
  while (i < MAX_BACKENDS && m->backend[i][0] != '\0' && strcmp(m->backend[i], backend) != 0) i++;
  if (i < MAX_BACKENDS) {
    if (m->backend[i][0] == '\0') snprintf(m->backend[i], sizeof m->backend[i], "%s", backend);
    m->received[i] += bytes;
  }
  pthread_mutex_unlock(&m->mu);
}

void wtx__metrics_published(wtx__metrics *m, double t) {
  if (m == NULL) return;
  pthread_mutex_lock(&m->mu);
  m->published++;
  m->last_publish = t;
  pthread_mutex_unlock(&m->mu);
}

void wtx__metrics_reverted(wtx__metrics *m) {
  if (m == NULL) return;
  pthread_mutex_lock(&m->mu);
  m->reverted++;
  pthread_mutex_unlock(&m->mu);
}

void wtx__metrics_ended(wtx__metrics *m, wtx__end why) {
  if (m == NULL) return;
  pthread_mutex_lock(&m->mu);
  m->ended[why]++;
  pthread_mutex_unlock(&m->mu);
}

void wtx__metrics_bridge(wtx__metrics *m, int ok, double t) {
  if (m == NULL) return;
  pthread_mutex_lock(&m->mu);
  m->bridge_ok = ok;
  m->bridge_time = t;
  pthread_mutex_unlock(&m->mu);
}

/* ---- the exposition text ---- */

typedef struct text {
  char *buf;
  size_t len, cap;
  int oom;
} text;

static void put(text *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void put(text *t, const char *fmt, ...) {
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = t->oom ? 0 : vsnprintf(t->buf + t->len, t->cap - t->len, fmt, ap);
    va_end(ap);
    if (t->oom || n < 0) return;
    if ((size_t)n < t->cap - t->len) {
      t->len += (size_t)n;
      return;
    }
    char *b = realloc(t->buf, 2 * t->cap + (size_t)n);
    if (b == NULL) {
      t->oom = 1;
      return;
    }
    t->buf = b;
    t->cap = 2 * t->cap + (size_t)n;
  }
}

static void help(text *t, const char *name, const char *type, const char *what) {
  put(t, "# HELP %s %s\n# TYPE %s %s\n", name, what, name, type);
}

static void operations(text *t, const wtx__metrics *m) {
  const char *h = "wtx_rl_weight_update_operation_duration_seconds";
  help(t, h, "histogram", "Duration of one weight-transfer operation (vLLM's labels and buckets).");
  for (int op = 0; op < WTX__OP_COUNT; op++) {
    uint64_t cum = 0;
    for (size_t i = 0; i < N_EDGES; i++) {
      cum += m->buckets[op][i];
      put(t, "%s_bucket{operation=\"%s\",le=\"%g\"} %llu\n", h, op_names[op], edges[i],
          (unsigned long long)cum);
    }
    put(t, "%s_bucket{operation=\"%s\",le=\"+Inf\"} %llu\n", h, op_names[op],
        (unsigned long long)m->count[op]);
    put(t, "%s_sum{operation=\"%s\"} %.6f\n", h, op_names[op], m->sum[op]);
    put(t, "%s_count{operation=\"%s\"} %llu\n", h, op_names[op], (unsigned long long)m->count[op]);
  }
  const char *g = "wtx_rl_weight_update_operations_in_flight";
  help(t, g, "gauge", "Weight-transfer operations currently running.");
  for (int op = 0; op < WTX__OP_COUNT; op++)
    put(t, "%s{operation=\"%s\"} %lld\n", g, op_names[op], (long long)m->in_flight[op]);
}

static void counters(text *t, const wtx__metrics *m) {
  help(t, "wtx_received_bytes_total", "counter", "Bytes received over the data plane.");
  for (int i = 0; i < MAX_BACKENDS && m->backend[i][0] != '\0'; i++)
    put(t, "wtx_received_bytes_total{backend=\"%s\"} %llu\n", m->backend[i],
        (unsigned long long)m->received[i]);
  help(t, "wtx_updates_published_total", "counter", "Updates published.");
  put(t, "wtx_updates_published_total %llu\n", (unsigned long long)m->published);
  help(t, "wtx_updates_reverted_total", "counter",
       "Published updates undone because another replica did not publish them.");
  put(t, "wtx_updates_reverted_total %llu\n", (unsigned long long)m->reverted);
  help(t, "wtx_updates_aborted_total", "counter", "Updates aborted, by who ended them.");
  for (int e = 0; e < WTX__END_CHECKSUM; e++)
    put(t, "wtx_updates_aborted_total{reason=\"%s\"} %llu\n", end_names[e],
        (unsigned long long)m->ended[e]);
  help(t, "wtx_updates_failed_total", "counter", "Updates that failed, by cause.");
  for (int e = WTX__END_CHECKSUM; e < WTX__END_COUNT; e++)
    put(t, "wtx_updates_failed_total{reason=\"%s\"} %llu\n", end_names[e],
        (unsigned long long)m->ended[e]);
  help(t, "wtx_checksum_mismatches_total", "counter", "Tensors whose bytes did not hash to the sender's XXH3.");
  put(t, "wtx_checksum_mismatches_total %llu\n", (unsigned long long)m->ended[WTX__END_CHECKSUM]);
}

static void gauges(text *t, const wtx__metrics *m, const wtx__metrics_now *now) {
  static const char *const states[] = {"unspecified", "uninitialized", "ready", "updating",
                                       "draining", "prepared"};
  help(t, "wtx_published_generation", "gauge", "Updates published since the worker started.");
  put(t, "wtx_published_generation %llu\n", (unsigned long long)now->generation);
  help(t, "wtx_published_bytes", "gauge", "Bytes of the published weights.");
  put(t, "wtx_published_bytes %llu\n", (unsigned long long)now->bytes);
  help(t, "wtx_session_state", "gauge", "1 for the session's current state.");
  for (int s = 1; s < 6; s++)
    put(t, "wtx_session_state{state=\"%s\"} %d\n", states[s], now->state == s);
  help(t, "wtx_last_publish_timestamp_seconds", "gauge", "Unix time of the last publish (0: none).");
  put(t, "wtx_last_publish_timestamp_seconds %.3f\n", m->last_publish);
  if (m->bridge_ok >= 0) {
    help(t, "wtx_vllm_bridge_last_success", "gauge", "1 when vLLM loaded the last version (--vllm-url).");
    put(t, "wtx_vllm_bridge_last_success %d\n", m->bridge_ok);
    help(t, "wtx_vllm_bridge_last_timestamp_seconds", "gauge", "Unix time of the last bridge result.");
    put(t, "wtx_vllm_bridge_last_timestamp_seconds %.3f\n", m->bridge_time);
  }
}

char *wtx__metrics_render(wtx__metrics *m, const wtx__metrics_now *now) {
  text t = {malloc(8192), 0, 8192, 0};
  if (t.buf == NULL) return NULL;
  t.buf[0] = '\0';
  pthread_mutex_lock(&m->mu);
  operations(&t, m);
  counters(&t, m);
  gauges(&t, m, now);
  pthread_mutex_unlock(&m->mu);
  if (!t.oom) return t.buf;
  free(t.buf);
  return NULL;
}
