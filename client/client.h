/* wtx trainer library (first cut): fan-out to every worker replica and a full
 * weight push over the shm backend from a synthetic source.
 *
 * A weight update is never load-balanced: every call goes to every worker,
 * waits for all of them, and fails naming the first replica that failed. */
#ifndef WTX_CLIENT_CLIENT_H
#define WTX_CLIENT_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "common/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wtx_client wtx_client;

/* Connects (lazily) to every "host:port" in targets. On success *out is the
 * caller's until wtx_client_destroy. */
int wtx_client_create(const char *const *targets, size_t n, wtx_client **out);
void wtx_client_destroy(wtx_client *c);
/* Detail of the last failure: the replica and its gRPC status. Owned by c. */
const char *wtx_client_last_error(const wtx_client *c);

/* One parameter of a synthetic model. */
typedef struct wtx_synth_param {
  char name[128];
  int dtype;
  uint64_t shape[2];
  size_t ndim;
  uint64_t nbytes;
  uint64_t xxh3; /* filled by wtx_client_push */
} wtx_synth_param;

/* A GPT-style layer stack of about total_bytes of bf16 (embeddings, layers
 * of attention + MLP + norms, final norm): *out (free()) and *n. */
int wtx_synth_layout(uint64_t total_bytes, wtx_synth_param **out, size_t *n);

typedef struct wtx_push_options {
  uint64_t buffer_size; /* 0: 64 MiB */
  const char *version;  /* NULL/"": the workers number versions */
  uint64_t seed;        /* content of the synthetic tensors */
  int64_t timeout_ms;   /* per call; 0: 300000 */
  /* Progress after each chunk (may be NULL). */
  void (*progress)(void *arg, uint64_t done, uint64_t total);
  void *progress_arg;
} wtx_push_options;

#define WTX_PUSH_OPTIONS_INIT {0, NULL, 0, 0, NULL, NULL}

/* Init (shm) + start + chunks + finish on every worker; fills params[].xxh3
 * with the sender's checksums. Any worker failing aborts the update on all
 * of them (their previous weights stay) and is reported. */
int wtx_client_push_shm(wtx_client *c, wtx_synth_param *params, size_t n,
                        const wtx_push_options *opts);

/* Compares every worker's published checksums with params[].xxh3; 0 when all
 * match, WTX_ECHECKSUM naming the first difference. */
int wtx_client_verify(wtx_client *c, const wtx_synth_param *params, size_t n);

#ifdef __cplusplus
}
#endif
#endif
