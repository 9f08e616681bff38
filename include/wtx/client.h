/* wtx trainer library: the sync client and the trainer engine.
 *
 * wtx_client drives every replica of a model (a list of worker addresses)
 * through wtx.v1.WeightTransfer. A weight update is never load-balanced:
 * each call goes to every replica, blocks until all have answered, and
 * fails if any failed, naming the replica and carrying its gRPC status
 * (wtx_client_last_error, _last_replica, _last_status).
 *
 * wtx_trainer (the trainer engine, like vLLM's TrainerWeightTransferEngine)
 * does a whole weight sync from a wtx_source over the backend its config
 * names: rendezvous with every worker, then per sync start, every chunk
 * over the data plane, finish with a version.
 *
 * Everything here is plain C: config structs with _INIT macros, enums with
 * the wire's values, opaque handles; a binding (ctypes, cffi, cgo) needs no
 * protobuf. Functions return 0 or a negative WTX_E* code (wtx/error.h). */
#ifndef WTX_CLIENT_H
#define WTX_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "wtx/error.h"
#include "wtx/limits.h"
#include "wtx/source.h"
#include "wtx/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the sync client ---- */

typedef struct wtx_client wtx_client;

typedef struct wtx_client_options {
  /* Deadline of every call, ms; 0: WTX_DEFAULT_TIMEOUT_MS. */
  int64_t timeout_ms;
  /* Extra attempts of idempotent calls (GetWeightInfo, GetWorldSize) after
   * UNAVAILABLE or DEADLINE_EXCEEDED, with 100 ms x 2^attempt backoff; the
   * update calls are never retried. 0: none. */
  int retries;
  /* Bearer token sent as "authorization: Bearer <token>" (NULL: none).
   * Copied. */
  const char *token;
  /* TLS: PEM contents (not paths) of the CA bundle to trust; NULL keeps
   * plaintext. With cert_pem and key_pem also set: mutual TLS (one without
   * the other is an error). Copied. */
  const char *tls_ca_pem;
  const char *tls_cert_pem;
  const char *tls_key_pem;
} wtx_client_options;

/* Every field at its default; set the ones you need after it. */
#define WTX_CLIENT_OPTIONS_INIT WTX__INIT(.timeout_ms = 0)

/* Connects (lazily) to every "host:port" in targets (1..WTX_MAX_WORKERS;
 * targets is only read during the call). opts may be NULL. On error err
 * says why (too many workers, TLS credentials that do not build) and
 * nothing is created. *out is the caller's until wtx_client_destroy. */
int wtx_client_create(const char *const *targets, size_t n,
                      const wtx_client_options *opts, wtx_client **out,
                      char *err, size_t errlen);
void wtx_client_destroy(wtx_client *c);

/* ---- a control plane of the caller's ---- */

/* The four calls of vLLM's weight-sync control plane (its
 * VLLMWeightSyncClient), made by the caller instead of wtx's gRPC: a vLLM
 * server's HTTP routes, Ray actors, any way to reach workers that run the
 * wtx engine. Messages are serialized wtx.v1 protobuf (InitInfo,
 * UpdateInfo); a binding converts them, e.g. to their JSON form. Each call
 * returns 0, or a WTX_E* code with a message in err. init and update may
 * block until the worker has acted: the engine runs them on a thread of
 * its own while the data plane moves the bytes. A delta sync
 * (wtx_trainer_config.delta) calls update once right after start with an
 * UpdateInfo carrying only base_version: the engine behind the control
 * plane starts its update against that base, or fails the call, and the
 * trainer then sends the whole model in the same sync (the wtx vLLM
 * plugin does both). Deltas need named versions here: finish answers
 * nothing, so what a replica serves is the version the last finish named. */
/* The wtx_control_ops layout of this header: 2, every member below (1:
 * without patches). */
#define WTX_CONTROL_OPS_VERSION 2u

