/* wtx data plane: the interface every transport backend implements.
 *
 * Weight bytes never travel in gRPC messages. The trainer's half of a backend
 * moves a chunk's bytes out of band; the worker's half receives them and
 * feeds them, in stream order, to a wtx_rx assembler that cuts the stream
 * into tensors, checksums them and writes them where the model wants them.
 *
 * A backend is a `const` struct of function pointers registered by name on
 * each side (wtx_worker_transport_register / wtx_trainer_transport_register);
 * a duplicate name is WTX_EEXIST. Adding a backend takes exactly:
 *  - one file here (transport/<name>.c) with its worker and trainer halves;
 *  - one registration line per half in registry.c (register_builtin and
 *    wtx_builtin_backends);
 *  - one member in InitInfo.backend and one in UpdateInfo.backend
 *    (proto/wtx/v1), for what only this backend sends. The parameters every
 *    backend shares (packing, checksum, timeout_ms) are InitInfo's own
 *    fields and reach the backend resolved, as wtx_wire_params.
 *
 * The stream of an update: the tensors of the update, in the order the
 * trainer sends them, concatenated without padding; a chunk is a contiguous
 * piece of it described by one UpdateInfo (docs/data-plane.md). */
#ifndef WTX_TRANSPORT_TRANSPORT_H
#define WTX_TRANSPORT_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "common/stop.h"
#include "transport/netallow.h"
#include "transport/plan.h"
#include "wtx/error.h"
#include "wtx/limits.h"
#include "wtx/v1/weight_transfer.pb-c.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Wire parameters of a session: InitInfo's shared fields, resolved
 * (defaults applied, limits of wtx/limits.h checked). */
typedef struct wtx_wire_params {
  int packed;
  uint64_t buffer_size;  /* bytes, WTX_MIN_BUFFER_SIZE .. WTX_MAX_BUFFER_SIZE */
  uint32_t num_buffers;  /* 1 .. WTX_MAX_BUFFERS */
  int checksum;          /* WTX__V1__CHECKSUM_ALGORITHM__* (never UNSPECIFIED) */
  uint32_t timeout_ms;
} wtx_wire_params;

/* Resolves and checks init's shared wire parameters; an UNSPECIFIED checksum
 * becomes default_checksum (the backend's). On error writes a message naming
 * the field and the limit into err. */
int wtx_wire_params_from_init(const Wtx__V1__InitInfo *init,
                              int default_checksum, wtx_wire_params *out,
                              char *err, size_t errlen);

/* Sets init's shared fields from wire; init->packing points to *pk, which
 * must outlive init. The backend member is left alone. */
void wtx_wire_params_to_init(const wtx_wire_params *wire,
                             Wtx__V1__PackingParams *pk,
                             Wtx__V1__InitInfo *init);

/* The name of the InitInfo.backend member numbered init_case ("tcp", ...,
 * from the schema's descriptor), or NULL when there is none. Static. */
const char *wtx_init_case_name(int init_case);
/* The same for UpdateInfo.backend. */
const char *wtx_update_case_name(int update_case);

/* ---- worker side: receiving ---- */

/* Assembler for one chunk: owned by the session, lent to the backend's
 * receive for one call. */
typedef struct wtx_rx wtx_rx;

/* Appends the next len bytes of the chunk. Copies them to the tensors' dst
 * and hashes them on the way. WTX_EPROTO when the chunk would overrun.
 * Pieces of 64 KiB and more go with non-temporal stores (dst's lines are
 * neither read first nor kept in cache) and are hashed from data right
 * after their copy, from cache, instead of from dst: data is read twice
 * within the call, so the checksum covers what dst got unless data is
 * changed and changed back meanwhile. */
int wtx_rx_bytes(wtx_rx *rx, const uint8_t *data, size_t len);
/* Where the next bytes go, so a backend can write them in place (a copy
 * from the GPU straight into model memory, transport/gpu_out.c): *dst and
 * the bytes left in that tensor, or 0 when the chunk is complete. Follow
 * with wtx_rx_commit. */
