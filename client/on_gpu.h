/* wtx push --on-gpu: the source's tensors copied to the trainer's GPU
 * (WTX_CUDA_DEVICE) before the sync, as a training job's parameters live
 * there, so the GPU backends are measured moving device tensors device to
 * device (the GPU bench's comparison with a device-to-device copy). CLI
 * only. */
#ifndef WTX_CLIENT_ON_GPU_H
#define WTX_CLIENT_ON_GPU_H

#include <stddef.h>

#include "wtx/source.h"

typedef struct wtx__on_gpu wtx__on_gpu;

/* A memory source (*out, the caller's) over device copies of host's
 * tensors, which *held owns (free with wtx__on_gpu_free after destroying
 * *out); host stays the caller's. On error err says why (no CUDA runtime,
 * no device memory) and nothing is held. */
int wtx__on_gpu_copy(wtx_source *host, wtx_source **out, wtx__on_gpu **held, char *err,
                     size_t errlen);
/* Frees the device copies (NULL: no-op). */
void wtx__on_gpu_free(wtx__on_gpu *g);

#endif /* WTX_CLIENT_ON_GPU_H */
