/* wtx worker: the worker-side WeightTransfer service, embeddable.
 *
 * A wtx_worker hosts one WorkerEngine session (the state machine of
 * wtx.v1.WeightTransfer) over a gRPC server, plus gRPC health and server
 * reflection. Weights land in a model: the embedded in-memory parameter store
 * by default, or the host's own model through wtx_model_ops.
 *
 * Guarantees (each refusal is a precise gRPC status naming the problem):
 *  - init creates the backend engine named by InitInfo's oneof; refused while
 *    an update is active; unknown backends list the registered ones;
 *  - start opens one update at a time; update before start, finish before
 *    start are FAILED_PRECONDITION;
 *  - every chunk's metadata is validated before any byte moves;
 *  - a failed or aborted update leaves the published weights untouched, and
 *    a new update can start;
 *  - an update idle longer than the watchdog timeout is aborted. */
#ifndef WTX_WORKER_H
#define WTX_WORKER_H

#include <stddef.h>
#include <stdint.h>

#include "wtx/error.h"
#include "wtx/limits.h"
#include "wtx/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the model the worker loads into ---- */

/* The wtx_model_ops layout of this header: 2, every member below; 1,
 * every member before adopt_chunk. */
#define WTX_MODEL_OPS_VERSION 2u


/* A model sink, like vLLM's model.load_weights. All calls come from one
 * update at a time, one call at a time (never concurrently), so a model
 * needs no lock of its own between them. Returning an error from any of
 * them aborts the update. Per chunk (one UpdateWeights call), the session
 * calls check for each of the chunk's tensors, then stage (stage_device,
 * adopt_device) for those that begin in it, then loaded for those that
 * completed, in the chunk's order and each time with the same meta, which
 * stays valid and unchanged until the chunk's last call: a model may
 * recognise a tensor it checked by its meta's address within a chunk
 * (never across chunks: a later chunk may reuse the address). */
