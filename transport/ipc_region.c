/* A worker's receive region shared by CUDA IPC (ipc_region.h). */
#include "transport/ipc_region.h"

#include <endian.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda.h"
#include "transport/gpu_out.h"

struct wtx__ipc_region {
  const wtx_cuda *cuda;
  int device, opened; /* opened: a sender's mapping of another's memory */
  uint8_t *base;
  uint64_t bytes;
  uint32_t timeout_ms;
  wtx_cuda_ipc_handle handle;
  uint8_t uuid[16];
  wtx__gpu_out out;  /* the worker's copies out */
  void *stream;      /* the sender's copies in */
};

/* The API and the device, entered; a region to fill in. */
static int start(const char *cuda_device, uint32_t timeout_ms, wtx__ipc_region **out, int *prev,
                 char *err, size_t errlen) {
  int device;
  const wtx_cuda *c;
  int rc = wtx__cuda_device(cuda_device, &device, err, errlen);
  if (rc == 0) rc = wtx__cuda_load(0, &c, err, errlen);
  if (rc != 0) return rc;
  wtx__ipc_region *r = calloc(1, sizeof *r);
  if (r == NULL) return WTX_ENOMEM;
  r->cuda = c;
  r->device = device;
  r->timeout_ms = timeout_ms;
  wtx__cuda_enter(c, device, prev);
  *out = r;
  return 0;
}

int wtx__ipc_region_make(const char *cuda_device, uint64_t bytes, uint64_t max_bytes,
                         uint32_t timeout_ms, wtx__ipc_region **out, char *err, size_t errlen) {
  int prev;
  wtx__ipc_region *r = NULL;
  int rc = start(cuda_device, timeout_ms, &r, &prev, err, errlen);
  if (rc != 0) return rc;
  const wtx_cuda *c = r->cuda;
  int e = max_bytes > 0 && bytes > max_bytes ? -1 : c->Malloc((void **)&r->base, (size_t)bytes);
  if (e == WTX_CUDA_SUCCESS) e = c->IpcGetMemHandle(&r->handle, r->base);
  if (e == WTX_CUDA_SUCCESS) e = wtx__cuda_uuid(c, r->device, r->uuid) == 0 ? 0 : -2;
  if (e == WTX_CUDA_SUCCESS) e = wtx__gpu_out_open(&r->out, c, timeout_ms);
  wtx__cuda_leave(c, prev);
  r->bytes = bytes;
  if (e != WTX_CUDA_SUCCESS) {
    snprintf(err, errlen, "init_info.tcp.cuda_region_bytes: no receive region of %llu bytes "
             "on device %d: %s", (unsigned long long)bytes, r->device,
             e == -1 ? "over --max-model-bytes" : e == -2 ? "no device UUID"
                     : c->GetErrorString(e));
    wtx__ipc_region_free(r);
    return WTX_EUNAVAIL;
  }
  *out = r;
  return 0;
}

void wtx__ipc_region_record(const wtx__ipc_region *r, uint8_t *rec) {
  memcpy(rec, &r->handle, 64);
  memcpy(rec + 64, r->uuid, 16);
  uint64_t le = htole64(r->bytes);
  memcpy(rec + 80, &le, 8);
}

int wtx__ipc_region_device(const wtx__ipc_region *r) { return r->device; }

int wtx__ipc_region_get(const wtx__ipc_region *r, uint8_t **base, uint64_t *bytes) {
  *base = r->base;
  *bytes = r->bytes;
  return 0;
}

int wtx__ipc_region_out(wtx__ipc_region *r, uint64_t at, wtx_rx *rx) {
  int rc = wtx_rx_in_region(rx, at, r->bytes, "tcp");
  if (rc != 0) return rc;
  int prev;
  wtx__cuda_enter(r->cuda, r->device, &prev);
  rc = wtx__gpu_out_copy(&r->out, r->base + at, "tcp", rx);
  wtx__cuda_leave(r->cuda, prev);
  return rc;
}

int wtx__ipc_region_box(wtx__ipc_region *r, void *dst, const wtx_box *whole, const void *src,
                        const wtx_box *box, size_t es, char *err, size_t errlen) {
  return wtx__gpu_out_box(&r->out, r->device, dst, whole, src, box, es, "tcp", err, errlen);
}

int wtx__ipc_region_open(const uint8_t *rec, uint32_t timeout_ms, wtx__ipc_region **out,
                         char *err, size_t errlen) {
  int prev;
  wtx__ipc_region *r = NULL;
  int rc = start(NULL, timeout_ms, &r, &prev, err, errlen);
  if (rc != 0) return rc;
  const wtx_cuda *c = r->cuda;
  memcpy(&r->handle, rec, 64);
  memcpy(r->uuid, rec + 64, 16);
  uint64_t le;
  memcpy(&le, rec + 80, 8);
  r->bytes = le64toh(le);
  r->opened = 1;
  int e = c->IpcOpenMemHandle((void **)&r->base, r->handle, WTX_CUDA_IPC_LAZY_PEER);
  if (e == WTX_CUDA_SUCCESS) e = c->StreamCreate(&r->stream);
  wtx__cuda_leave(c, prev);
  if (e != WTX_CUDA_SUCCESS) {
    snprintf(err, errlen, "cuda_ipc: cannot open a worker's receive region on device %d (is "
             "it on this node?): %s", r->device, c->GetErrorString(e));
    wtx__ipc_region_free(r);
    return WTX_EUNAVAIL;
  }
  *out = r;
  return 0;
}

int wtx__ipc_region_put(wtx__ipc_region *r, uint64_t at, const struct iovec *iov, size_t n,
                        char *err, size_t errlen) {
  const wtx_cuda *c = r->cuda;
  uint64_t end = at;
  for (size_t i = 0; i < n; i++) end += iov[i].iov_len;
  if (end > r->bytes || end < at) {
    snprintf(err, errlen, "cuda_ipc: a chunk ending at byte %llu of a %llu-byte region",
             (unsigned long long)end, (unsigned long long)r->bytes);
    return WTX_EINVAL;
  }
  int prev;
  wtx__cuda_enter(c, r->device, &prev);
  int e = WTX_CUDA_SUCCESS;
  for (size_t i = 0; e == WTX_CUDA_SUCCESS && i < n; at += iov[i].iov_len, i++)
    e = c->MemcpyAsync(r->base + at, iov[i].iov_base, iov[i].iov_len, WTX_CUDA_H2D, r->stream);
  /* Landed before the frame says so: pageable copies may return early. */
  int rc = e == WTX_CUDA_SUCCESS
               ? wtx__cuda_wait(c, r->stream, NULL, r->timeout_ms, NULL, err, errlen)
               : WTX_EIO;
  wtx__cuda_leave(c, prev);
  if (e != WTX_CUDA_SUCCESS)
    snprintf(err, errlen, "cuda_ipc: copy into a worker's region: %s", c->GetErrorString(e));
  return rc;
}

void wtx__ipc_region_free(wtx__ipc_region *r) {
  if (r == NULL) return;
  const wtx_cuda *c = r->cuda;
  int prev;
  wtx__cuda_enter(c, r->device, &prev);
  if (r->base != NULL) (r->opened ? c->IpcCloseMemHandle(r->base) : c->Free(r->base));
  if (r->stream != NULL) c->StreamDestroy(r->stream);
  wtx__gpu_out_close(&r->out);
  wtx__cuda_leave(c, prev);
  free(r);
}
