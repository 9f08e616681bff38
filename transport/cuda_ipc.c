/* cuda_ipc: a trainer and workers on the same node share device buffers
 * (docs/data-plane.md, "cuda_ipc").
 *
 * Trainer half: num_buffers device buffers of buffer_size bytes on its GPU,
 * each exported once (cudaIpcGetMemHandle): one handle per buffer, never per
 * tensor. A chunk is packed into pinned host memory and copied into buffer
 * k (its device tensors device to device, put_device), and the copy is
 * waited for before the UpdateWeights calls start (a
 * worker reads the buffer from another process, with no ordering against
 * the trainer's stream). The calls carry, per (GPU, buffer), the handle,
 * the GPU's UUID and the bytes used. The buffer is not touched again until
 * every worker's call has returned, and a worker's call returns once its
 * copy out has completed. Every CUDA call runs on the backend's device and
 * leaves the caller's current device as it was.
 *
 * Worker half: picks the entry whose UUID is its own GPU's (cuda_device, or
 * WTX_CUDA_DEVICE, default 0), opens the handle (once per buffer and
 * session; closed when the session ends) and copies the chunk out into the
 * model's staging memory: device to device when the model stages on the
 * GPU (wtx_model_ops.stage_device), else device to host.
 *
 * Direct receive (wtx_trainer_config.direct; CudaIpcInitInfo.direct_bytes):
 * each worker allocates a receive region the size of the trainer's update
 * stream on its GPU and exports it once, at init; the trainer opens each
 * once and copies every chunk straight into every worker's region at the
 * chunk's stream offset (device tensors device to device, host ones from
 * pinned memory), waits, then announces it. A model that adopts device
 * memory (wtx_model_ops.adopt_device) reads its tensors there: one copy per
 * byte in all. Other models stage as above, copying out of the region. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda.h"
#include "transport/gpu_out.h"
#include "transport/transport.h"

/* What a worker answers as data_address for its receive region. */
#define DIRECT_PREFIX "cuda-ipc-direct:"

/* Bytes u as hex into out (2 digits a byte, as many as fit with the NUL;
 * "(none)" for none). */
static void hex_str(const uint8_t *u, size_t len, char *out, size_t outlen) {
  size_t o = 0;
  for (size_t i = 0; i < len && o + 2 < outlen; i++)
    o += (size_t)snprintf(out + o, outlen - o, "%02x", u[i]);
  if (len == 0) snprintf(out, outlen, "(none)");
}

/* ---- worker half ---- */

typedef struct ipc_worker {
  const wtx_cuda *cuda;
  wtx_wire_params wire;
  int device;
  uint8_t uuid[16];
  void *opened[WTX_MAX_BUFFERS];
  wtx_cuda_ipc_handle handles[WTX_MAX_BUFFERS];
  wtx__gpu_out out;
  wtx__gpu_region region; /* direct receive */
} ipc_worker;

static int ipc_worker_init(const Wtx__V1__InitInfo *init, const wtx_wire_params *wire,
                           const wtx_worker_env *env, void **self, char *err,
                           size_t errlen) {
  int device;
  int rc = wtx__cuda_device(env != NULL ? env->cuda_device : NULL, &device, err, errlen);
  const wtx_cuda *c;
  if (rc == 0) rc = wtx__cuda_load(0, &c, err, errlen);
  if (rc != 0) return rc;
  ipc_worker *w = calloc(1, sizeof *w);
  if (w == NULL) return WTX_ENOMEM;
  w->cuda = c;
  w->wire = *wire;
  w->device = device;
  w->region.bytes = init->cuda_ipc != NULL ? init->cuda_ipc->direct_bytes : 0;
  w->region.max = env != NULL ? env->max_model_bytes : 0;
  int prev;
  int e = wtx__cuda_enter(c, w->device, &prev);
  int bad = e != WTX_CUDA_SUCCESS || wtx__cuda_uuid(c, w->device, w->uuid) != 0 ||
            (e = wtx__gpu_out_open(&w->out, c, wire->timeout_ms)) != WTX_CUDA_SUCCESS;
  wtx__cuda_leave(c, prev);
  if (bad) {
    snprintf(err, errlen, "cuda_ipc: device %d: %s", w->device,
             e ? c->GetErrorString(e) : "no properties");
    free(w);
    return e ? WTX_CUDA_INIT_FAILED(e) : WTX_EUNAVAIL;
  }
  *self = w;
  return 0;
}