size_t wtx_rx_next(wtx_rx *rx, uint8_t **dst);
/* Marks len bytes written in place at the pointer wtx_rx_next gave. */
int wtx_rx_commit(wtx_rx *rx, size_t len);
/* Whether wtx_rx_next gives device memory: the model stages this update on
 * the backend's GPU (wtx_worker_transport.device, wtx_model_ops.
 * stage_device). The backend then copies with the CUDA runtime and commits
 * with wtx_rx_commit_device; wtx_rx_bytes and wtx_rx_commit, which would
 * touch the memory from the CPU, are refused (WTX_EPROTO). */
int wtx_rx_on_device(const wtx_rx *rx);
/* Whether this chunk's checksums are checked. */
int wtx_rx_verifying(const wtx_rx *rx);
/* The chunk's offset in the update's stream (the bytes of the chunks
 * before it). */
uint64_t wtx_rx_stream_offset(const wtx_rx *rx);
/* wtx_rx_commit for device memory: len bytes are written, or copies that
 * write them are queued and complete before receive returns, at the
 * pointer wtx_rx_next gave. host: a host copy of the same len bytes, which
 * is hashed when verifying (NULL when not). */
int wtx_rx_commit_device(wtx_rx *rx, size_t len, const uint8_t *host);
/* Bytes this chunk still expects (UpdateInfo.chunk_bytes at the start). */
uint64_t wtx_rx_remaining(const wtx_rx *rx);
/* For a backend that carries the chunk's checksums itself, after its
 * bytes (tcp's trailer): the sender's XXH3-64 of each tensor ending in the
 * chunk, in order, copied; they take the place of UpdateInfo.xxh3_64 and
 * are checked when the chunk ends. */
int wtx_rx_checksums(wtx_rx *rx, const uint64_t *xxh3, size_t n);
/* For a backend whose chunks come from several senders (tcp's many
 * senders): this chunk's checksums are one per tensor it touches, of that
 * tensor's bytes within the chunk, as each sender hashes only what it
 * sends. Before the chunk's first byte (else WTX_EPROTO). The whole
 * XXH3 of each tensor the chunk completes is then read back from its host
 * staging for the model (none for device staging). */
int wtx_rx_span_checksums(wtx_rx *rx);
/* For a backend whose chunks land in a receive region of region_bytes
 * (at their offset in the stream, at): 0 when this chunk's bytes lie
 * within it, else WTX_EINVAL with the error recorded (who: the backend). */
