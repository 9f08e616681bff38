/* wtx trainer library: the sync client and the trainer engine.
 *
 * wtx_client drives every replica of a model (a list of worker addresses)
 * through wtx.v1.WeightTransfer with typed calls. A weight update is never
 * load-balanced: each call goes to every replica, blocks until all have
 * answered, and fails if any failed, naming the replica and carrying its gRPC
 * status (wtx_client_last_error, _last_replica, _last_status).
 *
 * wtx_trainer (the trainer engine, like vLLM's TrainerWeightTransferEngine)
 * does a whole weight sync from a wtx_source over the backend chosen by the
 * init info's oneof: rendezvous with every worker, then per sync start, every
 * chunk over the data plane, finish with a version.
 *
 * Functions return 0 or a negative WTX_E* code (common/error.h). */
#ifndef WTX_CLIENT_CLIENT_H
#define WTX_CLIENT_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "client/source.h"
#include "common/error.h"
#include "wtx/v1/weight_transfer.pb-c.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the sync client ---- */

typedef struct wtx_client wtx_client;

typedef struct wtx_client_options {
  /* Deadline of every call, ms; 0: 300000. */
  int64_t timeout_ms;
  /* Extra attempts of idempotent calls (GetWeightInfo, GetWorldSize) after
   * UNAVAILABLE or DEADLINE_EXCEEDED, with 100 ms x 2^attempt backoff; the
   * update calls are never retried. 0: none. */
  int retries;
  /* Bearer token sent as "authorization: Bearer <token>" (NULL: none).
   * Copied. */
  const char *token;
  /* TLS: PEM contents (not paths) of the CA bundle to trust; NULL keeps
   * plaintext. With cert_pem and key_pem also set: mutual TLS. Copied. */
  const char *tls_ca_pem;
  const char *tls_cert_pem;
  const char *tls_key_pem;
} wtx_client_options;

#define WTX_CLIENT_OPTIONS_INIT {0, 0, NULL, NULL, NULL, NULL}

/* Connects (lazily) to every "host:port" in targets. opts may be NULL.
 * *out is the caller's until wtx_client_destroy. */
int wtx_client_create(const char *const *targets, size_t n,
                      const wtx_client_options *opts, wtx_client **out);
void wtx_client_destroy(wtx_client *c);
size_t wtx_client_size(const wtx_client *c);
/* Replica i's address, owned by c. */
const char *wtx_client_target(const wtx_client *c, size_t i);
/* The last failure: message naming the replica, the replica's index (-1
 * when not one replica's) and its gRPC status code. Owned by c. */
const char *wtx_client_last_error(const wtx_client *c);
int wtx_client_last_replica(const wtx_client *c);
int wtx_client_last_status(const wtx_client *c);

/* InitWeightTransferEngine on replica i alone (a chain initializes in
 * order). On success the replica's session id is kept for the calls below;
 * *resp (may be NULL) receives the response, freed by the caller with
 * protobuf_c_message_free_unpacked. */
int wtx_client_init_one(wtx_client *c, size_t i, const Wtx__V1__InitInfo *info,
                        Wtx__V1__InitWeightTransferEngineResponse **resp);
/* The same in two halves, so calls to several replicas can be in flight at
 * once (a collective rendezvous such as NCCL's): every started call must be
 * waited for. */
int wtx_client_init_start(wtx_client *c, size_t i, const Wtx__V1__InitInfo *info);
int wtx_client_init_wait(wtx_client *c, size_t i,
                         Wtx__V1__InitWeightTransferEngineResponse **resp);
/* StartWeightUpdate on every replica (target: WTX__V1__UPDATE_TARGET_*). */
int wtx_client_start(wtx_client *c, int target);
/* UpdateWeights on every replica: start returns once every call is in
 * flight (the data plane then moves the bytes), wait collects them all. */
int wtx_client_update_start(wtx_client *c, const Wtx__V1__UpdateInfo *ui);
int wtx_client_update_wait(wtx_client *c);
/* FinishWeightUpdate on every replica; version "" or NULL lets the workers
 * number it. *published (may be NULL) receives replica 0's version label,
 * malloc'd. */