typedef struct wtx_control_ops {
  /* WTX_CONTROL_OPS_VERSION as the caller built it (0 is refused): the
   * library reads only the members that version has (SQLite's iVersion). */
  unsigned version;
  int (*init)(void *self, const uint8_t *init_info, size_t len, char *err, size_t errlen);
  int (*start)(void *self, int target, char *err, size_t errlen);
  int (*update)(void *self, const uint8_t *update_info, size_t len, char *err,
                size_t errlen);
  /* version: NULL or "" lets the workers number it. */
  int (*finish)(void *self, const char *version, char *err, size_t errlen);
  /* Optional (NULL: nothing is called): ends the active update, the
   * previous weights staying. */
  void (*abort)(void *self, const char *reason);
  /* Version 2. Nonzero: the engines behind this control plane take a
   * delta's patches (the wtx vLLM plugin's, started with
   * WTX_VLLM_KEEP_BASE=1). Their start answers nothing, so only the caller
   * can say so; 0: every changed tensor goes whole, and the caller's own
   * patches are refused. An engine that takes none refuses the first
   * patch (FAILED_PRECONDITION): that sync fails, every weight stays. */
  int patches;
} wtx_control_ops;

/* A client of one endpoint (however many workers stand behind it) reached
 * through ops, for wtx_trainer_init. ops and self must outlive the client.
 * The inspection calls (weight info, world size, set_version, abort_any,
 * verify) answer WTX_ENOTSUP. *out is the caller's until
 * wtx_client_destroy. */
int wtx_client_create_control(const wtx_control_ops *ops, void *self, wtx_client **out);
size_t wtx_client_size(const wtx_client *c);
/* Replica i's address, owned by c. */
const char *wtx_client_target(const wtx_client *c, size_t i);
/* The last failure: message naming the replica, the replica's index (-1
 * when not one replica's) and its gRPC status code. Owned by c, valid until
 * the next call on c. */
const char *wtx_client_last_error(const wtx_client *c);
int wtx_client_last_replica(const wtx_client *c);
int wtx_client_last_status(const wtx_client *c);

/* The state of a worker's session (the values of wtx.v1.SessionState). */
typedef enum wtx_session_state {
  WTX_SESSION_UNINITIALIZED = 1,
  WTX_SESSION_READY = 2,
  WTX_SESSION_UPDATING = 3,
  WTX_SESSION_DRAINING = 4,
} wtx_session_state;

/* "UNINITIALIZED", "READY", ... (static); "UNSPECIFIED" for others. */
const char *wtx_session_state_name(int state);

/* One published parameter. */
typedef struct wtx_param_info {
  wtx_tensor_meta meta; /* meta.name owned by the wtx_weight_info */
  uint64_t xxh3;        /* XXH3-64 of the published bytes, when has_xxh3 */
  int has_xxh3;         /* 0: the update ran without checksums */
} wtx_param_info;

/* What GetWeightInfo tells of one worker. */
typedef struct wtx_weight_info {
  char version[WTX_MAX_VERSION_BYTES + 1]; /* "" before the first publish */
  uint64_t generation;      /* updates published since the worker started */
  wtx_session_state state;
  char backend[64];         /* of the current session; "" before init */
  size_t num_params;
  uint64_t total_bytes;
  int paused;
  int active_target;        /* wtx_target of the active update; 0: none */
  size_t draft_num_params;
  uint64_t draft_total_bytes;
  /* With include_params: every published parameter (n_params of them),
   * owned by the struct until wtx_weight_info_free. */
  wtx_param_info *params;
  size_t n_params;
  /* A tensor-parallel worker (its shard rules, GetWeightInfoResponse.shard):
   * rank tp_rank of tp_size, under n_shard_rules rules; tp_size 0: it holds
   * whole tensors. */
  uint32_t tp_rank, tp_size;
  size_t n_shard_rules;
} wtx_weight_info;

/* GetWeightInfo of replica i (retried per options) into *out; free it with
 * wtx_weight_info_free, also after an error. */
int wtx_client_weight_info(wtx_client *c, size_t i, int include_params,
                           wtx_weight_info *out);
