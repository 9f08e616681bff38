/* The worker half of a GPU backend (cuda_ipc, nccl) copies each chunk out
 * of device memory, where it arrived, into the model's staging: one routine
 * for both, internal to transport/.
 *
 *  - Host staging (wtx_model_ops.stage): device to host, one copy per
 *    tensor piece; tensors under WTX__GPU_SMALL bytes go through a pinned
 *    bounce buffer a piece of the chunk at a time (a cudaMemcpy costs about
 *    10 us whatever its size).
 *  - Device staging (stage_device, wtx_rx_on_device): device to device,
 *    queued on the backend's stream, one copy per tensor piece; with
 *    checksums on, the chunk also comes to the bounce buffer a piece at a
 *    time and is hashed on the CPU. No byte crosses to the host otherwise.
 *    A piece already where it is staged (a model that adopted the direct
 *    receive region) is not copied at all. */
#ifndef WTX_TRANSPORT_GPU_OUT_H
#define WTX_TRANSPORT_GPU_OUT_H

#include "cuda/cuda.h"
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

#endif /* WTX_TRANSPORT_GPU_OUT_H */
