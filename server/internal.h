/* wtx worker internals shared by the files of server/. */
#ifndef WTX_SERVER_INTERNAL_H
#define WTX_SERVER_INTERNAL_H

#include <pthread.h>

#include "server/worker.h"
#include "transport/transport.h"
#include "wtx/v1/weight_transfer.grpc-c.h"

/* A set of names (duplicate detection within one update). */
typedef struct wtx__names {
  char **slots;
  size_t cap, n;
} wtx__names;

/* 0 when added, WTX_EEXIST when present, WTX_ENOMEM. */
int wtx__names_add(wtx__names *s, const char *name);
void wtx__names_clear(wtx__names *s);

typedef struct wtx_session {
  pthread_mutex_t mu;
  int state; /* WTX__V1__SESSION_STATE__* */
  char session_id[33];
  const wtx_worker_transport *transport;
  void *engine;
  wtx_wire_params wire;
  const wtx_model_ops *model_ops;
  void *model;
  uint32_t world_size;
  int64_t watchdog_ms;
  /* the active update */
  uint64_t update_id;
  uint64_t auto_version;
  int target;
  int receiving;
  int abort_requested; /* abort once the running receive returns */
  int draining;        /* no new calls; state ends at DRAINING */
  int64_t last_activity_ms;
  size_t staged_params;
  uint64_t staged_bytes;
  wtx__names names;
  wtx_rx *rx;
  uint8_t *carry_dst; /* staging of a tensor continued by the next chunk */
  /* Called after each successful commit, outside mu (may be NULL). */
  void (*on_commit)(void *user, int target);
  void *on_commit_user;
} wtx_session;

int wtx__session_init(wtx_session *s, const wtx_model_ops *ops, void *model,
                      uint32_t world_size, int64_t watchdog_ms);
void wtx__session_destroy(wtx_session *s);
int wtx__session_watchdog(wtx_session *s);
void wtx__session_drain(wtx_session *s);

/* The WeightTransfer handlers that change the session, registered as they
 * are; each finds its session through the call's user pointer. */
wtx_session *wtx__session_of(wtx_rpc_ctx *ctx);
grpc_status_code wtx__handle_init(wtx_rpc_ctx *ctx,
    const Wtx__V1__InitWeightTransferEngineRequest *req,
    Wtx__V1__InitWeightTransferEngineResponse *resp);
grpc_status_code wtx__handle_start(wtx_rpc_ctx *ctx,
    const Wtx__V1__StartWeightUpdateRequest *req,
    Wtx__V1__StartWeightUpdateResponse *resp);
grpc_status_code wtx__handle_update(wtx_rpc_ctx *ctx,
    const Wtx__V1__UpdateWeightsRequest *req,
    Wtx__V1__UpdateWeightsResponse *resp);
grpc_status_code wtx__handle_finish(wtx_rpc_ctx *ctx,
    const Wtx__V1__FinishWeightUpdateRequest *req,
    Wtx__V1__FinishWeightUpdateResponse *resp);
grpc_status_code wtx__handle_abort(wtx_rpc_ctx *ctx,
    const Wtx__V1__AbortWeightUpdateRequest *req,
    Wtx__V1__AbortWeightUpdateResponse *resp);

/* Writes every published main version to dir as <version>.safetensors plus
 * a LATEST file naming it, keeping the newest keep files (see publish.c). */
typedef struct wtx__publisher wtx__publisher;
int wtx__publisher_create(wtx_store *store, const char *dir, int keep,
                          wtx__publisher **out);
void wtx__publisher_notify(wtx__publisher *p);
/* Writes a version still queued, then stops. */
void wtx__publisher_destroy(wtx__publisher *p);

#endif
