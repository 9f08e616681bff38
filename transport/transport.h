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
  /* Frees self. */
  void (*destroy)(void *self);
} wtx_worker_transport;

int wtx_worker_transport_register(const wtx_worker_transport *t);
const wtx_worker_transport *wtx_worker_transport_find(const char *name);
/* Comma-separated registered names into buf ("cuda_ipc, nccl, shm, tcp"). */
void wtx_worker_transport_names(char *buf, size_t len);

/* Built-in backends (registered by wtx_transports_register_builtin). */
extern const wtx_worker_transport wtx_shm_worker_transport;

/* Registers every built-in backend on both sides; idempotent. */
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