typedef struct wtx_model_ops {
  /* WTX_MODEL_OPS_VERSION as the model was built (0 is refused): the
   * library reads only the members that version has, so it may grow the
   * struct at its end and keep models built before (SQLite's iVersion). */
  unsigned version;
  /* Optional: checks a tensor of an update against the model's layout before
   * any byte moves; WTX_ENOENT (unknown name) or WTX_EINVAL (dtype, shape)
   * with a message in err. NULL accepts every tensor. */
  int (*check)(void *model, wtx_target target, const wtx_tensor_meta *meta, char *err,
               size_t errlen);
  /* An update for target begins. */
  int (*begin)(void *model, wtx_target target);
  /* Returns host memory of meta->nbytes where the tensor's bytes are
   * received, owned by the model until commit or abort. */
  int (*stage)(void *model, const wtx_tensor_meta *meta, uint8_t **dst);
  /* The tensor staged at dst is complete and verified. xxh3 points to the
   * XXH3-64 of its bytes when the session checks checksums, else NULL (no
   * hash was computed). */
  int (*loaded)(void *model, const wtx_tensor_meta *meta, const uint64_t *xxh3);
  /* Optional: everything commit needs that can fail (checks, memory),
   * done now, labelled version; after it succeeds commit must not fail.
   * NULL: commit does it all (and a failing commit may then leave replicas
   * on different versions). */
  int (*prepare)(void *model, const char *version, char *err, size_t errlen);
  /* Makes every loaded tensor visible at once, labelled version (the
   * prepared one, after prepare). */
  int (*commit)(void *model, const char *version);
  /* Discards everything staged since begin. */
  void (*abort)(void *model);
  /* Optional, in place of stage for a model that lives on a GPU: returns
   * device memory of meta->nbytes on CUDA device `device` (the ordinal the
   * session's GPU backend uses: wtx_worker_options.cuda_device) where the
   * tensor's bytes are received, owned by the model until commit or abort.
   * Called only while the session's backend is cuda_ipc or nccl; the bytes
   * then go device to device and never cross to the host, except a copy
   * hashed on the CPU when checksums are on (docs/data-plane.md). NULL:
   * stage (host memory) for every backend. */
  int (*stage_device)(void *model, const wtx_tensor_meta *meta, int device, void **dst);
  /* Optional, in place of staging, for a model that lives on a GPU: when
   * the bytes land straight in the worker's receive region (cuda_ipc or
   * nccl with wtx_trainer_config.direct), the tensor is received at src,
   * device memory on CUDA device `device` that the worker owns: its bytes
   * are there, verified, once loaded is called for it, and stay until
   * commit or abort returns. The model reads them (never writes) and must
   * have copied what it keeps by the time commit returns. One copy per
   * byte in all: the trainer's (cuda_ipc) or the broadcast (nccl). NULL:
   * stage_device or stage. */
  int (*adopt_device)(void *model, const wtx_tensor_meta *meta, int device,
                      const void *src);
  /* Optional, each in place of its per-tensor op, for a model behind a binding
   * whose every call is costly (Python's ctypes, called from the worker's
   * threads, three calls per tensor): one call per chunk, over the same
   * tensors, metas and order as the per-tensor op would see, metas[0..n) valid
   * until the chunk's last call. check_chunk: checks metas[0..n); on failure
   * *bad is the index of the first refused and err says why. stage_chunk: host
   * memory for each of metas[0..n) into dst[0..n), as stage (used only where
   * stage would be: host staging). loaded_chunk: metas[0..n) are complete and
   * verified; xxh3: their n checksums, or NULL when none were computed. NULL:
   * the per-tensor op. */
  int (*check_chunk)(void *model, wtx_target target, const wtx_tensor_meta *metas, size_t n,
                     size_t *bad, char *err, size_t errlen);
  int (*stage_chunk)(void *model, const wtx_tensor_meta *metas, size_t n, uint8_t **dst);
  int (*loaded_chunk)(void *model, const wtx_tensor_meta *metas, size_t n,
                      const uint64_t *xxh3);
  /* Optional, in place of check and check_chunk for a chunk whose tensors
   * are named by position (UpdateInfo.layout, every RL step after the
   * first): metas[0..n) are positions [first, first + n) of the session's
   * table `table`, the tensors of an update it published, in order. A
   * table's id is never reused in the process and its metas never change
   * (metas itself is valid as check_chunk's), so a model whose own layout
   * has not changed either may remember which positions it found the same
   * and check each tensor once per table, not once per update (40k compares
   * a step at MoE scale). As check_chunk otherwise: 0, or an error with *bad
   * the index of the first tensor refused and err saying why. NULL:
   * check_chunk or check. */
  int (*check_range)(void *model, wtx_target target, uint64_t table, size_t first,
                     const wtx_tensor_meta *metas, size_t n, size_t *bad, char *err,
                     size_t errlen);
  /* Optional: undoes the last commit of target, which returns to the
   * version that commit replaced, bytes and label (none, when it was the
   * first), as if it had never happened. Called at most once per commit,
   * after it and before the next begin; a trainer calls for it when
   * another replica failed to publish the same update (AbortWeightUpdate
   * naming it). NULL: a published update cannot be undone here, and the
   * trainer is told so. */
  int (*revert)(void *model, wtx_target target, char *err, size_t errlen);
  /* Optional: copies the bytes target serves of meta's tensor (meta->nbytes,
   * its published version's) into dst, host memory the session owns.
   * Called during an update, between stage and loaded of that tensor, for
   * a delta's patch (wtx.v1.Patch): the session applies the patch to the
   * copy in the tensor's staging (device staging: in a host copy, which
   * the backend then copies there). WTX_ENOENT when the model serves no such
   * tensor. NULL: this worker takes no patches (whole tensors only), and
   * says so at each start (StartWeightUpdateResponse.patches). */
  int (*read)(void *model, wtx_target target, const wtx_tensor_meta *meta, uint8_t *dst,
              char *err, size_t errlen);
  /* Optional (version 2), in place of staging, for a model that reads its
   * tensors on the host where they land and keeps what it needs itself
   * (a loader that copies into its own parameters): when the bytes land
   * straight in the worker's receive region in host memory (shm with many
   * senders, TcpInitInfo.shm_region_bytes), the chunk's tensors
   * metas[0..n) are received at src[0..n), memory the worker owns. Their
   * bytes are there, verified, once loaded is called for them, and stay
   * until commit or abort returns; the model reads them (never writes)
   * and must have copied what it keeps by the time commit returns. One
   * copy per byte in all, the sender's, besides the model's own. Such a
   * session takes no patches (a patch applies to staging); a box chunk is
   * still staged (stage, stage_chunk). NULL: stage_chunk or stage. */
  int (*adopt_chunk)(void *model, const wtx_tensor_meta *metas, size_t n,
                     const uint8_t *const *src);
} wtx_model_ops;

/* ---- the embedded parameter store ---- */

typedef struct wtx_store wtx_store;

