/* The WorkerEngine session: wtx.v1.WeightTransfer's state machine and the
 * handlers of every WeightTransfer call. Each handler receives its session
 * as the call's user data (wtx__rpc_server_add_service's user pointer).
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

/* The active update: what a StartWeightUpdate opens and a Finish or an
 * Abort ends. Every update begins from a reset one, and an abort is one
 * reset (wtx__update_reset, session.c): nothing of an update outlives it
 * but what a publish hands on (the session's labels and tables). */
typedef struct wtx__update {
  wtx_target target;
  int delta;           /* a delta (StartWeightUpdateRequest.base_version) */
  int receiving;       /* an UpdateWeights is receiving, outside the lock */
  /* Ordered calls (UpdateWeightsRequest.call_index) that have ended: call
   * calls_done + 1 is the one taken next; later ones wait for it (turn). */
  uint32_t calls_done;
  int abort_requested; /* abort once the running receive returns */
  size_t staged_params;
  uint64_t staged_bytes;
  uint64_t begun_bytes; /* of every tensor begun in this update */
  int by_range;      /* -1 not yet known, 0 params, 1 layout ranges */
  size_t range_next; /* the next position a range of this update starts at */
  uint8_t *carry_dst; /* staging of a tensor continued by the next chunk */
  /* A patch of spans (Patch.spans) whose bytes run on into the next chunk:
   * its bytes so far (wire, malloc'd, owned here until the patch is
   * applied or the update ends; bytes in all) and its tensor's staging
   * (full), where it applies once its last byte is in. */
  struct wtx__spans {
    uint8_t *wire, *full;
    uint64_t bytes;
  } spans;
  /* A tensor staged on the GPU but received on the host (a delta's chunk
   * with patches, session.c's bounce) that the next chunk continues: its
   * host copy (malloc'd, owned here until the tensor or the update ends);
   * its device staging is carry_dst. */
  uint8_t *bounce_host;
  /* A tensor sent in boxes (UpdateInfo.box), open from its first box until
   * its boxes cover it: its position in cur (params) or in the table named
   * (layout), its staging, its elements received so far (a bit each, so
   * no box overlaps another) and their bytes. */
  struct wtx__boxed {
    int open;
    size_t pos;
    uint8_t *dst;
    uint64_t *bits;
    uint64_t covered;
  } boxed;
  /* Its params (duplicates are found here); its memory is kept from one
   * update to the next. */
  wtx__layout cur;
} wtx__update;

/* What published updates hand on, per target: the params of the last
 * update published that sent them, and their XXH3, which a later update
 * may name by position (UpdateInfo.layout); and the labels published. */
typedef struct wtx__tables {
  wtx__layout table[2];
  uint64_t xxh3[2];
  uint64_t id[2]; /* a new one per table (wtx_model_ops.check_range) */
  int replaced;   /* the last publish sent params: table[target] is its own */
  /* The label this session published last per target, and the one before
   * it (a host model's version after a revert; the store knows its own). */
  char label[2][WTX_MAX_VERSION_BYTES + 1];
  char label_before[WTX_MAX_VERSION_BYTES + 1];
} wtx__tables;

/* A chunk's tensors for rx, where the model stages them, their metas
 * (named by params) and their checksums (a patched one's whole), n of
 * each, reused chunk after chunk. */
typedef struct wtx__scratch {
  wtx_rx_tensor *rt;
  uint8_t **dst;
  wtx_tensor_meta *metas;
  uint64_t *sums;
  size_t n;
} wtx__scratch;

struct wtx_session;
struct wtx__chunk; /* one UpdateWeights call's chunk (session.c) */

/* The model's ops as the session calls them: whichever form the model
 * offers of each step (per tensor or per chunk; staged on the host, on a
 * GPU or adopted in place) chosen once, when the session begins and when
 * its backend says where tensors are staged, so each step has one path.
 * check_one: within each tensor's validation, or NULL; check_chunk: once
 * the chunk's tensors are valid, or NULL; stage: tensors [first, n) of the
 * chunk, the first beginning at byte `at` of the update's stream. */
typedef struct wtx__model_steps {
  int (*check_one)(struct wtx_session *s, const wtx_tensor_meta *meta, char *err,
                   size_t errlen);
  int (*check_chunk)(struct wtx_session *s, struct wtx__chunk *c);
  int (*check_range)(struct wtx_session *s, struct wtx__chunk *c, uint64_t table);
  int (*stage)(struct wtx_session *s, struct wtx__chunk *c, size_t first, uint64_t at);
  int (*loaded)(struct wtx_session *s, struct wtx__chunk *c, size_t done, const uint64_t *sums);
} wtx__model_steps;