static int ipc_worker_device(void *self) { return ((ipc_worker *)self)->device; }

/* A direct session's receive region, allocated and exported once, outside
 * the session lock; its handle is the data_address. Declined (an empty
 * data_address: the trainer then uses its buffers) over --max-model-bytes
 * or when the GPU has no room for it. */
static int ipc_worker_connect(void *self, char *data_address, size_t addrlen, char *err,
                              size_t errlen) {
  (void)err;
  (void)errlen;
  ipc_worker *w = self;
  const wtx_cuda *c = w->cuda;
  if (addrlen > 0) data_address[0] = '\0';
  if (w->region.bytes == 0) return 0;
  wtx_cuda_ipc_handle h;
  int prev, e = wtx__cuda_enter(c, w->device, &prev);
  if (e == WTX_CUDA_SUCCESS) wtx__gpu_region_open(&w->region, c, "cuda_ipc");
  if (e == WTX_CUDA_SUCCESS && w->region.base != NULL)
    e = c->IpcGetMemHandle(&h, w->region.base);
  if (e != WTX_CUDA_SUCCESS)
    wtx__gpu_region_drop(&w->region, c, "cuda_ipc", c->GetErrorString(e));
  wtx__cuda_leave(c, prev);
  if (w->region.base == NULL) return 0;
  char uuid[40], handle[2 * sizeof h + 1];
  hex_str(w->uuid, sizeof w->uuid, uuid, sizeof uuid);
  hex_str((const uint8_t *)&h, sizeof h, handle, sizeof handle);
  snprintf(data_address, addrlen, DIRECT_PREFIX "%s:%s:%llu", uuid, handle,
           (unsigned long long)w->region.bytes);
  return 0;
}

static int ipc_worker_region(void *self, uint8_t **base, uint64_t *bytes) {
  return wtx__gpu_region_get(&((ipc_worker *)self)->region, base, bytes);
}

/* A chunk the trainer wrote into the receive region at its stream offset:
 * copied out of there into the model's staging (nothing to copy for a
 * model that adopted the region). The current device is the worker's. */
static int receive_direct(ipc_worker *w, const Wtx__V1__CudaIpcUpdateInfo *u, wtx_rx *rx) {
  uint64_t n = wtx_rx_remaining(rx), at = wtx_rx_stream_offset(rx);
  uint8_t *src = wtx__gpu_region_at(&w->region, at, n);
  if (w->region.base == NULL) {
    wtx_rx_errorf(rx, "update_info.cuda_ipc.direct: this worker has no receive region "
                  "(its init answered none)");
    return WTX_EINVAL;
  }
  if (u->direct_offset != at || src == NULL) {
    wtx_rx_errorf(rx, "update_info.cuda_ipc.direct_offset: %llu, but this chunk of %llu "
                  "bytes begins at byte %llu of the update, and the receive region holds "
                  "%llu", (unsigned long long)u->direct_offset, (unsigned long long)n,
                  (unsigned long long)at, (unsigned long long)w->region.bytes);
    return WTX_EINVAL;
  }
  return wtx__gpu_out_copy(&w->out, src, "cuda_ipc", rx);
}

static int copy_out(ipc_worker *w, const Wtx__V1__CudaIpcBuffer *b, wtx_rx *rx);

/* A chunk in one of the trainer's buffers: the entry for this worker's GPU,
 * checked, then copied out. The current device is the worker's. */