int wtx_client_finish(wtx_client *c, const char *version, char **published);
/* AbortWeightUpdate on every replica with an open session (best effort:
 * all are tried; returns the first failure). */
int wtx_client_abort(wtx_client *c, const char *reason);
/* An operator's abort: AbortWeightUpdate with no session id, discarding
 * whatever update is active on each replica, whoever started it. aborted[i]
 * (may be NULL) is 1 when one was, 0 when none was, -1 on failure. Returns
 * the first failure. */
int wtx_client_abort_any(wtx_client *c, const char *reason, int *aborted);
/* Inspection of replica i (retried per options). */
int wtx_client_weight_info(wtx_client *c, size_t i, int include_params,
                           Wtx__V1__GetWeightInfoResponse **resp);
int wtx_client_world_size(wtx_client *c, size_t i, uint32_t *world_size);
/* UpdateWeightVersion on every replica; *previous (may be NULL) receives
 * replica 0's old label, malloc'd. */
int wtx_client_set_version(wtx_client *c, const char *version, char **previous);

/* ---- the trainer engine ---- */

/* What a trainer rank brings to the rendezvous. The backend is the one set
 * in init's oneof (never a separate name that could disagree); its packing,
 * checksum and timeout are the session's wire parameters. For tcp,
 * init->tcp->upstream_address is where the trainer listens for the chain
 * ("host:port", default 127.0.0.1:0). */
typedef struct wtx_trainer_init_info {
  uint32_t rank; /* 0 sends; other ranks only iterate their source */
  const Wtx__V1__InitInfo *init;
} wtx_trainer_init_info;

typedef struct wtx_trainer wtx_trainer;

/* Rendezvous: creates the backend's trainer half (looked up by name in the
 * trainer registry) and initializes every replica. client (may be NULL on
 * ranks other than 0) and source must outlive the trainer. */
int wtx_trainer_init(const wtx_trainer_init_info *info, wtx_client *client,
                     wtx_source *source, wtx_trainer **out, char *err,
                     size_t errlen);

typedef struct wtx_send_options {
  const char *version; /* NULL or "": the workers number versions */
  int target;          /* WTX__V1__UPDATE_TARGET_*; 0: main */
  /* Called after every chunk (may be NULL). */
  void (*progress)(void *arg, uint64_t done_bytes, uint64_t total_bytes);
  void *progress_arg;
} wtx_send_options;

#define WTX_SEND_OPTIONS_INIT {NULL, 0, NULL, NULL}

typedef struct wtx_send_result {
  uint64_t bytes;
  size_t params;
  size_t chunks;
  double seconds;
  char version[260]; /* as published by replica 0 */
  /* XXH3-64 of every parameter sent, in metadata order (checksum XXH3_64
   * sessions); owned by the trainer until the next send. */
  const uint64_t *xxh3;
} wtx_send_result;

/* One weight sync: start, every chunk, finish. Returns when every replica
 * has published the new version. On any failure (a replica's error, the
 * source's iteration disagreeing with its metadata, the data plane) every
 * replica's update is aborted (their previous weights stay) and the error
 * names the cause; the next call initializes the sessions again. On ranks
 * other than 0 it iterates the source (keeping collectives aligned) and
 * sends nothing. result may be NULL. */
int wtx_trainer_send_weights(wtx_trainer *t, const wtx_send_options *opts,
                             wtx_send_result *result);
/* The last failure's message, owned by t. */
const char *wtx_trainer_last_error(const wtx_trainer *t);
/* Releases the backend and frees t (the workers keep their weights). */
void wtx_trainer_shutdown(wtx_trainer *t);

/* Compares every replica's published checksums with xxh3 (metadata order of
 * source): 0 when all match, WTX_ECHECKSUM naming the first difference. */
int wtx_client_verify(wtx_client *c, wtx_source *source, const uint64_t *xxh3);

#ifdef __cplusplus
}
#endif
#endif /* WTX_CLIENT_CLIENT_H */