void wtx_weight_info_free(wtx_weight_info *info);
int wtx_client_world_size(wtx_client *c, size_t i, uint32_t *world_size);
/* UpdateWeightVersion on every replica (version 1..WTX_MAX_VERSION_BYTES
 * bytes); previous (may be NULL) receives replica 0's old label, truncated
 * to prevlen. */
int wtx_client_set_version(wtx_client *c, const char *version, char *previous,
                           size_t prevlen);
/* An operator's abort: AbortWeightUpdate with no session id, discarding
 * whatever update is active on each replica, whoever started it. aborted
 * (may be NULL; wtx_client_size entries) receives 1 when one was, 0 when
 * none was, -1 on failure. Returns the first failure. */
int wtx_client_abort_any(wtx_client *c, const char *reason, int *aborted);
/* Compares every replica's published checksums with xxh3 (metadata order of
 * source): 0 when all match, WTX_ECHECKSUM naming the first difference. */
int wtx_client_verify(wtx_client *c, wtx_source *source, const uint64_t *xxh3);

/* ---- the trainer engine ---- */

/* Per-tensor integrity check (the values of wtx.v1.ChecksumAlgorithm). */
typedef enum wtx_checksum {
  WTX_CHECKSUM_DEFAULT = 0, /* the backend's: XXH3-64 on shm and tcp, none on GPU */
  WTX_CHECKSUM_NONE = 1,
  WTX_CHECKSUM_XXH3_64 = 2,
} wtx_checksum;

/* What a trainer rank brings to the rendezvous: the backend and the wire
 * parameters every worker of the session agrees to. */
typedef struct wtx_trainer_config {
  /* 0 sends; other ranks only iterate their source (with world > 1:
   * every rank sends what it owns) */
  uint32_t rank;
  /* A registered trainer backend: "shm" (same host), "tcp", "cuda_ipc"
   * (same node, GPU), "nccl" (GPU); NULL: "shm". */
  const char *backend;
  int unpacked;             /* 1: one tensor per chunk; 0: packed (default) */
  /* 0: the backend's choice: shm 4 MiB per worker x 4 (up to 64 MiB), the
   * others WTX_DEFAULT_BUFFER_SIZE x WTX_DEFAULT_NUM_BUFFERS (64 MiB x 2). */
  uint64_t buffer_size;     /* bytes per buffer */
  uint32_t num_buffers;     /* buffers in flight */
  wtx_checksum checksum;
  uint32_t timeout_ms;      /* bound on one data-plane step; 0: the default */
  /* tcp: where the trainer's data port listens ("host:port"; NULL:
   * 127.0.0.1:0). Copied. */
  const char *data_address;
  /* 1: direct receive. Every worker holds a receive region the size of the
   * source's tensors on its GPU for the session, and a model that adopts
   * device memory (wtx_model_ops.adopt_device) reads its tensors there:
   * cuda_ipc writes every update straight into each region (one copy per
   * byte per worker instead of the trainer's buffer and the worker's copy
   * out of it; where a worker has no room, the session uses the buffers,
   * and wtx_send_result.direct says which); nccl workers broadcast into
   * their region (one without room uses its buffer; the trainer cannot
   * tell, and the result's direct stays 0). shm and tcp ignore it. */
  int direct;
  /* Many senders (tcp only): the trainer's ranks, each sending the bytes
   * it owns (wtx_source_ops.ownership) straight to the workers that hold
   * them, on a plan made at init (docs/data-plane.md, "Many senders").
   * 0 or 1: rank 0 sends every byte. With world > 1, every rank calls
   * wtx_trainer_init, then each wtx_trainer_send_weights, together (each
   * bounded by timeout_ms), each with a client of the same workers and a
   * source with the same metadata and ownership; rank 0 drives the
   * workers' sessions. */
  uint32_t world;
  /* With world > 1: the data port of every rank, world "host:port"
   * entries, the same list on every rank; rank r listens on entry r, and
   * the workers connect to each. Only read during init. */
  const char *const *rank_addresses;
  /* With world > 1: a secret the same on every rank (16..64 bytes), which
   * every data connection presents. Copied. */
  const char *session_token;
  /* wtx_delta: delta syncs (docs/data-plane.md, "Delta updates"). Each sync hashes
   * every tensor once (XXH3-64, on the host) and sends only those whose
   * hash differs from what every replica serves: the hashes of the last
   * sync this trainer landed, or, for a new trainer, those the workers
   * report (GetWeightInfo). The start names each replica's version as the
   * delta's base; a replica serving another version refuses it before any
   * byte moves, and the sync sends the whole table instead
   * (wtx_send_result.full_reason says why). With rank 0 sending, every
   * rank must set it alike: each sync is then two passes over the source
   * on every rank. With many senders (world > 1) every rank sets it too:
   * each hashes the pieces it sends, rank 0 gathers which changed over its
   * link to each, and a changed tensor travels whole from all its owners;
   * a trainer's first sync is whole. Main target only; on cuda_ipc and
   * nccl with rank 0 sending only with checksum XXH3_64, whose host copy
   * the hash pass reads.
   * WTX_DELTA_PATCHES also sends a changed tensor as a patch of the
   * elements that changed (wtx.v1.Patch) where that is fewer bytes than
   * the tensor and fits a buffer, to workers that take patches; for it the
   * trainer keeps a host copy of every tensor as the workers serve it: as
   * much memory as the model (tensors whose bytes the source does not keep
   * put for the pass are always sent whole). With many senders, a
   * worker's tensor that one piece of the plan feeds whole goes as a patch
   * of that piece, made by the rank that sends it from its own copy (as
   * much memory as such pieces); one that several ranks feed goes whole. */
  int delta;
} wtx_trainer_config;