int wtx_rx_in_region(wtx_rx *rx, uint64_t at, uint64_t region_bytes, const char *who);
/* Records a detail message for the error the backend is about to return. */
void wtx_rx_errorf(wtx_rx *rx, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* What the worker's policy gives its backends (wtx_worker_options); it
 * outlives every engine. */
typedef struct wtx_worker_env {
  /* Where a backend may connect (--allow-upstream); NULL: anywhere. */
  const wtx__netallow *allow_upstream;
  /* The port a tcp relay listens on for the next worker (--relay-port);
   * 0: one the system picks. */
  int relay_port;
  /* The CUDA device the GPU backends receive on (an ordinal, checked by
   * wtx__cuda_device); NULL: WTX_CUDA_DEVICE, else 0. */
  const char *cuda_device;
  /* --max-model-bytes (0: none): a receive region asked for beyond it is
   * declined. */
  uint64_t max_model_bytes;
  /* 1: the model reads host tensors where they land
   * (wtx_model_ops.adopt_chunk), so a receive region in host memory saves
   * a copy per byte; 0: it stages, and a region would add one. */
  int host_adopt;
} wtx_worker_env;

/* The worker half of a backend. `self` is the backend's state, created by
 * init and freed by destroy. */
typedef struct wtx_worker_transport {
  const char *name;
  /* The InitInfo.backend member it serves (WTX__V1__INIT_INFO__BACKEND_*),
   * the UpdateInfo.backend member its chunks carry
   * (WTX__V1__UPDATE_INFO__BACKEND_*; the session refuses any other), and
   * the checksum an UNSPECIFIED one means (WTX__V1__CHECKSUM_ALGORITHM__*). */
  int init_case;
  int update_case;
  int default_checksum;
  /* Whether updates may target the draft model. */
  int supports_draft;
  /* Checks the handshake and allocates self. Fast: no network, no wait
   * (the session holds its lock). */
  int (*init)(const Wtx__V1__InitInfo *init, const wtx_wire_params *wire,
              const wtx_worker_env *env, void **self, char *err, size_t errlen);
  /* Optional: the handshake's blocking part (connect to a peer, join a
   * collective), run outside the session lock and bounded by timeout_ms;
   * cancel ends it. data_address (may stay empty) receives the endpoint the
   * trainer needs, e.g. "127.0.0.1:40001". */
  int (*connect)(void *self, char *data_address, size_t addrlen, char *err,
                 size_t errlen);
  /* Receives the bytes of one chunk into rx. Returns once the chunk is
   * complete, or with an error (detail via wtx_rx_errorf). The whole chunk
   * is bounded by timeout_ms, however slowly its bytes come. */
  int (*receive)(void *self, const Wtx__V1__UpdateInfo *info, wtx_rx *rx);
  /* Optional, and safe from any thread: makes a connect or receive running
   * now return at once (WTX_ECANCELED), e.g. by an eventfd its waits poll,
   * shutdown(2), or ncclCommAbort. Abort, drain and SIGTERM call it. The
   * reset that follows the abort makes self usable again (or marks it
   * broken). */
  void (*cancel)(void *self);
  /* Optional: the update was aborted (by the trainer, a failed check, the
   * watchdog). A stream-based backend drops its connections so its peers
   * see the failure at once instead of waiting out their timeout. */
  void (*reset)(void *self);
  /* Frees self. */
  void (*destroy)(void *self);
  /* Optional (GPU backends): the CUDA device chunks arrive on. When the
   * model can stage there (wtx_model_ops.stage_device), every tensor of
   * the session's updates is staged in device memory and receive fills it
   * device to device (wtx_rx_on_device). */
  int (*device)(void *self);
  /* Optional (direct receive, cuda_ipc; many senders on one host, shm):
   * the memory the trainer writes updates into, *bytes long, owned by
   * self: on the GPU device returns, or on the host when it returns -1 (or
   * is NULL); 0, or WTX_ENOENT when this session has none. A model that
   * adopts that memory (wtx_model_ops.adopt_device, adopt_chunk) is then
   * given each tensor in place there, at its offset in the update's
   * stream, and receive copies nothing for it (a copy whose source and
   * destination coincide is skipped; on the host its bytes are hashed in
   * place). */
  int (*region)(void *self, uint8_t **base, uint64_t *bytes);
  /* Optional (GPU backends): box (UpdateInfo.box) of a tensor, its bytes
   * packed row-major at src (host memory, received and verified there),
   * into the tensor's device staging at dst, a row-major tensor holding
   * box whole, es bytes an element; returns once they are there (bounded
   * by the timeout). A session staging on a GPU takes boxes through it. */
  int (*put_box)(void *self, void *dst, const wtx_box *whole, const void *src,
                 const wtx_box *box, size_t es, char *err, size_t errlen);
} wtx_worker_transport;

int wtx_worker_transport_register(const wtx_worker_transport *t);
const wtx_worker_transport *wtx_worker_transport_find(const char *name);
/* Comma-separated registered names into buf ("shm, tcp, nccl, cuda_ipc"). */
void wtx_worker_transport_names(char *buf, size_t len);

/* ---- chunks: how an update's stream is cut, the same on both sides ---- */

/* One chunk of the stream: tensors first..last (inclusive) of the update's
 * order, starting first_offset bytes into tensors[first], bytes long, at
 * stream_offset bytes into the update's stream. */
typedef struct wtx_chunk {
  size_t first, last;
  uint64_t first_offset;
  uint64_t bytes;
  uint64_t stream_offset;
} wtx_chunk;

/* Cuts tensors of the given sizes into chunks of at most buffer_size bytes
 * and max_params tensors (1..WTX_MAX_CHUNK_PARAMS; a tensor cut across
 * chunks counts in each). packed: tensors follow each other within a chunk;
 * a tensor that does not fit continues in the next chunk. Not packed: every
 * tensor starts a chunk of its own (split when larger than a buffer). A
 * zero-byte tensor rides in the chunk where it falls (or a chunk of its
 * own, 0 bytes, when it is alone). *out (free()) and *n_out.
 * Deterministic: the layout of docs/data-plane.md. */
int wtx_chunks_plan(const uint64_t *nbytes, size_t n, uint64_t buffer_size,
                    size_t max_params, int packed, wtx_chunk **out, size_t *n_out);
/* The same, keeping each tensor i with whole[i] set (whole may be NULL:
 * none) within one chunk: one that does not fit the room a packed chunk
 * has left begins the next chunk. Such a tensor must be at most
 * buffer_size bytes (else WTX_EINVAL): a delta's patches, which the worker
 * applies whole in the chunk that carries them. */
int wtx_chunks_plan_whole(const uint64_t *nbytes, const uint8_t *whole, size_t n,
                          uint64_t buffer_size, size_t max_params, int packed, wtx_chunk **out,
                          size_t *n_out);

/* ---- trainer side: sending ---- */

/* The trainer half of a backend, for one session with n_workers workers.
 * The engine (client/engine.c) drives it:
 *   create -> init_info(i) for every worker, in order (data addresses of the
 *   workers answered so far are given: a chain links them) -> connect ->
 *   per chunk: buffer(k) is packed (or, with post_iov, the chunk's pieces are
 *   named in place), prepare(k) fills the backend part of the
 *   chunk's UpdateInfo before the UpdateWeights calls start, post(k) starts
 *   moving the bytes after they started, complete(k) waits for them -> destroy.
 * Buffers k are 0..num_buffers-1, reused round robin; the engine never
 * packs a buffer whose previous chunk has not completed. connect, post and
 * complete may be NULL (nothing to do: shm). */
/* What the engine gives a trainer half at create. */
typedef struct wtx_trainer_args {
  wtx_wire_params wire;
  size_t n_workers;
  /* Where a backend whose workers connect to the trainer listens
   * ("host:port"; tcp); NULL: 127.0.0.1:0. */
  const char *data_address;
  /* wtx_trainer_config.direct, and the bytes of an update's stream (the
   * source's tensors) for a backend that then asks the workers for a
   * receive region that large (cuda_ipc). */
  int direct;
  uint64_t stream_bytes;
} wtx_trainer_args;

/* For a backend that hashes while it sends (hashes_in_stream): where the
 * chunk's tensors end and where their checksums go. ends: the chunk-relative
 * byte offset at which each tensor whose last byte is in the chunk ends,
 * ascending (equal for zero-byte tensors), n of them. out: n values, the
 * XXH3-64 (seed 0) of each of those tensors, written by the time complete
 * returns 0. A tensor that began in an earlier chunk is hashed from its first
 * byte: the backend carries the state from chunk to chunk (and starts afresh
 * at a chunk whose first_offset is 0). */
typedef struct wtx_chunk_sums {
  const uint64_t *ends;
  size_t n;
  uint64_t *out;
} wtx_chunk_sums;

typedef struct wtx_trainer_transport {
  const char *name;
  /* As in wtx_worker_transport: the members of InitInfo.backend and
   * UpdateInfo.backend it fills, and what an UNSPECIFIED checksum means. */
  int init_case;
  int update_case;
  int default_checksum;
  /* What the trainer asks for when its config leaves buffer_size or
   * num_buffers at 0; 0 here: the protocol's defaults (WTX_DEFAULT_*). The
   * buffer is this much per worker, up to WTX_DEFAULT_BUFFER_SIZE: every
   * chunk costs a call to each worker, so chunks grow with the workers. The
   * trainer sends the values, so workers need not know them. */
  uint64_t default_buffer_per_worker;
  uint32_t default_num_buffers;
  /* 1: the workers' init and the trainer's connect form one collective
   * (NCCL): every init call is started, then connect runs, then the calls
   * are awaited. 0: workers are initialized one after the other. */
  int collective_init;
  /* 1: with checksums on, the backend hashes each piece as it sends it
   * (tcp: right after) and carries the checksums itself, after the bytes (tcp's
   * trailer), so the source is read once: the engine leaves
   * UpdateInfo.xxh3_64 empty and hands post_iov a wtx_chunk_sums. */
  int hashes_in_stream;
  int (*create)(const wtx_trainer_args *args, void **self, char *err,
                size_t errlen);
  /* Sets the backend member of worker i's InitInfo (out->backend_case and
   * the member, whose storage self owns; the engine has set the shared
   * fields). prev holds the data_address each worker 0..i-1 answered. */
  int (*init_info)(void *self, size_t i, const char *const *prev,
                   Wtx__V1__InitInfo *out);
  /* Every worker answered init (data_address of each): make connections. */
  int (*connect)(void *self, const char *const *addresses, char *err,
                 size_t errlen);
  uint8_t *(*buffer)(void *self, uint32_t k);
  /* Makes buffer k's chunk readable by the workers (a GPU backend copies it
   * to the device and waits until it is there) and sets the backend member
   * of its UpdateInfo (ui->backend_case and the member, storage owned by
   * self). On failure err says why. */
  int (*prepare)(void *self, uint32_t k, const wtx_chunk *c,
                 Wtx__V1__UpdateInfo *ui, char *err, size_t errlen);
  int (*post)(void *self, uint32_t k, const wtx_chunk *c);
  /* Optional, in place of post: starts sending chunk k as the n pieces of
   * iov in order (the chunk's bytes; none empty), each in the source's
   * memory where the source says its tensor stays put (wtx_source_ops.next
   * returned 2), else in buffer k. iov and the bytes it names stay valid and
   * unchanged until complete(k) returns. One copy per byte fewer on the
   * trainer for tensors that stay put. sums: NULL unless hashes_in_stream
   * and checksums are on; it and what it points to stay valid until
   * complete(k) returns. */
  int (*post_iov)(void *self, uint32_t k, const wtx_chunk *c, const struct iovec *iov,
                  size_t n, const wtx_chunk_sums *sums);
  /* Optional (GPU backends): bytes [offset, +len) of buffer k's next chunk
   * are at src in device memory, not in buffer k: prepare(k) copies them
   * device to device. Ranges come in offset order; src stays valid until
   * prepare(k) returns. The engine hands device tensors over this way
   * instead of copying them to the host and back. */
  int (*put_device)(void *self, uint32_t k, uint64_t offset, const void *src, uint64_t len);
  /* Waits until chunk k has left (bounded by the timeout). stop (may be
   * NULL) is polled meanwhile: 1 means the wait is pointless (a worker
   * refused the chunk and will never take its part), and complete then
   * ends at once with WTX_ECANCELED. */
  int (*complete)(void *self, uint32_t k, const wtx_stop *stop, char *err, size_t errlen);
  void (*destroy)(void *self);
  /* Optional: 1 when chunks go straight into the workers' memory (args.
   * direct took effect at connect), 0 when through buffers. */
  int (*direct)(void *self);
} wtx_trainer_transport;

int wtx_trainer_transport_register(const wtx_trainer_transport *t);
const wtx_trainer_transport *wtx_trainer_transport_find(const char *name);
void wtx_trainer_transport_names(char *buf, size_t len);

/* Built-in backends (registered by wtx_transports_register_builtin). */
extern const wtx_worker_transport wtx_shm_worker_transport;
extern const wtx_trainer_transport wtx_shm_trainer_transport;
extern const wtx_worker_transport wtx_tcp_worker_transport;
extern const wtx_trainer_transport wtx_tcp_trainer_transport;
extern const wtx_worker_transport wtx_nccl_worker_transport;
extern const wtx_trainer_transport wtx_nccl_trainer_transport;
extern const wtx_worker_transport wtx_cuda_ipc_worker_transport;
extern const wtx_trainer_transport wtx_cuda_ipc_trainer_transport;

/* Registers every built-in backend on both sides; idempotent. A test double
 * registers under a name of its own (wrapping a built-in's functions) and is
 * chosen by that name: wtx_trainer_config.backend on the trainer,
 * wtx_worker_options.backends on the worker. */
void wtx_transports_register_builtin(void);

/* The backends a worker serves when its options name none, in order. */
extern const char *const wtx_builtin_backends[];
extern const size_t wtx_n_builtin_backends;

#ifdef __cplusplus
}
#endif
#endif /* WTX_TRANSPORT_TRANSPORT_H */