static int receive_buffer(ipc_worker *w, const Wtx__V1__CudaIpcUpdateInfo *u, wtx_rx *rx) {
  const Wtx__V1__CudaIpcBuffer *b = NULL;
  char offered[400] = "";
  size_t o = 0;
  for (size_t i = 0; i < u->n_buffers && b == NULL; i++) {
    const Wtx__V1__CudaIpcBuffer *x = u->buffers[i];
    if (x->gpu_uuid.len == 16 && memcmp(x->gpu_uuid.data, w->uuid, 16) == 0) {
      b = x;
    } else if (o + 40 < sizeof offered) {
      char s[40];
      hex_str(x->gpu_uuid.data, x->gpu_uuid.len, s, sizeof s);
      o += (size_t)snprintf(offered + o, sizeof offered - o, "%s%s", o ? ", " : "", s);
    }
  }
  char mine[40];
  hex_str(w->uuid, 16, mine, sizeof mine);
  if (b == NULL) {
    wtx_rx_errorf(rx, "update_info.cuda_ipc.buffers: none for this worker's GPU "
                  "%s (device %d); offered: %s", mine, w->device,
                  offered[0] ? offered : "nothing");
    return WTX_EINVAL;
  }
  uint64_t want = wtx_rx_remaining(rx);
  if (b->handle.len != sizeof(wtx_cuda_ipc_handle) || b->buffer_index >= WTX_MAX_BUFFERS ||
      b->buffer_index >= w->wire.num_buffers || b->size != want ||
      want > w->wire.buffer_size) {
    wtx_rx_errorf(rx, "update_info.cuda_ipc.buffers: entry for GPU %s needs a "
                  "%zu-byte handle, buffer_index < %u and size %llu (<= "
                  "buffer_size); got %zu bytes, index %u, size %llu", mine,
                  sizeof(wtx_cuda_ipc_handle), w->wire.num_buffers,
                  (unsigned long long)want, b->handle.len, b->buffer_index,
                  (unsigned long long)b->size);
    return WTX_EINVAL;
  }
  return copy_out(w, b, rx);
}

static int ipc_worker_receive(void *self, const Wtx__V1__UpdateInfo *info, wtx_rx *rx) {
  ipc_worker *w = self;
  const Wtx__V1__CudaIpcUpdateInfo *u = info->cuda_ipc;
  int prev;
  if (wtx__cuda_enter(w->cuda, w->device, &prev) != WTX_CUDA_SUCCESS) {
    wtx_rx_errorf(rx, "cuda_ipc: cannot select device %d", w->device);
    return WTX_EUNAVAIL;
  }
  int rc = u->direct ? receive_direct(w, u, rx) : receive_buffer(w, u, rx);
  wtx__cuda_leave(w->cuda, prev);
  return rc;
}

/* Opens buffer b's handle (once per buffer and session) and copies the
 * chunk out of it. The current device is the worker's. */
static int copy_out(ipc_worker *w, const Wtx__V1__CudaIpcBuffer *b, wtx_rx *rx) {
  const wtx_cuda *c = w->cuda;
  uint32_t k = b->buffer_index;
  if (w->opened[k] != NULL && memcmp(&w->handles[k], b->handle.data, sizeof w->handles[k])) {
    c->IpcCloseMemHandle(w->opened[k]); /* the trainer re-exported */
    w->opened[k] = NULL;
  }
  if (w->opened[k] == NULL) {
    memcpy(&w->handles[k], b->handle.data, sizeof w->handles[k]);
    int e = c->IpcOpenMemHandle(&w->opened[k], w->handles[k], WTX_CUDA_IPC_LAZY_PEER);
    if (e != WTX_CUDA_SUCCESS) {
      w->opened[k] = NULL;
      wtx_rx_errorf(rx, "cuda_ipc: cannot open buffer %u's handle: %s", k,
                    c->GetErrorString(e));
      return WTX_EIO;
    }
  }
  return wtx__gpu_out_copy(&w->out, w->opened[k], "cuda_ipc", rx);
}

static int ipc_worker_put_box(void *self, void *dst, const wtx_box *whole, const void *src,
                              const wtx_box *box, size_t es, char *err, size_t errlen) {
  ipc_worker *w = self;
  return wtx__gpu_out_box(&w->out, w->device, dst, whole, src, box, es, "cuda_ipc", err,
                          errlen);
}

static void ipc_worker_destroy(void *self) {
  ipc_worker *w = self;
  int prev;
  wtx__cuda_enter(w->cuda, w->device, &prev); /* the handles were opened there */
  for (int k = 0; k < WTX_MAX_BUFFERS; k++)
    if (w->opened[k] != NULL) w->cuda->IpcCloseMemHandle(w->opened[k]);
  wtx__gpu_out_close(&w->out);
  wtx__gpu_region_drop(&w->region, w->cuda, "cuda_ipc", NULL);
  wtx__cuda_leave(w->cuda, prev);
  free(w);
}

