/* wtx push --on-gpu (see on_gpu.h). */
#include "client/on_gpu.h"

#include <stdio.h>
#include <stdlib.h>

#include "cuda/cuda.h"

struct wtx__on_gpu {
  const wtx_cuda *cuda;
  int device;
  void **dev; /* n device copies */
  size_t n;
};

void wtx__on_gpu_free(wtx__on_gpu *g) {
  if (g == NULL) return;
  int prev;
  if (g->cuda != NULL) wtx__cuda_enter(g->cuda, g->device, &prev);
  for (size_t i = 0; i < g->n; i++)
    if (g->dev[i] != NULL) g->cuda->Free(g->dev[i]);
  if (g->cuda != NULL) wtx__cuda_leave(g->cuda, prev);
  free(g->dev);
  free(g);
}

/* Tensor i (m, its host bytes at data) into device memory. */
static int upload(wtx__on_gpu *g, size_t i, const wtx_tensor_meta *m, const uint8_t *data,
                  char *err, size_t errlen) {
  int e = g->cuda->Malloc(&g->dev[i], m->nbytes ? (size_t)m->nbytes : 1);
  if (e != WTX_CUDA_SUCCESS) g->dev[i] = NULL;
  else if (m->nbytes > 0) e = g->cuda->Memcpy(g->dev[i], data, (size_t)m->nbytes, WTX_CUDA_H2D);
  if (e == WTX_CUDA_SUCCESS) return 0;
  snprintf(err, errlen, "copying '%s' to device %d: %s", m->name, g->device,
           g->cuda->GetErrorString(e));
  return WTX_EUNAVAIL;
}

/* Copies every tensor of host's pass into device memory, filling ts. The
 * current device is g's. */
static int copy_all(wtx__on_gpu *g, wtx_source *host, const wtx_tensor_meta *metas,
                    wtx_memory_tensor *ts, char *err, size_t errlen) {
  void *it = NULL;
  int rc = wtx_source_open(host, &it);
  for (size_t i = 0; rc == 0 && i < g->n; i++) {
    wtx_tensor_meta m;
    const uint8_t *data;
    int r = wtx_source_next(host, it, &m, &data);
    if (r != 1) {
      rc = r < 0 ? r : WTX_EINVAL;
      break;
    }
    rc = upload(g, i, &m, data, err, errlen);
    ts[i] = (wtx_memory_tensor){metas[i].name, metas[i].dtype, metas[i].shape,
                                metas[i].ndim, g->dev[i], 1};
  }
  if (it != NULL) wtx_source_close(host, it);
  /* A copy from pageable memory may return before it lands. */
  if (rc == 0 && g->cuda->StreamSynchronize(NULL) != WTX_CUDA_SUCCESS) rc = WTX_EIO;
  return rc;
}

int wtx__on_gpu_copy(wtx_source *host, wtx_source **out, wtx__on_gpu **held, char *err,
                     size_t errlen) {
  *out = NULL;
  *held = NULL;
  const wtx_tensor_meta *metas;
  size_t n;
  int rc = wtx_source_metadata(host, &metas, &n);
  if (rc != 0) return rc;
  wtx__on_gpu *g = calloc(1, sizeof *g);
  wtx_memory_tensor *ts = calloc(n ? n : 1, sizeof *ts);
  if (g == NULL || ts == NULL || (g->dev = calloc(n ? n : 1, sizeof *g->dev)) == NULL) {
    free(ts);
    free(g);
    return WTX_ENOMEM;
  }
  g->n = n;
  rc = wtx__cuda_device(NULL, &g->device, err, errlen);
  if (rc == 0) rc = wtx__cuda_load(0, &g->cuda, err, errlen);
  if (rc == 0) {
    int prev;
    wtx__cuda_enter(g->cuda, g->device, &prev);
    rc = copy_all(g, host, metas, ts, err, errlen);
    if (rc == 0) rc = wtx_source_memory(ts, n, out, err, errlen);
    wtx__cuda_leave(g->cuda, prev);
  }
  free(ts);
  if (rc != 0) {
    wtx__on_gpu_free(g);
    return rc;
  }
  *held = g;
  return 0;
}