typedef struct wtx_session {
  pthread_mutex_t mu;
  /* Signalled, under mu, when an ordered call ends and when the update
   * does: an UpdateWeights sent ahead of its turn waits on it. */
  pthread_cond_t turn;
  wtx__session_config cfg;
  int state; /* WTX__V1__SESSION_STATE__* */
  char session_id[33];
  wtx__model_steps steps;
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
  /* An init connecting outside the lock: its transport and engine, so
   * drain can cancel it. */
  const wtx_worker_transport *connecting_t;
  void *connecting;
  int draining;        /* no new calls; state ends at DRAINING */
  int64_t last_activity_ms;
  uint64_t update_id; /* the last update opened (ids never repeat) */
  uint64_t auto_version;
  wtx__update up;     /* the active (or last) update */
  char version[WTX_MAX_VERSION_BYTES + 1]; /* prepared (then published) label */
  uint64_t published_update;  /* the last update published, for a repeated Finish */
  /* That update, while it may still be undone (no update or session since,
   * and the model can revert): an Abort naming it reverts it. 0: none. */
  uint64_t revertible;
  /* What on_commit answered for it (a repeated Finish answers the same). */
  int commit_rc;
  char commit_err[1024];
  wtx__tables tb;
  wtx_rx *rx;
  wtx__scratch sc;
  atomic_int paused;  /* Pause in effect (its own flag: no lock needed) */
} wtx_session;

int wtx__session_init(wtx_session *s, const wtx__session_config *cfg);
/* Whether m reads host tensors in place (adopt_chunk, a member of model
 * ops version 2): the one test of it, for the session and for the
 * backends' wtx_worker_env.host_adopt. */
int wtx__model_adopts_host(const wtx_model_ops *m);
void wtx__session_destroy(wtx_session *s);
/* The session's state (wtx.v1.SessionState), read under its lock. */
int wtx__session_state(wtx_session *s);
/* Aborts an update idle longer than the watchdog; 1 when it did. */
int wtx__session_watchdog(wtx_session *s);
/* No new calls; the active update is aborted (once its receive returns). */
void wtx__session_drain(wtx_session *s);
/* The label target's weights are published under now: the store's, or
 * for a host's model (which keeps none) what this session published last
 * there. Caller holds mu. */
void wtx__session_served(wtx_session *s, wtx_target target, char *out, size_t len);

/* INVALID_ARGUMENT when a request's strings lost bytes in decoding: a NUL
 * inside a string (protobuf-c keeps C strings) shows as a request that
 * re-encodes shorter than it arrived. Also refuses encodings that are not
 * canonical (explicit defaults, over-long varints), which no protobuf
 * library emits. */
grpc_status_code wtx__check_request(wtx__rpc_ctx *ctx, const ProtobufCMessage *req);
/* INVALID_ARGUMENT naming field when text is not UTF-8 or is longer than
 * max bytes (max 0: no bound). */
grpc_status_code wtx__check_text(wtx__rpc_ctx *ctx, const char *field, const char *text,
                                 size_t max);

/* session.c: the calls that change the session. */
grpc_status_code wtx__handle_init(wtx__rpc_ctx *ctx,
    const Wtx__V1__InitWeightTransferEngineRequest *req,
    Wtx__V1__InitWeightTransferEngineResponse *resp);
grpc_status_code wtx__handle_start(wtx__rpc_ctx *ctx,
    const Wtx__V1__StartWeightUpdateRequest *req,
    Wtx__V1__StartWeightUpdateResponse *resp);
grpc_status_code wtx__handle_update(wtx__rpc_ctx *ctx,
    const Wtx__V1__UpdateWeightsRequest *req,
    Wtx__V1__UpdateWeightsResponse *resp);
grpc_status_code wtx__handle_prepare(wtx__rpc_ctx *ctx,
    const Wtx__V1__PrepareWeightUpdateRequest *req,
    Wtx__V1__PrepareWeightUpdateResponse *resp);
grpc_status_code wtx__handle_finish(wtx__rpc_ctx *ctx,
    const Wtx__V1__FinishWeightUpdateRequest *req,
    Wtx__V1__FinishWeightUpdateResponse *resp);
grpc_status_code wtx__handle_abort(wtx__rpc_ctx *ctx,
    const Wtx__V1__AbortWeightUpdateRequest *req,
    Wtx__V1__AbortWeightUpdateResponse *resp);

/* inspect.c: the calls that look, and Pause / Resume. */
grpc_status_code wtx__handle_version(wtx__rpc_ctx *ctx,
    const Wtx__V1__UpdateWeightVersionRequest *req,
    Wtx__V1__UpdateWeightVersionResponse *resp);
grpc_status_code wtx__handle_info(wtx__rpc_ctx *ctx,
    const Wtx__V1__GetWeightInfoRequest *req,
    Wtx__V1__GetWeightInfoResponse *resp);
grpc_status_code wtx__handle_world(wtx__rpc_ctx *ctx,
    const Wtx__V1__GetWorldSizeRequest *req,
    Wtx__V1__GetWorldSizeResponse *resp);
grpc_status_code wtx__handle_pause(wtx__rpc_ctx *ctx,
    const Wtx__V1__PauseRequest *req, Wtx__V1__PauseResponse *resp);
grpc_status_code wtx__handle_resume(wtx__rpc_ctx *ctx,
    const Wtx__V1__ResumeRequest *req, Wtx__V1__ResumeResponse *resp);

#ifdef __cplusplus
}
#endif
#endif /* WTX_SERVER_SESSION_H */