/* wtx_trainer_config.delta. */
typedef enum wtx_delta {
  WTX_DELTA_OFF = 0,
  WTX_DELTA_TENSORS = 1, /* only the tensors that changed */
  WTX_DELTA_PATCHES = 2, /* and those as patches of their changed elements */
} wtx_delta;

/* Every field at its default; set the ones you need after it. */
#define WTX_TRAINER_CONFIG_INIT WTX__INIT(.rank = 0)

typedef struct wtx_trainer wtx_trainer;

/* Rendezvous: creates the backend's trainer half and initializes every
 * replica; on rank 0 also plans the syncs from the source's table (see
 * wtx_source_ops.metadata). client (may be NULL on ranks other than 0) and
 * source must outlive the trainer; cfg is only read during the call. On
 * error err names the cause (a limit, an unknown backend, a replica's
 * refusal). *out is the caller's until wtx_trainer_shutdown. */
int wtx_trainer_init(const wtx_trainer_config *cfg, wtx_client *client,
                     wtx_source *source, wtx_trainer **out, char *err,
                     size_t errlen);

typedef struct wtx_send_options {
  /* Label of the new weights (at most WTX_MAX_VERSION_BYTES); NULL or "":
   * the workers number versions. Only read during the call. */
  const char *version;
  int target; /* wtx_target; 0: main */
  /* Called after every chunk (may be NULL), with progress_arg. */
  void (*progress)(void *arg, uint64_t done_bytes, uint64_t total_bytes);
  void *progress_arg;
} wtx_send_options;

/* Every field at its default; set the ones you need after it. */
#define WTX_SEND_OPTIONS_INIT WTX__INIT(.version = NULL)

typedef struct wtx_send_result {
  uint64_t bytes;
  size_t params;
  size_t chunks;
  double seconds;
  char version[WTX_MAX_VERSION_BYTES + 1]; /* as published by replica 0 */
  /* XXH3-64 of every parameter sent, in metadata order (checksum XXH3_64
   * sessions, else NULL); owned by the trainer until the next send. */
  const uint64_t *xxh3;
  /* 1: cuda_ipc wrote the bytes straight into every worker's memory
   * (wtx_trainer_config.direct took effect); 0: through buffers (and
   * always 0 on the other backends). */
  int direct;
  /* What the sync's chunks cost the control plane: the packed UpdateInfo
   * of every UpdateWeights call, over every worker (gRPC's framing and the
   * four-call frame around them aside). A sync after the first names its
   * tensors by position and carries no per-tensor metadata. */
  uint64_t control_bytes;
  /* With wtx_trainer_config.delta: 1 when the sync was a delta (bytes,
   * params and chunks are what it sent; the rest carried over on every
   * replica), and what it did not send because every replica serves it
   * already. 0 with full_reason set: it sent the whole table, and
   * full_reason (owned by the trainer until its next send) says why: the
   * first sync, a replica serving another version than the one this
   * trainer knew (its refusal), a replica's version not known. NULL when
   * delta is off or the sync was a delta. */
  int delta;
  size_t skipped_params;
  uint64_t skipped_bytes;
  const char *full_reason;
  /* With WTX_DELTA_PATCHES: the tensors sent as patches (of params), and
   * what they would have cost whole. */
  size_t patched_params;
  uint64_t patched_whole_bytes;
} wtx_send_result;

