/* A worker's receive region on its GPU, shared by CUDA IPC with the
 * trainer ranks on its node (tcp's many senders with TcpInitInfo.
 * cuda_region_bytes, the backend cuda_ipc with world > 1): each sender
 * writes its chunks' bytes there at their offsets in the worker's stream,
 * and only their frames and trailers go on its socket. The worker copies
 * them out into staging, or a model that adopts device memory reads them
 * in place: one copy per byte. Internal to transport/. */
#ifndef WTX_TRANSPORT_IPC_REGION_H
#define WTX_TRANSPORT_IPC_REGION_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "transport/transport.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wtx__ipc_region wtx__ipc_region;

/* What a sender needs to open it: the IPC handle (64), the GPU's UUID
 * (16) and the region's size (8, little-endian), as one record. */
#define WTX__IPC_REGION_RECORD 88

/* Worker: bytes of memory on its device (cuda_device: an ordinal, or NULL
 * for WTX_CUDA_DEVICE), exported; WTX_EUNAVAIL naming why when there is
 * no CUDA, no such device or no room (over max_bytes, 0: no limit). */
int wtx__ipc_region_make(const char *cuda_device, uint64_t bytes, uint64_t max_bytes,
                         uint32_t timeout_ms, wtx__ipc_region **out, char *err, size_t errlen);
/* Its record for a sender (WTX__IPC_REGION_RECORD bytes). */
void wtx__ipc_region_record(const wtx__ipc_region *r, uint8_t *rec);
/* The device it lives on (wtx_worker_transport.device). */
int wtx__ipc_region_device(const wtx__ipc_region *r);
/* wtx_worker_transport.region. */
int wtx__ipc_region_get(const wtx__ipc_region *r, uint8_t **base, uint64_t *bytes);
/* The chunk rx expects, from [at, +wtx_rx_remaining) of the region, into
 * staging (a copy whose source is its destination is skipped). */
int wtx__ipc_region_out(wtx__ipc_region *r, uint64_t at, wtx_rx *rx);
/* wtx_worker_transport.put_box, on the region's device. */
int wtx__ipc_region_box(wtx__ipc_region *r, void *dst, const wtx_box *whole, const void *src,
                        const wtx_box *box, size_t es, char *err, size_t errlen);

/* Sender: the region a record names, opened on WTX_CUDA_DEVICE. */
int wtx__ipc_region_open(const uint8_t *rec, uint32_t timeout_ms, wtx__ipc_region **out,
                         char *err, size_t errlen);
/* Writes the n pieces of iov (host memory) at offset at, and returns once
 * they are there (bounded by the timeout). */
int wtx__ipc_region_put(wtx__ipc_region *r, uint64_t at, const struct iovec *iov, size_t n,
                        char *err, size_t errlen);

/* Frees the worker's region, or closes the sender's handle. */
void wtx__ipc_region_free(wtx__ipc_region *r);

#ifdef __cplusplus
}
#endif
#endif /* WTX_TRANSPORT_IPC_REGION_H */
