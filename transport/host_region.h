/* A worker's receive region in host memory, shared with the trainer
 * ranks on its host (tcp's many senders with TcpInitInfo.shm_region_bytes,
 * the backend shm with world > 1): a POSIX shared-memory object the worker
 * makes, each sender maps, and the worker unlinks once every sender has
 * it, so no third process can. Each sender writes its chunks' bytes there
 * at their offsets in the worker's stream, and only their frames and
 * trailers go on its socket; a model that adopts host memory
 * (wtx_model_ops.adopt_chunk) reads them in place: one copy per byte, the
 * sender's. Both sides map it once, at init, so no sync after the first
 * faults its pages in again.
 *
 * Also the shared-memory objects both this and the ring (ring.h) are made
 * of: "/wtx-..." objects of this user, mode 0600, which the opening side
 * checks before it maps one. Internal to transport/. */
#ifndef WTX_TRANSPORT_HOST_REGION_H
#define WTX_TRANSPORT_HOST_REGION_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "transport/transport.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A new object "/wtx-<kind>-..." of len bytes (zeroed), its name into name
 * (nlen >= 64) and an open descriptor into *fd (the caller closes it).
 * WTX_EIO with err naming the object and the system's reason. */
int wtx__shm_object_make(const char *kind, size_t len, char *name, size_t nlen, int *fd,
                         char *err, size_t errlen);
/* Opens the object named, which must be a "/wtx-" object of this user:
 * *fd (the caller closes it) and its size. WTX_EIO (no such object: errno
 * says why) or WTX_EPERM (not one of ours). */
int wtx__shm_object_open(const char *name, int *fd, uint64_t *size);

typedef struct wtx__host_region wtx__host_region;

/* Worker: a region of bytes (>= 1), named; WTX_EUNAVAIL naming why when
 * there is no room (over max_bytes, 0: no limit; more than shared memory
 * holds). */
int wtx__host_region_make(uint64_t bytes, uint64_t max_bytes, wtx__host_region **out,
                          char *err, size_t errlen);
/* Its name, for a sender (until unlink: "" after). */
const char *wtx__host_region_name(const wtx__host_region *r);
/* Worker: every sender has it (or init failed): the name goes. */
void wtx__host_region_unlink(wtx__host_region *r);
/* wtx_worker_transport.region. */
int wtx__host_region_get(const wtx__host_region *r, uint8_t **base, uint64_t *bytes);
/* Worker: the chunk rx expects, from [at, +wtx_rx_remaining) of the
 * region, into staging: where staging is the region itself (the model
 * adopted it) the bytes are only hashed in place, else copied (and hashed
 * on the way). */
int wtx__host_region_out(wtx__host_region *r, uint64_t at, wtx_rx *rx);

/* Sender: the region named, which must be bytes long. */
int wtx__host_region_open(const char *name, uint64_t bytes, wtx__host_region **out, char *err,
                          size_t errlen);
/* Sender: the n pieces of iov into the region from *at on, which advances
 * past them. WTX_EINVAL (*why says so) when they would end past it;
 * WTX_EIO when shared memory has no room left for a page of it (the copy's
 * SIGBUS caught: transport/sigbus.h). */
int wtx__host_region_put(wtx__host_region *r, uint64_t *at, const struct iovec *iov, size_t n,
                         const char **why);

/* Unmaps it (and unlinks the name, when still there). NULL: no-op. */
void wtx__host_region_free(wtx__host_region *r);

#ifdef __cplusplus
}
#endif
#endif /* WTX_TRANSPORT_HOST_REGION_H */