int wtx_store_create(wtx_store **out);
void wtx_store_destroy(wtx_store *s);
/* The store as a model: pass wtx_store_model_ops with the store pointer. */
extern const wtx_model_ops wtx_store_model_ops;
/* Declares the expected layout (e.g. from a safetensors header); later
 * updates must match it. Only before the first update (else WTX_ESTATE);
 * a name given twice is WTX_EINVAL. metas are copied. */
int wtx_store_declare(wtx_store *s, const wtx_tensor_meta *metas, size_t n);

/* A published tensor, valid until the next wtx_store_release. */
typedef struct wtx_store_param {
  wtx_tensor_meta meta;
  const uint8_t *data;
  uint64_t xxh3;  /* meaningful when has_xxh3 */
  int has_xxh3;   /* 1: xxh3 is the hash of data; 0: none was computed */
} wtx_store_param;

/* A consistent view of the published main (or draft) weights: the caller
 * holds it until wtx_store_release; publishing never frees memory a view
 * still refers to. */
typedef struct wtx_store_view {
  const char *version; /* "" before the first publish */
  uint64_t generation;
  const wtx_store_param *params;
  size_t n_params;
  uint64_t total_bytes;
  void *internal;
} wtx_store_view;

int wtx_store_acquire(wtx_store *s, wtx_target target, wtx_store_view *out);
void wtx_store_release(wtx_store *s, wtx_store_view *v);
/* Relabels the published main weights; *previous (may be NULL) receives a
 * malloc'd copy of the old label. */
int wtx_store_set_version(wtx_store *s, const char *version, char **previous);
/* Checks a chunk tensor against the declared/published layout: WTX_ENOENT
 * for an unknown name, WTX_EINVAL for a dtype or shape difference; detail in
 * err. No layout yet: accepts anything. */
int wtx_store_check(wtx_store *s, wtx_target target, const wtx_tensor_meta *meta,
                    char *err, size_t errlen);

/* ---- the worker ---- */

typedef struct wtx_worker wtx_worker;

/* Who may use server reflection (grpcurl list / describe). */
typedef enum wtx_reflection {
  WTX_REFLECTION_OPEN = 0,  /* anyone who reaches the port (the default) */
  WTX_REFLECTION_TOKEN = 1, /* the bearer token, as every other call */
  WTX_REFLECTION_OFF = 2,   /* not served */
} wtx_reflection;