const wtx_worker_transport wtx_cuda_ipc_worker_transport = {
    .name = "cuda_ipc",
    .init_case = WTX__V1__INIT_INFO__BACKEND_CUDA_IPC,
    .update_case = WTX__V1__UPDATE_INFO__BACKEND_CUDA_IPC,
    .default_checksum = WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE,
    .supports_draft = 1,
    .init = ipc_worker_init,
    .connect = ipc_worker_connect,
    .receive = ipc_worker_receive,
    .destroy = ipc_worker_destroy,
    .device = ipc_worker_device,
    .region = ipc_worker_region,
    .put_box = ipc_worker_put_box,
};

/* ---- trainer half ---- */

typedef struct ipc_trainer {
  wtx__cuda_trainer gpu;
  uint8_t uuid[16];
  wtx_cuda_ipc_handle *handles;
  Wtx__V1__CudaIpcBuffer *entries;
  Wtx__V1__CudaIpcBuffer **entry_ptrs;
  Wtx__V1__CudaIpcUpdateInfo *updates;
  Wtx__V1__CudaIpcInitInfo ipc;
  /* Direct receive: every worker's region, opened once (all or none). */
  size_t n_workers;
  void **regions;
  void **dsts; /* scratch: where a chunk goes, per worker */
  int direct; /* the regions are open: chunks go there */
  Wtx__V1__CudaIpcUpdateInfo direct_update;
} ipc_trainer;

/* Closes the regions opened so far; the session uses the buffers. */
static void regions_close(ipc_trainer *t) {
  int prev;
  wtx__cuda_enter(t->gpu.cuda, t->gpu.device, &prev); /* they were opened there */
  for (size_t i = 0; t->regions != NULL && i < t->n_workers; i++) {
    if (t->regions[i] != NULL) t->gpu.cuda->IpcCloseMemHandle(t->regions[i]);
    t->regions[i] = NULL;
  }
  wtx__cuda_leave(t->gpu.cuda, prev);
  t->direct = 0;
}

static void ipc_trainer_destroy(void *self) {
  ipc_trainer *t = self;
  if (t == NULL) return;
  if (t->gpu.cuda != NULL) regions_close(t);
  free(t->regions);
  free(t->dsts);
  wtx__cuda_trainer_close(&t->gpu);
  free(t->handles);
  free(t->entries);
  free(t->entry_ptrs);
  free(t->updates);
  free(t);
}

/* Exports buffer k once (one handle per buffer, never per tensor) and fills
 * its UpdateInfo entry. */
static int export_buffer(ipc_trainer *t, uint32_t k, char *why, size_t len) {
  /* The caller has made the trainer's device current. */
  const wtx_cuda *c = t->gpu.cuda;
  int e = c->IpcGetMemHandle(&t->handles[k], t->gpu.bufs.dev[k]);
  if (e != WTX_CUDA_SUCCESS) {
    snprintf(why, len, "cudaIpcGetMemHandle: %s", c->GetErrorString(e));
    return WTX_EUNAVAIL;
  }
  Wtx__V1__CudaIpcBuffer *b = &t->entries[k];
  wtx__v1__cuda_ipc_buffer__init(b);
  b->gpu_uuid.data = t->uuid;
  b->gpu_uuid.len = 16;
  b->handle.data = (uint8_t *)&t->handles[k];
  b->handle.len = sizeof t->handles[k];
  b->buffer_index = k;
  t->entry_ptrs[k] = b;
  wtx__v1__cuda_ipc_update_info__init(&t->updates[k]);
  t->updates[k].buffers = &t->entry_ptrs[k];
  t->updates[k].n_buffers = 1;
  return 0;
}

