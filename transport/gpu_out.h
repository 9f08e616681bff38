/* The worker half of a GPU backend (cuda_ipc, nccl) copies each chunk out
 * of device memory, where it arrived, into the model's staging: one routine
 * for both, internal to transport/.
 *
 *  - Host staging (wtx_model_ops.stage): device to host, one copy per
 *    tensor piece; tensors under WTX__GPU_SMALL bytes go through a pinned
 *    bounce buffer a piece of the chunk at a time (a cudaMemcpy has a fixed
 *    cost that dwarfs a small tensor's bytes).
 *  - Device staging (stage_device, wtx_rx_on_device): device to device,
 *    queued on the backend's stream, one copy per tensor piece; with
 *    checksums on, the chunk also comes to the bounce buffer a piece at a
 *    time and is hashed on the CPU. No byte crosses to the host otherwise.
 *    A piece already where it is staged (a model that adopted the direct
 *    receive region) is not copied at all. */
#ifndef WTX_TRANSPORT_GPU_OUT_H
#define WTX_TRANSPORT_GPU_OUT_H

#include "cuda/cuda.h"
#include "transport/plan.h"
#include "transport/transport.h"

#define WTX__GPU_SMALL ((size_t)64 << 10)
#define WTX__GPU_BOUNCE ((size_t)4 << 20)

typedef struct wtx__gpu_out {
  const wtx_cuda *cuda;
  uint32_t timeout_ms; /* bound of the wait for device staging's copies */
  void *stream;        /* device staging's copies */
  uint8_t *bounce;     /* pinned, WTX__GPU_BOUNCE bytes, allocated on first need */
} wtx__gpu_out;

/* Creates the stream on the current device (the worker's). A CUDA error
 * code on failure, with nothing held. */
int wtx__gpu_out_open(wtx__gpu_out *g, const wtx_cuda *c, uint32_t timeout_ms);
/* Frees what open and copy allocated; the current device is the worker's. */
void wtx__gpu_out_close(wtx__gpu_out *g);
/* Copies the rest of rx's chunk from src (device memory on the current
 * device, the worker's) into the staging rx names, host or device. Returns
 * once every byte is there (device staging: every queued copy has landed,
 * even on failure, so the model may free its staging and the sender reuse
 * src at once). That wait is bounded by timeout_ms but not ended by cancel:
 * the copies are the GPU's own, local and short, and returning before they
 * land would let them write memory the model has freed. who names the
 * backend in error messages. */
int wtx__gpu_out_copy(wtx__gpu_out *g, const uint8_t *src, const char *who, wtx_rx *rx);
/* wtx_worker_transport.put_box on device (the worker's, made current
 * meanwhile): one host-to-device copy per run of box (packed at src) into
 * dst, queued on the stream; returns once every one has landed, bounded by
 * timeout_ms as copy's are. WTX_EIO naming the CUDA error (who: the
 * backend). */
int wtx__gpu_out_box(wtx__gpu_out *g, int device, void *dst, const wtx_box *whole,
                     const void *src, const wtx_box *box, size_t es, const char *who, char *err,
                     size_t errlen);

/* A direct session's receive region (wtx_worker_transport.region), the
 * same for both GPU backends: device memory the size of the trainer's
 * update stream, where each chunk lands at its stream offset. */
typedef struct wtx__gpu_region {
  uint8_t *base;  /* NULL: none (not asked for, or declined) */
  uint64_t bytes; /* asked for at init (0: not asked for) */
  uint64_t max;   /* --max-model-bytes (0: no limit) */
} wtx__gpu_region;

/* Allocates r->bytes on the current device (the worker's) when asked for;
 * over r->max or without room on the GPU it declines: base stays NULL,
 * logged as event=direct_declined for backend who. */
void wtx__gpu_region_open(wtx__gpu_region *r, const wtx_cuda *c, const char *who);
/* Frees the region on the current device; why (may be NULL): it is
 * declined for that reason, logged as open does. */
void wtx__gpu_region_drop(wtx__gpu_region *r, const wtx_cuda *c, const char *who,
                          const char *why);
/* Where [at, +n) of the update's stream lies in the region; NULL when
 * there is no region or the range is outside it. */
uint8_t *wtx__gpu_region_at(const wtx__gpu_region *r, uint64_t at, uint64_t n);
/* wtx_worker_transport.region: 0 with *base and *bytes, or WTX_ENOENT. */
int wtx__gpu_region_get(const wtx__gpu_region *r, uint8_t **base, uint64_t *bytes);

#endif /* WTX_TRANSPORT_GPU_OUT_H */
