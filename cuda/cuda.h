/* The CUDA runtime and NCCL, loaded at run time (dlopen), so the same
 * binaries run on machines without them: the GPU backends then report
 * themselves unavailable with a clear message instead of failing to start.
 *
 * Only the calls the nccl and cuda_ipc backends use, with ABI-compatible
 * declarations (no CUDA headers needed to build). The libraries come from
 * WTX_CUDART_LIB / WTX_NCCL_LIB when set (a path), else the system's
 * libcudart.so.13, .so.12, .so and libnccl.so.2. Tests point both at the
 * test double cuda/testing/fake_cuda.c. Internal to transport/. */
#ifndef WTX_CUDA_CUDA_H
#define WTX_CUDA_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "common/stop.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct { char bytes[64]; } wtx_cuda_ipc_handle;  /* cudaIpcMemHandle_t */
typedef struct { char internal[128]; } wtx_nccl_id;       /* ncclUniqueId */

/* ncclConfig_t as NCCL 2.14 defined it. NCCL versions its config by size
 * and version and fills what a smaller one lacks with defaults, so every
 * NCCL since 2.14 (2.28 on this machine, older ones in torch wheels)
 * accepts this prefix. */
typedef struct wtx_nccl_config {
  size_t size;
  unsigned int magic;   /* 0xcafebeef */
  unsigned int version; /* 21400 */
  int blocking;
  int cgaClusterSize;
  int minCTAs;
  int maxCTAs;
  const char *netName;
} wtx_nccl_config;

/* A worker's init that failed on its device: a device this machine lacks
 * is the worker's configuration (WTX_ESTATE: FAILED_PRECONDITION, which
 * no client retries), anything else may pass (WTX_EUNAVAIL). */
#define WTX_CUDA_INIT_FAILED(e) ((e) == WTX_CUDA_INVALID_DEVICE ? WTX_ESTATE : WTX_EUNAVAIL)

enum {
  WTX_CUDA_SUCCESS = 0,
  WTX_CUDA_INVALID_DEVICE = 101,  /* cudaErrorInvalidDevice */
  WTX_CUDA_NOT_READY = 600,       /* cudaErrorNotReady */
  WTX_CUDA_H2D = 1,               /* cudaMemcpyHostToDevice */
  WTX_CUDA_D2H = 2,               /* cudaMemcpyDeviceToHost */
  WTX_CUDA_D2D = 3,               /* cudaMemcpyDeviceToDevice */
  WTX_CUDA_IPC_LAZY_PEER = 1,     /* cudaIpcMemLazyEnablePeerAccess */
  WTX_NCCL_SUCCESS = 0,
  WTX_NCCL_IN_PROGRESS = 7,
  WTX_NCCL_UINT8 = 1,
  WTX_NCCL_CONFIG_MAGIC = 0xcafebeef,
  WTX_NCCL_CONFIG_VERSION = 21400, /* NCCL_VERSION(2, 14, 0) */
};

typedef struct wtx_cuda {
  /* CUDA runtime */
  int (*SetDevice)(int device);
  int (*GetDevice)(int *device);
  int (*GetDeviceProperties)(void *prop, int device); /* cudaDeviceProp */
  int (*Malloc)(void **ptr, size_t size);
  int (*Free)(void *ptr);
  int (*MallocHost)(void **ptr, size_t size); /* pinned */
  int (*FreeHost)(void *ptr);
  int (*Memcpy)(void *dst, const void *src, size_t n, int kind);
  int (*MemcpyAsync)(void *dst, const void *src, size_t n, int kind, void *stream);
  int (*StreamCreate)(void **stream);
  int (*StreamDestroy)(void *stream);
  int (*StreamQuery)(void *stream);
  int (*StreamSynchronize)(void *stream);
  int (*IpcGetMemHandle)(wtx_cuda_ipc_handle *h, void *ptr);
  int (*IpcOpenMemHandle)(void **ptr, wtx_cuda_ipc_handle h, unsigned flags);
  int (*IpcCloseMemHandle)(void *ptr);
  const char *(*GetErrorString)(int err);
  /* NCCL (NULL members when only the runtime was asked for) */
  int (*GetUniqueId)(wtx_nccl_id *id);
  int (*CommInitRankConfig)(void **comm, int nranks, wtx_nccl_id id, int rank,
                            wtx_nccl_config *config);
  int (*Broadcast)(const void *send, void *recv, size_t count, int dtype,
                   int root, void *comm, void *stream);
  /* Point to point (ncclSend / ncclRecv): on stream, matched in order per
   * pair of ranks; many trainer ranks to many workers. */
  int (*Send)(const void *send, size_t count, int dtype, int peer, void *comm, void *stream);
  int (*Recv)(void *recv, size_t count, int dtype, int peer, void *comm, void *stream);
  int (*CommGetAsyncError)(void *comm, int *err);
  int (*CommAbort)(void *comm);
  int (*CommDestroy)(void *comm);
  const char *(*NcclErrorString)(int err);
  const char *(*NcclLastError)(void *comm); /* ncclGetLastError */
} wtx_cuda;

/* The loaded API (process-wide, loaded once); with_nccl also loads NCCL.
 * On failure err says which library is missing and how to point at one. */
int wtx__cuda_load(int with_nccl, const wtx_cuda **out, char *err, size_t errlen);