static int ipc_trainer_create(const wtx_trainer_args *args, void **self, char *err,
                              size_t errlen) {
  uint32_t nb = args->wire.num_buffers;
  ipc_trainer *t = calloc(1, sizeof *t);
  if (t == NULL) return WTX_ENOMEM;
  int rc = wtx__cuda_trainer_open(&t->gpu, "cuda_ipc", 0, nb, args->wire.buffer_size,
                                  args->wire.timeout_ms, err, errlen);
  if (rc != 0) goto fail;
  int prev;
  wtx__cuda_enter(t->gpu.cuda, t->gpu.device, &prev);
  t->handles = calloc(nb, sizeof *t->handles);
  t->entries = calloc(nb, sizeof *t->entries);
  t->entry_ptrs = calloc(nb, sizeof *t->entry_ptrs);
  t->updates = calloc(nb, sizeof *t->updates);
  rc = t->handles && t->entries && t->entry_ptrs && t->updates ? 0 : WTX_ENOMEM;
  char why[300] = "no device properties";
  if (rc == 0 && wtx__cuda_uuid(t->gpu.cuda, t->gpu.device, t->uuid) != 0) rc = WTX_EUNAVAIL;
  for (uint32_t k = 0; rc == 0 && k < nb; k++) rc = export_buffer(t, k, why, sizeof why);
  wtx__cuda_leave(t->gpu.cuda, prev);
  if (rc == WTX_EUNAVAIL) snprintf(err, errlen, "cuda_ipc: device %d: %s", t->gpu.device, why);
  if (rc != 0) goto fail;
  wtx__v1__cuda_ipc_init_info__init(&t->ipc);
  wtx__v1__cuda_ipc_update_info__init(&t->direct_update);
  t->direct_update.direct = 1;
  t->n_workers = args->n_workers;
  if (args->direct && args->stream_bytes > 0) {
    t->ipc.direct_bytes = args->stream_bytes;
    t->regions = calloc(args->n_workers, sizeof *t->regions);
    t->dsts = calloc(args->n_workers, sizeof *t->dsts);
    if (t->regions == NULL || t->dsts == NULL) {
      rc = WTX_ENOMEM;
      goto fail;
    }
  }
  *self = t;
  return 0;
fail:
  ipc_trainer_destroy(t);
  return rc;
}

static int ipc_trainer_init_info(void *self, size_t i, const char *const *prev,
                                 Wtx__V1__InitInfo *out) {
  (void)i;
  (void)prev;
  out->backend_case = WTX__V1__INIT_INFO__BACKEND_CUDA_IPC;
  out->cuda_ipc = &((ipc_trainer *)self)->ipc;
  return 0;
}

/* hex (2n digits) into out; 0, or -1 when it is not that. */
static int hex_parse(const char *hex, size_t len, uint8_t *out, size_t n) {
  if (len != 2 * n) return -1;
  for (size_t i = 0; i < n; i++) {
    unsigned v;
    char pair[3] = {hex[2 * i], hex[2 * i + 1], 0};
    if (strspn(pair, "0123456789abcdef") != 2 || sscanf(pair, "%2x", &v) != 1) return -1;
    out[i] = (uint8_t)v;
  }
  return 0;
}

/* Worker i's answer, "cuda-ipc-direct:<uuid>:<handle>:<bytes>", into h;
 * 1 when it is one for a region of want bytes, 0 when the worker declined
 * (empty), -1 when it is malformed. */
static int parse_region(const char *a, uint64_t want, wtx_cuda_ipc_handle *h) {
  if (a == NULL || a[0] == '\0') return 0;
  size_t p = strlen(DIRECT_PREFIX);
  if (strncmp(a, DIRECT_PREFIX, p) != 0) return -1;
  const char *uuid = a + p, *handle = strchr(uuid, ':');
  const char *bytes = handle != NULL ? strchr(handle + 1, ':') : NULL;
  uint8_t u[16];
  if (bytes == NULL || hex_parse(uuid, (size_t)(handle - uuid), u, sizeof u) != 0 ||
      hex_parse(handle + 1, (size_t)(bytes - handle - 1), (uint8_t *)h, sizeof *h) != 0)
    return -1;
  char *end;
  unsigned long long n = strtoull(bytes + 1, &end, 10);
  return *end == '\0' && n == want ? 1 : -1;
}

/* Every worker answered init: with direct receive asked for, open every
 * worker's region once, or (one declined, or cannot be opened here) none,
 * and use the buffers. */
