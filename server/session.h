/* The WorkerEngine session: wtx.v1.WeightTransfer's state machine and the
 * handlers of every WeightTransfer call. Each handler receives its session
 * as the call's user data (wtx_rpc_server_add_service's user pointer).
 *
 * session.c holds the calls that change the session (init, start, update,
 * finish, abort) and enforces the state machine, nowhere else; inspect.c
 * answers the calls that only look at it or at the published weights, and
 * Pause / Resume. Long data-plane receives run outside the session lock, so
 * inspection is answered during an update. */
#ifndef WTX_SERVER_SESSION_H
#define WTX_SERVER_SESSION_H

#include <pthread.h>
#include <stdatomic.h>

#include "common/layout.h"
#include "server/metrics.h"
#include "transport/plan.h"
#include "transport/rx.h"
#include "wtx/v1/weight_transfer.grpc-c.h"
#include "wtx/worker.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a session works with; copied at init. */
typedef struct wtx__session_config {
  const wtx_model_ops *model_ops;
  void *model;
  /* The internal store, for inspection (NULL with a host model). */
  wtx_store *store;
  /* The worker transports this session may create, one per InitInfo member
   * (resolved by the worker from wtx_worker_options.backends). */
  const wtx_worker_transport *const *transports;
  size_t n_transports;
  /* The policy the transports get (outlives the session). */
  const wtx_worker_env *env;
  uint32_t world_size;
  int64_t watchdog_ms;
  /* Per update, 0: none (wtx_worker_options.max_model_bytes, max_params). */
  uint64_t max_model_bytes;
  uint64_t max_params;
  /* Host callbacks for Pause / Resume (may be NULL), with their argument:
   * each returns whether generation is paused once it is done (1 or 0),
   * given was, the state before; Pause, Resume and GetWeightInfo report
   * that. NULL: Pause pauses and Resume resumes. */
  int (*on_pause)(void *host, int wait_for_inflight, int was);
  int (*on_resume)(void *host, int was);
  void *host;
  /* Called after each successful commit, outside the lock, before Finish
   * answers (may be NULL): nonzero (err says why) is Finish's status; the
   * weights stay published. */
  int (*on_commit)(void *user, wtx_target target, char *err, size_t errlen);
  void *on_commit_user;
  /* Where the session counts and times (NULL: no metrics). */
  wtx__metrics *metrics;
  /* A tensor-parallel rank's parts (wtx_worker_options.shard_rules,
   * parsed, each expert rule with its count): every tensor of an update
   * must be exactly the part these rules give this rank (ParamMeta.part),
   * and GetWeightInfo announces them. NULL: whole tensors only. The rules
   * outlive the session. */
  const wtx_shard_rule *shard_rules;
  size_t n_shard_rules;
  uint32_t tp_rank, tp_size;
  /* The version an engine this worker feeds says it serves (may be NULL):
   * GetWeightInfoResponse.serving_version. */
  int (*serving_version)(void *user, char *out, size_t len);
} wtx__session_config;

typedef struct wtx_session {
  pthread_mutex_t mu;
  wtx__session_config cfg;
  int state; /* WTX__V1__SESSION_STATE__* */
  char session_id[33];
  const wtx_worker_transport *transport;
  void *engine;
  wtx_wire_params wire;
  /* The CUDA device the session's updates are staged on (the backend
   * receives on a GPU and the model has stage_device), or -1: host. */
  int stage_device;
  /* The backend's receive region, when the model adopts device memory
   * (wtx_model_ops.adopt_device) and the trainer writes into it: tensors
   * are then staged in place there, each at its stream offset. NULL:
   * none. */
  uint8_t *region;
  uint64_t region_bytes;
  /* the active update */
  uint64_t update_id;
  uint64_t auto_version;
  wtx_target target;
  int receiving;
  int abort_requested; /* abort once the running receive returns */
  /* An init connecting outside the lock: its transport and engine, so
   * drain can cancel it. */
  const wtx_worker_transport *connecting_t;
  void *connecting;
  int draining;        /* no new calls; state ends at DRAINING */
  int64_t last_activity_ms;
  size_t staged_params;
  uint64_t staged_bytes;
  char version[WTX_MAX_VERSION_BYTES + 1]; /* prepared (then published) label */
  uint64_t published_update;  /* the last update published, for a repeated Finish */
  /* That update, while it may still be undone (no update or session since,
   * and the model can revert): an Abort naming it reverts it. 0: none. */
  uint64_t revertible;
  int table_replaced; /* it sent params: table[target] is its own */
  int delta; /* the open (or last) update is a delta (base_version set) */
  /* Per target, the label this session published last, and before it (a
   * host model's version after a revert; the store knows its own). */
  char label[2][WTX_MAX_VERSION_BYTES + 1];
  char label_before[WTX_MAX_VERSION_BYTES + 1];
  /* What on_commit answered for it (a repeated Finish answers the same). */
  int commit_rc;
  char commit_err[1024];
  uint64_t begun_bytes; /* of every tensor begun in this update */
  /* The params of this update (duplicates found here); per target, those of
   * the last update published that sent params, and their XXH3: a later
   * update may name tensors by position in it (UpdateInfo.layout). */
  wtx__layout cur;
  wtx__layout table[2];
  uint64_t table_xxh3[2];
  uint64_t table_id[2]; /* a new one per table (wtx_model_ops.check_range) */
  int by_range;   /* this update: -1 not yet known, 0 params, 1 layout ranges */
  size_t range_next; /* the next position a range of this update starts at */
  wtx_rx *rx;
  /* A chunk's tensors for rx, where the model stages them and (named by
   * params) their metas, scratch_n of each, reused chunk after chunk. */
  wtx_rx_tensor *rt;
  uint8_t **dst;
  wtx_tensor_meta *metas;
  uint64_t *sums; /* the loaded tensors' checksums, a patched one's whole */
  size_t scratch_n;
  uint8_t *carry_dst; /* staging of a tensor continued by the next chunk */
  atomic_int paused;  /* Pause in effect (its own flag: no lock needed) */
} wtx_session;