/* The UUID (16 bytes) of a device. */
int wtx__cuda_uuid(const wtx_cuda *c, int device, uint8_t uuid[16]);

/* The device named by ordinal ("0", "3"), or when NULL by WTX_CUDA_DEVICE,
 * else 0, into *out. WTX_EINVAL, naming where it came from, when it is not
 * a number. */
int wtx__cuda_device(const char *ordinal, int *out, char *err, size_t errlen);

/* Makes device current on the calling thread and sets *prev to the one it
 * had, which wtx__cuda_leave restores: a trainer inside PyTorch keeps its
 * current device whatever wtx does. */
int wtx__cuda_enter(const wtx_cuda *c, int device, int *prev);
void wtx__cuda_leave(const wtx_cuda *c, int prev);

/* Waits for stream up to timeout_ms, watching comm (may be NULL) for an
 * asynchronous NCCL error and stop (may be NULL; WTX_ECANCELED once it
 * says so). On failure the caller must abort comm (ncclCommAbort is what
 * unblocks the stream) before using the device again. */
int wtx__cuda_wait(const wtx_cuda *c, void *stream, void *comm,
                   uint32_t timeout_ms, const wtx_stop *stop, char *err,
                   size_t errlen);

/* Joins NCCL communicator id as rank of nranks without blocking: a
 * non-blocking init (ncclCommInitRankConfig, blocking = 0) polled up to
 * timeout_ms while stop (may be NULL) says go on. On failure, timeout or
 * cancel the half-made communicator is aborted, *comm is NULL and err
 * holds NCCL's own detail (ncclGetLastError). The current device must be
 * the rank's. */
int wtx__nccl_join(const wtx_cuda *c, void **comm, int nranks, const wtx_nccl_id *id,
                   int rank, uint32_t timeout_ms, const wtx_stop *stop,
                   char *err, size_t errlen);
/* "<result's string>: <ncclGetLastError detail>" into buf; comm may be
 * NULL. */
const char *wtx__nccl_error(const wtx_cuda *c, void *comm, int result, char *buf,
                            size_t len);

/* A trainer half's transfer buffers: num pinned host buffers to pack into
 * and as many device buffers of size bytes on the trainer's device. */
typedef struct wtx__cuda_buffers {
  const wtx_cuda *cuda;
  uint32_t n;
  uint64_t size;
  uint8_t *host; /* pinned (cudaMallocHost): uploads are asynchronous */
  void **dev;
} wtx__cuda_buffers;

/* A range of a chunk whose bytes are in device memory (put_device). */
typedef struct wtx__cuda_piece {
  uint64_t offset, len;
  const void *src;
} wtx__cuda_piece;

/* The ranges of one buffer's chunk that come from device memory, in
 * offset order, until the next upload. */
typedef struct wtx__cuda_pieces {
  wtx__cuda_piece *p;
  size_t n, cap;
} wtx__cuda_pieces;

/* What every GPU trainer half holds: the API, its device, its stream and
 * its transfer buffers. */
typedef struct wtx__cuda_trainer {
  const wtx_cuda *cuda;
  int device;
  void *stream;
  uint32_t timeout_ms; /* bound of every wait on the stream */
  wtx__cuda_buffers bufs;
  wtx__cuda_pieces *pieces; /* per buffer */
} wtx__cuda_trainer;

/* Loads the API (and NCCL when with_nccl), selects WTX_CUDA_DEVICE (the
 * caller's current device is restored before returning), creates a stream
 * and num buffers of size bytes. On failure err reads "<who>: device N:
 * <why>", nothing is held, and the code is WTX_EUNAVAIL (or the loader's). */
int wtx__cuda_trainer_open(wtx__cuda_trainer *t, const char *who, int with_nccl,
                           uint32_t num, uint64_t size, uint32_t timeout_ms,
                           char *err, size_t errlen);
void wtx__cuda_trainer_close(wtx__cuda_trainer *t);
/* Host buffer k. */
uint8_t *wtx__cuda_trainer_host(wtx__cuda_trainer *t, uint32_t k);
/* Says that bytes [offset, +len) of buffer k's next chunk are at src in
 * device memory (any device: copies go by unified addressing), not in host
 * buffer k; ranges come in offset order. src stays valid until the upload
 * returns. WTX_ENOMEM. */
int wtx__cuda_trainer_put_device(wtx__cuda_trainer *t, uint32_t k, uint64_t offset,
                                 const void *src, uint64_t len);
/* Copies the chunk of bytes into device buffer k: the ranges put_device
 * named device to device, the rest from host buffer k; then waits until
 * every byte is there (bounded by timeout_ms): the chunk may be announced
 * once this returns. A plain cudaMemcpy from pageable memory may return
 * before the bytes land, and another process would read stale ones. */
int wtx__cuda_trainer_upload(wtx__cuda_trainer *t, uint32_t k, uint64_t bytes, char *err,
                             size_t errlen);
/* The same chunk copied into each of n_dsts device destinations instead
 * of device buffer k (a direct receive writes it into every worker's
 * region), then waited for. */
int wtx__cuda_trainer_upload_to(wtx__cuda_trainer *t, uint32_t k, void *const *dsts,
                                size_t n_dsts, uint64_t bytes, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* WTX_CUDA_CUDA_H */