/* One weight sync: start, every chunk, finish. Returns when every replica
 * has published the new version. On any failure (a replica's error, the
 * source's iteration disagreeing with its metadata, the data plane) every
 * replica's update is aborted (their previous weights stay) and the error
 * names the cause; the next call initializes the sessions again. On ranks
 * other than 0 it iterates the source (keeping collectives aligned) and
 * sends nothing. opts and result may be NULL. */
int wtx_trainer_send_weights(wtx_trainer *t, const wtx_send_options *opts,
                             wtx_send_result *result);
/* One element patch of a tensor, made by the caller (vLLM's
 * SparseWeightPatch): count flat indices into the tensor, strictly
 * increasing (so none twice), and count values of its dtype, any bits
 * (NaN included). Read only during the call. */
typedef struct wtx_patch {
  const char *name;
  int dtype;             /* the tensor's wtx_dtype, and its values' */
  const uint64_t *shape; /* the whole tensor's, ndim entries */
  size_t ndim;
  int index_dtype;       /* WTX_DTYPE_INT32 (below 2^31 elements) or WTX_DTYPE_INT64 */
  uint64_t count;
  const void *indices;   /* count of index_dtype, little-endian */
  const void *values;    /* count of dtype */
} wtx_patch;

/* One delta sync of the caller's patches instead of the source's tensors
 * (docs/data-plane.md, "Delta updates"): each replica applies them to a
 * copy of the version it serves, which must be the one this trainer last
 * saw there (its last sync's, or for a new trainer the one it serves
 * now); what they do not name carries over. Every replica publishes or
 * none does. Refusals, before any byte moves: a patch that does not check
 * (WTX_EINVAL naming the tensor: a bound, an index repeated or out of
 * order, a dtype), one larger than a buffer (WTX_ETOOBIG), a replica that
 * serves nothing or another version (WTX_ESTATE, naming both; send the
 * whole model), a replica that takes whole tensors only (WTX_ENOTSUP).
 * With rank 0 sending, other ranks call nothing. n 0: nothing is sent.
 * To tensor-parallel workers (a trainer with a source) each worker gets
 * the elements that fall in its parts. With many senders every rank calls
 * it and rank 0 sends them all (the others' calls send nothing), over the
 * sessions a sync of every rank made (none standing: WTX_ESTATE); the
 * ranks' next delta after them sends every piece whole.
 * opts and result may be NULL; result's bytes are the patches'. */
int wtx_trainer_send_patches(wtx_trainer *t, const wtx_patch *patches, size_t n,
                             const wtx_send_options *opts, wtx_send_result *result);
/* Compares every replica's published checksums with those of the last sync
 * t sent (a sync with checksums; for tensor-parallel workers, each one's
 * parts): 0 when all match, WTX_ECHECKSUM naming the first difference,
 * WTX_ESTATE when t has sent no such sync. */
int wtx_trainer_verify(wtx_trainer *t);
/* The last failure's message, owned by t, valid until the next call on t. */
const char *wtx_trainer_last_error(const wtx_trainer *t);
/* Releases the backend and frees t (the workers keep their weights). */
void wtx_trainer_shutdown(wtx_trainer *t);

#ifdef __cplusplus
}
#endif
#endif /* WTX_CLIENT_H */
