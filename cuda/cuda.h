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

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

typedef struct { char bytes[64]; } wtx_cuda_ipc_handle;  /* cudaIpcMemHandle_t */
typedef struct { char internal[128]; } wtx_nccl_id;       /* ncclUniqueId */

enum {
  WTX_CUDA_SUCCESS = 0,
  WTX_CUDA_NOT_READY = 600,       /* cudaErrorNotReady */
  WTX_CUDA_H2D = 1,               /* cudaMemcpyHostToDevice */
  WTX_CUDA_D2H = 2,               /* cudaMemcpyDeviceToHost */
  WTX_CUDA_IPC_LAZY_PEER = 1,     /* cudaIpcMemLazyEnablePeerAccess */
  WTX_NCCL_SUCCESS = 0,
  WTX_NCCL_IN_PROGRESS = 7,
  WTX_NCCL_UINT8 = 1,
};

typedef struct wtx_cuda {
  /* CUDA runtime */
  int (*SetDevice)(int device);
  int (*GetDeviceProperties)(void *prop, int device); /* cudaDeviceProp */
  int (*Malloc)(void **ptr, size_t size);
  int (*Free)(void *ptr);
  int (*Memcpy)(void *dst, const void *src, size_t n, int kind);
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
  int (*CommInitRank)(void **comm, int nranks, wtx_nccl_id id, int rank);
  int (*Broadcast)(const void *send, void *recv, size_t count, int dtype,
                   int root, void *comm, void *stream);
  int (*CommGetAsyncError)(void *comm, int *err);
  int (*CommAbort)(void *comm);
  int (*CommDestroy)(void *comm);
  const char *(*NcclErrorString)(int err);
} wtx_cuda;

/* The loaded API (process-wide, loaded once); with_nccl also loads NCCL.
 * On failure err says which library is missing and how to point at one. */
int wtx__cuda_load(int with_nccl, const wtx_cuda **out, char *err, size_t errlen);

/* The UUID (16 bytes) of a device. */
int wtx__cuda_uuid(const wtx_cuda *c, int device, uint8_t uuid[16]);

/* The device this process uses: WTX_CUDA_DEVICE, default 0. */
int wtx__cuda_device(void);

/* Waits for stream up to timeout_ms, watching comm (may be NULL) for an
 * asynchronous NCCL error and *cancelled (may be NULL; WTX_ECANCELED once
 * set). On failure the caller must abort comm (ncclCommAbort is what
 * unblocks the stream) before using the device again. */
int wtx__cuda_wait(const wtx_cuda *c, void *stream, void *comm,
                   uint32_t timeout_ms, const atomic_int *cancelled, char *err,
                   size_t errlen);

/* A trainer half's transfer buffers: num host buffers to pack into and as
 * many device buffers of size bytes on the current device. */
typedef struct wtx__cuda_buffers {
  const wtx_cuda *cuda;
  uint32_t n;
  uint64_t size;
  uint8_t *host;
  void **dev;
} wtx__cuda_buffers;

int wtx__cuda_buffers_create(const wtx_cuda *c, uint32_t n, uint64_t size,
                             wtx__cuda_buffers *b, char *err, size_t errlen);
void wtx__cuda_buffers_destroy(wtx__cuda_buffers *b);
/* Host buffer k. */
uint8_t *wtx__cuda_buffers_host(wtx__cuda_buffers *b, uint32_t k);
/* Copies bytes of host buffer k into device buffer k. */
int wtx__cuda_buffers_upload(wtx__cuda_buffers *b, uint32_t k, uint64_t bytes);

/* What every GPU trainer half holds: the API, its device, a stream (when
 * asked for) and its transfer buffers. */
typedef struct wtx__cuda_trainer {
  const wtx_cuda *cuda;
  int device;
  void *stream;
  wtx__cuda_buffers bufs;
} wtx__cuda_trainer;

/* Loads the API (and NCCL when with_nccl), selects WTX_CUDA_DEVICE, creates
 * a stream when with_stream, and num buffers of size bytes. On failure err
 * reads "<who>: device N: <why>", nothing is held, and the code is
 * WTX_EUNAVAIL (or the loader's). */
int wtx__cuda_trainer_open(wtx__cuda_trainer *t, const char *who, int with_nccl,
                           int with_stream, uint32_t num, uint64_t size,
                           char *err, size_t errlen);
void wtx__cuda_trainer_close(wtx__cuda_trainer *t);

#endif /* WTX_CUDA_CUDA_H */
