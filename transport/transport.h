/* wtx data plane: the interface every transport backend implements.
 *
 * Weight bytes never travel in gRPC messages. The trainer's half of a backend
 * moves a chunk's bytes out of band; the worker's half receives them and
 * feeds them, in stream order, to a wtx_rx assembler that cuts the stream
 * into tensors, checksums them and writes them where the model wants them.
 *
 * A backend is a `const` struct of function pointers registered by name on
 * each side (wtx_worker_transport_register / wtx_trainer_transport_register);
 * a duplicate name is WTX_EEXIST. Adding a backend touches its own file and
 * one registration line in registry.c.
 *
 * The stream of an update: the tensors of the update, in the order the
 * trainer sends them, concatenated without padding; a chunk is a contiguous
 * piece of it described by one UpdateInfo (docs/data-plane.md). */
#ifndef WTX_TRANSPORT_TRANSPORT_H
#define WTX_TRANSPORT_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>

#include "common/error.h"
#include "wtx/v1/weight_transfer.pb-c.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Wire parameters of a session, resolved from the handshake (defaults
 * applied, limits checked by wtx_wire_params_from_init). */
typedef struct wtx_wire_params {
  int packed;
  uint64_t buffer_size;  /* bytes, 1024 .. 2^40 */
  uint32_t num_buffers;  /* 1 .. 64 */
  int checksum;          /* WTX__V1__CHECKSUM_ALGORITHM__* (never UNSPECIFIED) */
  uint32_t timeout_ms;
} wtx_wire_params;

#define WTX_DEFAULT_BUFFER_SIZE (UINT64_C(64) << 20)
#define WTX_DEFAULT_NUM_BUFFERS 2
#define WTX_DEFAULT_TIMEOUT_MS 300000

/* The backend name of init ("tcp", "shm", "nccl", "cuda_ipc"), or NULL when
 * its oneof is unset. Static string. */
const char *wtx_init_backend_name(const Wtx__V1__InitInfo *init);

/* Resolves and checks the wire parameters of init. On error writes a message
 * naming the field and the limit into err. */
int wtx_wire_params_from_init(const Wtx__V1__InitInfo *init,
                              wtx_wire_params *out, char *err, size_t errlen);

/* The PackingParams message for wire (for a trainer half's handshake). */
void wtx_wire_params_packing(const wtx_wire_params *wire,
                             Wtx__V1__PackingParams *out);

/* ---- worker side: receiving ---- */

/* Where one tensor of the update goes. The session fills it from the
 * validated ParamMeta; dst is the model's staging memory (host). */
typedef struct wtx_rx_tensor {
  const char *name;
  uint64_t nbytes;
  uint8_t *dst;
} wtx_rx_tensor;

/* Assembler for one chunk: owned by the session, lent to the backend's
 * receive for one call. */
typedef struct wtx_rx wtx_rx;

/* Appends the next len bytes of the chunk. Copies them to the tensors' dst
 * and hashes them on the way. WTX_EPROTO when the chunk would overrun. */
int wtx_rx_bytes(wtx_rx *rx, const uint8_t *data, size_t len);
/* Where the next bytes go, so a backend can receive in place (a socket read
 * straight into model memory): *dst and the bytes left in that tensor, or 0
 * when the chunk is complete. Follow with wtx_rx_commit. */