static int ipc_trainer_connect(void *self, const char *const *addresses, char *err,
                               size_t errlen) {
  ipc_trainer *t = self;
  if (t->regions == NULL || addresses == NULL) return 0;
  const wtx_cuda *c = t->gpu.cuda;
  int prev, ok = 1;
  wtx__cuda_enter(c, t->gpu.device, &prev);
  for (size_t i = 0; ok && i < t->n_workers; i++) {
    wtx_cuda_ipc_handle h;
    int r = parse_region(addresses[i], t->ipc.direct_bytes, &h);
    if (r < 0) {
      wtx__cuda_leave(c, prev);
      regions_close(t);
      snprintf(err, errlen, "cuda_ipc: worker %zu answered a data_address that is not "
               "a receive region of %llu bytes", i, (unsigned long long)t->ipc.direct_bytes);
      return WTX_EPROTO;
    }
    ok = r == 1 && c->IpcOpenMemHandle(&t->regions[i], h, WTX_CUDA_IPC_LAZY_PEER) ==
                       WTX_CUDA_SUCCESS;
    if (!ok) t->regions[i] = NULL;
  }
  wtx__cuda_leave(c, prev);
  if (ok) t->direct = 1;
  else regions_close(t);
  return 0;
}

static int ipc_trainer_direct(void *self) { return ((ipc_trainer *)self)->direct; }

static uint8_t *ipc_trainer_buffer(void *self, uint32_t k) {
  return wtx__cuda_trainer_host(&((ipc_trainer *)self)->gpu, k);
}

static int ipc_trainer_put_device(void *self, uint32_t k, uint64_t offset, const void *src,
                                  uint64_t len) {
  return wtx__cuda_trainer_put_device(&((ipc_trainer *)self)->gpu, k, offset, src, len);
}

/* Direct receive: chunk k straight into every worker's region at its
 * stream offset, waited for. */
static int prepare_direct(ipc_trainer *t, uint32_t k, const wtx_chunk *ch,
                          Wtx__V1__UpdateInfo *ui, char *err, size_t errlen) {
  uint64_t room = t->ipc.direct_bytes;
  if (ch->stream_offset > room || ch->bytes > room - ch->stream_offset) {
    snprintf(err, errlen, "the update (past %llu bytes) outgrew the workers' receive "
             "regions (%llu bytes, the source's size at init): initialize again",
             (unsigned long long)(ch->stream_offset + ch->bytes), (unsigned long long)room);
    return WTX_EINVAL;
  }
  for (size_t i = 0; i < t->n_workers; i++)
    t->dsts[i] = (uint8_t *)t->regions[i] + ch->stream_offset;
  int rc = wtx__cuda_trainer_upload_to(&t->gpu, k, t->dsts, t->n_workers, ch->bytes, err,
                                       errlen);
  if (rc != 0) return rc;
  t->direct_update.direct_offset = ch->stream_offset;
  ui->backend_case = WTX__V1__UPDATE_INFO__BACKEND_CUDA_IPC;
  ui->cuda_ipc = &t->direct_update;
  return 0;
}

static int ipc_trainer_prepare(void *self, uint32_t k, const wtx_chunk *ch,
                               Wtx__V1__UpdateInfo *ui, char *err, size_t errlen) {
  ipc_trainer *t = self;
  if (t->direct) return prepare_direct(t, k, ch, ui, err, errlen);
  int rc = wtx__cuda_trainer_upload(&t->gpu, k, ch->bytes, err, errlen);
  if (rc != 0) return rc;
  t->entries[k].size = ch->bytes;
  ui->backend_case = WTX__V1__UPDATE_INFO__BACKEND_CUDA_IPC;
  ui->cuda_ipc = &t->updates[k];
  return 0;
}

const wtx_trainer_transport wtx_cuda_ipc_trainer_transport = {
    .name = "cuda_ipc",
    .init_case = WTX__V1__INIT_INFO__BACKEND_CUDA_IPC,
    .update_case = WTX__V1__UPDATE_INFO__BACKEND_CUDA_IPC,
    .default_checksum = WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE,
    .create = ipc_trainer_create,
    .init_info = ipc_trainer_init_info,
    .connect = ipc_trainer_connect,
    .buffer = ipc_trainer_buffer,
    .put_device = ipc_trainer_put_device,
    .prepare = ipc_trainer_prepare,
    .destroy = ipc_trainer_destroy,
    .direct = ipc_trainer_direct,
};