typedef struct wtx_worker_options {
  /* "host:port" to listen on; port 0 picks one (wtx_worker_port). */
  const char *listen;
  /* The data-plane backends served, by registered name, one per
   * InitInfo.backend member (NULL: the built-ins shm, tcp, nccl,
   * cuda_ipc). A test double registers under its own name and is named
   * here. */
  const char *const *backends;
  size_t n_backends;
  /* The model; NULL uses an internal wtx_store (wtx_worker_store). */
  const wtx_model_ops *model_ops;
  void *model;
  /* Receiving ranks behind this endpoint (GetWorldSize); 0 means 1. */
  uint32_t world_size;
  /* An update with no call for this long is aborted; 0:
   * WTX_DEFAULT_WATCHDOG_MS. */
  int64_t watchdog_ms;
  /* Largest gRPC request, bytes; 0: WTX_DEFAULT_MAX_MESSAGE_BYTES. */
  int max_message_bytes;
  /* Host callbacks for Pause / Resume (may be NULL). */
  void (*on_pause)(void *host, int wait_for_inflight);
  void (*on_resume)(void *host);
  void *host;
  /* A safetensors file whose header declares the expected layout (names,
   * dtypes, shapes; the data is not read): updates must match it. NULL: the
   * first complete update defines the layout. Internal store only. */
  const char *model_spec;
  /* A directory where every published main version is written as
   * <version>.safetensors (atomically) plus a LATEST file naming it. NULL:
   * not published. Internal store only. */
  const char *publish_dir;
  /* Published files kept in publish_dir, newest first; 0:
   * WTX_DEFAULT_PUBLISH_KEEP. */
  int publish_keep;
  /* A file whose first line is the bearer token every call but health
   * (and open reflection) must carry; re-read when it changes. NULL: no
   * token. Copied. */
  const char *token_file;
  /* TLS: PEM contents of the server certificate and key (both or
   * neither); with tls_client_ca_pem also, only clients whose certificate
   * that CA signed are admitted (mTLS). NULL: plaintext. Copied. */
  const char *tls_cert_pem;
  const char *tls_key_pem;
  const char *tls_client_ca_pem;
  wtx_reflection reflection;
  /* Calls served at once; beyond it a call gets RESOURCE_EXHAUSTED. 0:
   * WTX_DEFAULT_MAX_CALLS. */
  int max_calls;
  /* Bytes and parameters one update may stage; beyond them the update is
   * aborted with RESOURCE_EXHAUSTED naming the limit. 0: no limit. */
  uint64_t max_model_bytes;
  uint64_t max_params;
  /* Where the worker may connect for the data plane (the tcp upstream): a
   * comma-separated list of networks ("10.0.0.0/8"), addresses and host
   * names (resolved at start). NULL or "": anywhere. Copied. */
  const char *allow_upstream;
  /* The sidecar bridge into a stock vLLM server (internal store only; NULL:
   * none): every published main version is written to vllm_dir as
   * <version>/model.safetensors and vLLM (served with
   * VLLM_SERVER_DEV_MODE=1) is told to load it: /pause?mode=
   * vllm_pause_mode ("abort", "wait" (NULL) or "keep"), /collective_rpc
   * reload_weights, /update_weight_version, /resume; with vllm_disk, newer
   * vLLM's "disk" backend through the RL routes instead. A failure is the
   * FinishWeightUpdate's status (the worker has published, vLLM did not
   * load). Pause / Resume are forwarded and answer whether vLLM is paused
   * (PauseResponse.paused); GetWeightInfo reports vLLM's version. Every
   * request is bounded by vllm_timeout_ms (0: 300000). Copied. */
  const char *vllm_url;
  const char *vllm_dir;
  const char *vllm_pause_mode;
  int vllm_disk;
  int64_t vllm_timeout_ms;
  /* "host:port" where GET /metrics answers in the Prometheus text format
   * (port 0 picks one: wtx_worker_metrics_port); NULL: no metrics. Keep it
   * off the trainers' network (docs/operations.md). Copied. */
  const char *metrics_listen;
  /* The port the tcp backend's relay listens on for the next worker of a
   * chain (a fixed port for firewalls and NetworkPolicies); 0: one the
   * system picks. */
  int relay_port;
  /* The CUDA device the GPU backends receive on, as its ordinal ("0",
   * "3"), for a process that knows its own (a vLLM rank); NULL:
   * WTX_CUDA_DEVICE from the environment, else "0". Copied. */
  const char *cuda_device;
  /* A tensor-parallel rank that holds only its parts of the model: the
   * text of a shard rule file, one rule a line, "PATTERN whole|skip|
   * expert E|dim D [unit U]" (docs/data-plane.md, "Sharded workers"), and
   * this rank's place, tp_rank of tp_size. Every update then sends it
   * exactly its parts (wtx.v1.ParamMeta.part) and it refuses any other
   * tensor; it stages and publishes those parts only, so its memory grows
   * with its share of the model. GetWeightInfo announces the rules, from
   * which a trainer plans. NULL: whole tensors. Not with model_spec or
   * vllm_url, which describe whole tensors. Copied. */
  const char *shard_rules;
  uint32_t tp_rank, tp_size;
} wtx_worker_options;

/* Every field at its default; set the ones you need after it. */
#define WTX_WORKER_OPTIONS_INIT WTX__INIT(.listen = NULL)

/* Creates and starts serving. opts and what it points to are copied, except
 * model/host, which must outlive the worker. */
int wtx_worker_start(const wtx_worker_options *opts, wtx_worker **out,
                     char *err, size_t errlen);
/* The bound port. */
int wtx_worker_port(const wtx_worker *w);
/* The metrics port (wtx_worker_options.metrics_listen), or 0 without. */
int wtx_worker_metrics_port(const wtx_worker *w);
/* The internal store (NULL when the host supplied its own model). */
wtx_store *wtx_worker_store(wtx_worker *w);
/* Aborts an update idle longer than the watchdog; returns 1 when it did.
 * The daemon calls it from a timer; embedders may too. */
int wtx_worker_watchdog(wtx_worker *w);
/* Health goes NOT_SERVING, the active update (if any) is aborted, the server
 * stops within grace_ms. Idempotent. */
void wtx_worker_drain(wtx_worker *w, int64_t grace_ms);
/* Drains if needed and frees w. */
void wtx_worker_destroy(wtx_worker *w);
/* The gRPC health status of every service: SERVING (1, from start) or
 * NOT_SERVING (0), for a host whose inference engine is not ready. Ignored
 * once draining (NOT_SERVING). */
void wtx_worker_set_serving(wtx_worker *w, int serving);
/* Whether generation is paused, as the last Pause or Resume answered
 * (with the vLLM bridge, vLLM's answer; see PauseResponse.paused). */
int wtx_worker_paused(const wtx_worker *w);

#ifdef __cplusplus
}
#endif
#endif /* WTX_WORKER_H */