int wtx__session_init(wtx_session *s, const wtx__session_config *cfg);
void wtx__session_destroy(wtx_session *s);
/* The session's state (wtx.v1.SessionState), read under its lock. */
int wtx__session_state(wtx_session *s);
/* Aborts an update idle longer than the watchdog; 1 when it did. */
int wtx__session_watchdog(wtx_session *s);
/* No new calls; the active update is aborted (once its receive returns). */
void wtx__session_drain(wtx_session *s);

/* INVALID_ARGUMENT when a request's strings lost bytes in decoding: a NUL
 * inside a string (protobuf-c keeps C strings) shows as a request that
 * re-encodes shorter than it arrived. Also refuses encodings that are not
 * canonical (explicit defaults, over-long varints), which no protobuf
 * library emits. */
grpc_status_code wtx__check_request(wtx_rpc_ctx *ctx, const ProtobufCMessage *req);
/* INVALID_ARGUMENT naming field when text is not UTF-8 or is longer than
 * max bytes (max 0: no bound). */
grpc_status_code wtx__check_text(wtx_rpc_ctx *ctx, const char *field, const char *text,
                                 size_t max);

/* session.c: the calls that change the session. */
grpc_status_code wtx__handle_init(wtx_rpc_ctx *ctx,
    const Wtx__V1__InitWeightTransferEngineRequest *req,
    Wtx__V1__InitWeightTransferEngineResponse *resp);
grpc_status_code wtx__handle_start(wtx_rpc_ctx *ctx,
    const Wtx__V1__StartWeightUpdateRequest *req,
    Wtx__V1__StartWeightUpdateResponse *resp);
grpc_status_code wtx__handle_update(wtx_rpc_ctx *ctx,
    const Wtx__V1__UpdateWeightsRequest *req,
    Wtx__V1__UpdateWeightsResponse *resp);
grpc_status_code wtx__handle_prepare(wtx_rpc_ctx *ctx,
    const Wtx__V1__PrepareWeightUpdateRequest *req,
    Wtx__V1__PrepareWeightUpdateResponse *resp);
grpc_status_code wtx__handle_finish(wtx_rpc_ctx *ctx,
    const Wtx__V1__FinishWeightUpdateRequest *req,
    Wtx__V1__FinishWeightUpdateResponse *resp);
grpc_status_code wtx__handle_abort(wtx_rpc_ctx *ctx,
    const Wtx__V1__AbortWeightUpdateRequest *req,
    Wtx__V1__AbortWeightUpdateResponse *resp);

/* inspect.c: the calls that look, and Pause / Resume. */
grpc_status_code wtx__handle_version(wtx_rpc_ctx *ctx,
    const Wtx__V1__UpdateWeightVersionRequest *req,
    Wtx__V1__UpdateWeightVersionResponse *resp);
grpc_status_code wtx__handle_info(wtx_rpc_ctx *ctx,
    const Wtx__V1__GetWeightInfoRequest *req,
    Wtx__V1__GetWeightInfoResponse *resp);
grpc_status_code wtx__handle_world(wtx_rpc_ctx *ctx,
    const Wtx__V1__GetWorldSizeRequest *req,
    Wtx__V1__GetWorldSizeResponse *resp);
grpc_status_code wtx__handle_pause(wtx_rpc_ctx *ctx,
    const Wtx__V1__PauseRequest *req, Wtx__V1__PauseResponse *resp);
grpc_status_code wtx__handle_resume(wtx_rpc_ctx *ctx,
    const Wtx__V1__ResumeRequest *req, Wtx__V1__ResumeResponse *resp);

#ifdef __cplusplus
}
#endif
#endif /* WTX_SERVER_SESSION_H */