size_t wtx_rx_next(wtx_rx *rx, uint8_t **dst);
/* Marks len bytes written in place at the pointer wtx_rx_next gave. */
int wtx_rx_commit(wtx_rx *rx, size_t len);
/* Bytes this chunk still expects (UpdateInfo.chunk_bytes at the start). */
uint64_t wtx_rx_remaining(const wtx_rx *rx);
/* Records a detail message for the error the backend is about to return. */
void wtx_rx_errorf(wtx_rx *rx, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* The worker half of a backend. `self` is the backend's state, created by
 * init and freed by destroy. */
typedef struct wtx_worker_transport {
  const char *name;
  /* Whether updates may target the draft model. */
  int supports_draft;
  /* Sets up from the handshake. data_address (may stay empty) receives the
   * endpoint the trainer needs, e.g. "127.0.0.1:40001". */
  int (*init)(const Wtx__V1__InitInfo *init, const wtx_wire_params *wire,
              void **self, char *data_address, size_t addrlen, char *err,
              size_t errlen);
  /* Receives the bytes of one chunk into rx. Returns once the chunk is
   * complete, or with an error (detail via wtx_rx_errorf). */
  int (*receive)(void *self, const Wtx__V1__UpdateInfo *info, wtx_rx *rx);
  /* Optional: the update was aborted (by the trainer, a failed check, the
   * watchdog). A stream-based backend drops its connections so its peers
   * see the failure at once instead of waiting out their timeout. */
  void (*reset)(void *self);
  /* Frees self. */
  void (*destroy)(void *self);
} wtx_worker_transport;

int wtx_worker_transport_register(const wtx_worker_transport *t);
const wtx_worker_transport *wtx_worker_transport_find(const char *name);
/* Comma-separated registered names into buf ("cuda_ipc, nccl, shm, tcp"). */
void wtx_worker_transport_names(char *buf, size_t len);

/* ---- chunks: how an update's stream is cut, the same on both sides ---- */

/* One chunk of the stream: tensors first..last (inclusive) of the update's
 * order, starting first_offset bytes into tensors[first], bytes long. */
typedef struct wtx_chunk {
  size_t first, last;
  uint64_t first_offset;
  uint64_t bytes;
} wtx_chunk;

/* Cuts tensors of the given sizes into chunks of at most buffer_size bytes.
 * packed: tensors follow each other within a chunk; a tensor that does not
 * fit continues in the next chunk. Not packed: every tensor starts a chunk
 * of its own (split when larger than a buffer). A zero-byte tensor rides in
 * the chunk where it falls (or a chunk of its own, 0 bytes, when it is
 * alone). *out (free()) and *n_out. Deterministic: the layout of
 * docs/data-plane.md. */
int wtx_chunks_plan(const uint64_t *nbytes, size_t n, uint64_t buffer_size,
                    int packed, wtx_chunk **out, size_t *n_out);

/* ---- trainer side: sending ---- */

/* The trainer half of a backend, for one session with n_workers workers.
 * The engine (client/engine.c) drives it:
 *   create -> init_info(i) for every worker, in order (data addresses of the
 *   workers answered so far are given: a chain links them) -> connect ->
 *   per chunk: buffer(k) is packed, prepare(k) fills the backend part of the
 *   chunk's UpdateInfo before the UpdateWeights calls start, post(k) starts
 *   moving the bytes after they started, complete(k) waits for them -> destroy.
 * Buffers k are 0..num_buffers-1, reused round robin; the engine never
 * packs a buffer whose previous chunk has not completed. connect, post and
 * complete may be NULL (nothing to do: shm). */
typedef struct wtx_trainer_transport {
  const char *name;
  int backend_case; /* WTX__V1__INIT_INFO__BACKEND_* it serves */
  /* 1: the workers' init and the trainer's connect form one collective
   * (NCCL): every init call is started, then connect runs, then the calls
   * are awaited. 0: workers are initialized one after the other. */
  int collective_init;
  int (*create)(const Wtx__V1__InitInfo *tmpl, const wtx_wire_params *wire,
                size_t n_workers, void **self, char *err, size_t errlen);
  /* The InitInfo for worker i (storage owned by self). prev holds the
   * data_address each worker 0..i-1 answered. */
  int (*init_info)(void *self, size_t i, const char *const *prev,
                   const Wtx__V1__InitInfo **out);
  /* Every worker answered init (data_address of each): make connections. */
  int (*connect)(void *self, const char *const *addresses, char *err,
                 size_t errlen);
  uint8_t *(*buffer)(void *self, uint32_t k);
  int (*prepare)(void *self, uint32_t k, const wtx_chunk *c,
                 Wtx__V1__UpdateInfo *ui);
  int (*post)(void *self, uint32_t k, const wtx_chunk *c);
  int (*complete)(void *self, uint32_t k, char *err, size_t errlen);
  void (*destroy)(void *self);
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

/* Registers every built-in backend on both sides; idempotent. A backend
 * registered earlier under a built-in's name keeps its place (tests put a
 * double there before the first worker or trainer starts). */
void wtx_transports_register_builtin(void);

/* ---- internal: used by the session ---- */

/* A chunk's tensors, in stream order; first_offset is where the chunk starts
 * within tensors[0]. The tensors' dst must stay valid until the chunk ends. */
int wtx__rx_create(wtx_rx **out);
void wtx__rx_destroy(wtx_rx *rx);
/* Starts a chunk of chunk_bytes (0: to the end of the last tensor), which
 * must end inside or at the end of tensors[n-1]. verify: whether checksums
 * are expected and checked. A
 * non-zero first_offset must continue the tensor the previous chunk left
 * incomplete, at the byte it stopped (else WTX_EPROTO); a zero one requires
 * that no tensor was left incomplete. */
int wtx__rx_begin(wtx_rx *rx, const wtx_rx_tensor *tensors, size_t n,
                  uint64_t first_offset, uint64_t chunk_bytes, int verify);
/* The sender's checksums of the tensors that end in this chunk, in order
 * (after begin; borrowed until end). */
int wtx__rx_expect_checksums(wtx_rx *rx, const uint64_t *xxh3, size_t n);
/* Forgets any tensor left incomplete (abort, new update). */
void wtx__rx_reset(wtx_rx *rx);
/* Whether a tensor is left incomplete, and which. */
const char *wtx__rx_incomplete(const wtx_rx *rx, uint64_t *have,
                               uint64_t *want);
/* Ends the chunk: checks every expected byte arrived and every checksum
 * matched (WTX_ECHECKSUM names the tensor). */
int wtx__rx_end(wtx_rx *rx);
/* Detail of the last error (empty when none). */
const char *wtx__rx_error(const wtx_rx *rx);
/* Tensors completed (all bytes in) by this chunk so far. */
size_t wtx__rx_completed(const wtx_rx *rx);
/* Checksum of a completed tensor: index into the chunk's tensors. */
uint64_t wtx__rx_checksum(const wtx_rx *rx, size_t i);

#ifdef __cplusplus
}
#endif
#endif /* WTX_TRANSPORT_TRANSPORT_H */
