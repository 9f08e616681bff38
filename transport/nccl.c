/* nccl: broadcast from trainer rank 0 to every worker rank
 * (docs/data-plane.md, "nccl").
 *
 * The trainer creates the ncclUniqueId and ships it in every worker's init
 * handshake (no extra rendezvous service). The communicator's world is the
 * trainer (rank 0) plus one rank per worker (rank_offset, 1..world-1);
 * joining is collective, so the engine starts every worker's init call,
 * joins as rank 0, then collects the answers (collective_init). Every rank
 * joins with a non-blocking init polled up to timeout_ms (the worker's is
 * also ended by cancel, i.e. abort, drain or SIGTERM); a rank that never
 * comes is a timeout, not a hang, and the half-made communicator is
 * aborted.
 *
 * Per chunk the trainer copies the packed (pinned) host buffer into device
 * buffer k, waits for the copy, the UpdateWeights calls start, then the
 * broadcast runs on the trainer's own stream; every worker receives into its
 * device buffer and copies the chunk out into the model's staging memory
 * (device to device when the model stages on the GPU, transport/gpu_out.h).
 * Waits are bounded by timeout_ms: the stream is polled together with NCCL's
 * asynchronous error, and a broadcast that fails or times out is aborted at
 * once (ncclCommAbort: its kernel would otherwise keep spinning on the GPU),
 * on both sides. A failed communicator is dropped; the next init joins a
 * new one. Every CUDA and NCCL call runs on the backend's device and leaves
 * the caller's current device as it was. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda/cuda.h"
#include "transport/gpu_out.h"
#include "transport/transport.h"

/* A communicator that failed must be aborted (that is what unblocks its
 * stream and stops its kernels); a healthy one is destroyed. */
static void comm_release(const wtx_cuda *c, void **comm, int broken) {
  if (*comm == NULL) return;
  if (broken) c->CommAbort(*comm);
  else c->CommDestroy(*comm);
  *comm = NULL;
}

/* ---- worker half ---- */

typedef struct nccl_worker {
  const wtx_cuda *cuda;
  wtx_wire_params wire;
  int device;
  void *comm, *stream, *buf;
  int rank, world_size;
  wtx_nccl_id id;
  int broken;
  atomic_int cancelled;
  wtx__gpu_out out;
  wtx__gpu_region region; /* direct receive */
} nccl_worker;

static void nccl_worker_destroy(void *self) {
  nccl_worker *w = self;
  if (w == NULL) return;
  const wtx_cuda *c = w->cuda;
  int prev;
  wtx__cuda_enter(c, w->device, &prev);
  comm_release(c, &w->comm, w->broken);
  if (w->buf != NULL) c->Free(w->buf);
  wtx__gpu_region_drop(&w->region, c, "nccl", NULL);
  wtx__gpu_out_close(&w->out);
  if (w->stream != NULL) c->StreamDestroy(w->stream);
  wtx__cuda_leave(c, prev);
  free(w);
}

/* Validates, loads CUDA and NCCL, allocates the device buffer and stream;
 * joining the communicator is connect. */
static int nccl_worker_init(const Wtx__V1__InitInfo *init, const wtx_wire_params *wire,
                           const wtx_worker_env *env, void **self, char *err,
                           size_t errlen) {
  const Wtx__V1__NcclInitInfo *ni = init->nccl;
  if (ni->unique_id.len != sizeof(wtx_nccl_id)) {
    snprintf(err, errlen, "init_info.nccl.unique_id: %zu bytes, must be %zu",
             ni->unique_id.len, sizeof(wtx_nccl_id));
    return WTX_EINVAL;
  }
  if (ni->world_size < 2 || ni->world_size > WTX_MAX_NCCL_WORLD_SIZE || ni->rank_offset < 1 ||
      ni->rank_offset >= ni->world_size) {
    snprintf(err, errlen, "init_info.nccl: world_size %u must be 2..%d and "
             "rank_offset %u within 1..world_size-1", ni->world_size,
             WTX_MAX_NCCL_WORLD_SIZE, ni->rank_offset);
    return WTX_EINVAL;
  }
  int device;
  int rc = wtx__cuda_device(env != NULL ? env->cuda_device : NULL, &device, err, errlen);
  const wtx_cuda *c;
  if (rc == 0) rc = wtx__cuda_load(1, &c, err, errlen);
  if (rc != 0) return rc;
  nccl_worker *w = calloc(1, sizeof *w);
  if (w == NULL) return WTX_ENOMEM;
  w->cuda = c;
  w->wire = *wire;
  w->device = device;
  w->region.bytes = ni->direct_bytes;
  w->region.max = env != NULL ? env->max_model_bytes : 0;
  w->rank = (int)ni->rank_offset;
  atomic_init(&w->cancelled, 0);
  int prev;
  int e = wtx__cuda_enter(c, w->device, &prev);
  if (e == WTX_CUDA_SUCCESS) e = c->StreamCreate(&w->stream);
  if (e == WTX_CUDA_SUCCESS) e = c->Malloc(&w->buf, (size_t)wire->buffer_size);
  if (e == WTX_CUDA_SUCCESS) e = wtx__gpu_out_open(&w->out, c, wire->timeout_ms);
  wtx__cuda_leave(c, prev);
  if (e != WTX_CUDA_SUCCESS) {
    snprintf(err, errlen, "nccl: device %d: %s", w->device, c->GetErrorString(e));
    nccl_worker_destroy(w);
    return WTX_EUNAVAIL;
  }
  memcpy(&w->id, ni->unique_id.data, sizeof w->id);
  w->world_size = (int)ni->world_size;
  *self = w;
  return 0;
}

static int nccl_worker_device(void *self) { return ((nccl_worker *)self)->device; }

static int nccl_worker_region(void *self, uint8_t **base, uint64_t *bytes) {
  return wtx__gpu_region_get(&((nccl_worker *)self)->region, base, bytes);
}

/* Allocates the receive region when asked, then joins the trainer's
 * communicator (outside the session lock): bounded by timeout_ms, ended by
 * cancel. */
static int nccl_worker_connect(void *self, char *data_address, size_t addrlen,
                               char *err, size_t errlen) {
  nccl_worker *w = self;
  const wtx_cuda *c = w->cuda;
  if (addrlen > 0) data_address[0] = '\0';
  int prev;
  wtx__cuda_enter(c, w->device, &prev);
  wtx__gpu_region_open(&w->region, c, "nccl");
  char why[400];
  wtx_stop stop = {.flag = &w->cancelled};
  int rc = wtx__nccl_join(c, &w->comm, w->world_size, &w->id, w->rank, w->wire.timeout_ms,
                          &stop, why, sizeof why);
  wtx__cuda_leave(c, prev);
  if (rc != 0)
    snprintf(err, errlen, "nccl: joining the communicator as rank %d of %d on device %d: %s",
             w->rank, w->world_size, w->device, why);
  return rc == WTX_ETIMEDOUT || rc == WTX_ECANCELED ? rc : rc != 0 ? WTX_EUNAVAIL : 0;
}

/* From any thread: a join or a broadcast being waited for ends. */
static void nccl_worker_cancel(void *self) {
  atomic_store(&((nccl_worker *)self)->cancelled, 1);
}

static int broadcast_in(nccl_worker *w, uint64_t n, wtx_rx *rx);

static int nccl_worker_receive(void *self, const Wtx__V1__UpdateInfo *info, wtx_rx *rx) {
  (void)info; /* nccl sends nothing per round */
  nccl_worker *w = self;
  const wtx_cuda *c = w->cuda;
  if (w->broken || w->comm == NULL) {
    wtx_rx_errorf(rx, "nccl: the communicator failed earlier; initialize the "
                  "session again");
    return WTX_ESTATE;
  }
  uint64_t n = wtx_rx_remaining(rx);
  if (n > w->wire.buffer_size) {
    wtx_rx_errorf(rx, "update_info.chunk_bytes: %llu exceeds buffer_size %llu",
                  (unsigned long long)n, (unsigned long long)w->wire.buffer_size);
    return WTX_EINVAL;
  }
  int prev;
  wtx__cuda_enter(c, w->device, &prev);
  int rc = broadcast_in(w, n, rx);
  wtx__cuda_leave(c, prev);
  return rc;
}

/* Receives n bytes by broadcast into the receive region at the chunk's
 * stream offset (a direct session) or else into the device buffer, then
 * copies them out (nothing to copy for a model that adopted the region).
 * A failed or timed-out broadcast is aborted at once. The current device
 * is the worker's. */
static int broadcast_in(nccl_worker *w, uint64_t n, wtx_rx *rx) {
  const wtx_cuda *c = w->cuda;
  char err[400];
  uint64_t at = wtx_rx_stream_offset(rx);
  uint8_t *dst = wtx__gpu_region_at(&w->region, at, n);
  if (dst == NULL) dst = w->buf;
  int e = c->Broadcast(dst, dst, (size_t)n, WTX_NCCL_UINT8, 0, w->comm, w->stream);
  wtx_stop stop = {.flag = &w->cancelled};
  int rc = e == WTX_NCCL_SUCCESS ? wtx__cuda_wait(c, w->stream, w->comm, w->wire.timeout_ms,
                                                  &stop, err, sizeof err)
                                 : WTX_EIO;
  if (e != WTX_NCCL_SUCCESS) wtx__nccl_error(c, w->comm, e, err, sizeof err);
  if (rc != 0) {
    w->broken = 1;
    comm_release(c, &w->comm, 1);
    wtx_rx_errorf(rx, "nccl: broadcast of %llu bytes as rank %d: %s (communicator "
                  "aborted)", (unsigned long long)n, w->rank, err);
    return rc;
  }
  return wtx__gpu_out_copy(&w->out, dst, "nccl", rx);
}

static void nccl_worker_reset(void *self) {
  /* An update aborted outside a broadcast leaves the collective sequence
   * unknown to the trainer: this communicator is done. */
  ((nccl_worker *)self)->broken = 1;
}

const wtx_worker_transport wtx_nccl_worker_transport = {
    .name = "nccl",
    .init_case = WTX__V1__INIT_INFO__BACKEND_NCCL,
    .update_case = WTX__V1__UPDATE_INFO__BACKEND_NCCL,
    .default_checksum = WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE,
    .supports_draft = 1,
    .init = nccl_worker_init,
    .connect = nccl_worker_connect,
    .receive = nccl_worker_receive,
    .device = nccl_worker_device,
    .region = nccl_worker_region,
    .cancel = nccl_worker_cancel,
    .reset = nccl_worker_reset,
    .destroy = nccl_worker_destroy,
};

/* ---- trainer half ---- */

typedef struct nccl_trainer {
  wtx__cuda_trainer gpu;
  size_t n_workers;
  uint32_t timeout_ms;
  wtx_nccl_id id;
  void *comm;
  int broken;
  uint64_t direct_bytes; /* each worker's receive region asked for (0: none) */
  Wtx__V1__NcclInitInfo *nccl; /* per worker */
  Wtx__V1__NcclUpdateInfo update;
} nccl_trainer;

static void nccl_trainer_destroy(void *self) {
  nccl_trainer *t = self;
  if (t == NULL) return;
  if (t->gpu.cuda != NULL) {
    int prev;
    wtx__cuda_enter(t->gpu.cuda, t->gpu.device, &prev);
    comm_release(t->gpu.cuda, &t->comm, t->broken);
    wtx__cuda_leave(t->gpu.cuda, prev);
  }
  wtx__cuda_trainer_close(&t->gpu);
  free(t->nccl);
  free(t);
}

static int nccl_trainer_create(const wtx_trainer_args *args, void **self, char *err,
                               size_t errlen) {
  nccl_trainer *t = calloc(1, sizeof *t);
  if (t == NULL) return WTX_ENOMEM;
  t->n_workers = args->n_workers;
  t->timeout_ms = args->wire.timeout_ms;
  t->direct_bytes = args->direct ? args->stream_bytes : 0;
  int rc = wtx__cuda_trainer_open(&t->gpu, "nccl", 1, args->wire.num_buffers,
                                  args->wire.buffer_size, t->timeout_ms, err, errlen);
  if (rc == 0 && (t->nccl = calloc(t->n_workers, sizeof *t->nccl)) == NULL) rc = WTX_ENOMEM;
  int e = rc == 0 ? t->gpu.cuda->GetUniqueId(&t->id) : WTX_NCCL_SUCCESS;
  if (e != WTX_NCCL_SUCCESS) {
    snprintf(err, errlen, "nccl: ncclGetUniqueId: %s", t->gpu.cuda->NcclErrorString(e));
    rc = WTX_EUNAVAIL;
  }
  if (rc != 0) {
    nccl_trainer_destroy(t);
    return rc;
  }
  wtx__v1__nccl_update_info__init(&t->update);
  *self = t;
  return 0;
}

static int nccl_trainer_init_info(void *self, size_t i, const char *const *prev,
                                  Wtx__V1__InitInfo *out) {
  (void)prev;
  nccl_trainer *t = self;
  /* A unique id serves one communicator: every rendezvous gets a new one. */
  if (i == 0 && t->gpu.cuda->GetUniqueId(&t->id) != WTX_NCCL_SUCCESS) return WTX_EUNAVAIL;
  Wtx__V1__NcclInitInfo *ni = &t->nccl[i];
  wtx__v1__nccl_init_info__init(ni);
  ni->unique_id.data = (uint8_t *)&t->id;
  ni->unique_id.len = sizeof t->id;
  ni->world_size = (uint32_t)(t->n_workers + 1);
  ni->rank_offset = (uint32_t)(i + 1);
  ni->direct_bytes = t->direct_bytes;
  out->backend_case = WTX__V1__INIT_INFO__BACKEND_NCCL;
  out->nccl = ni;
  return 0;
}

static int nccl_trainer_connect(void *self, const char *const *addresses, char *err,
                                size_t errlen) {
  (void)addresses;
  nccl_trainer *t = self;
  const wtx_cuda *c = t->gpu.cuda;
  int prev;
  wtx__cuda_enter(c, t->gpu.device, &prev);
  /* A new rendezvous: the old communicator goes first. */
  comm_release(c, &t->comm, t->broken);
  t->broken = 0;
  char why[400];
  int rc = wtx__nccl_join(c, &t->comm, (int)(t->n_workers + 1), &t->id, 0, t->timeout_ms,
                          NULL, why, sizeof why);
  wtx__cuda_leave(c, prev);
  if (rc != 0)
    snprintf(err, errlen, "nccl: joining the communicator as rank 0 of %zu on device %d: %s",
             t->n_workers + 1, t->gpu.device, why);
  return rc == WTX_ETIMEDOUT ? rc : rc != 0 ? WTX_EUNAVAIL : 0;
}

static uint8_t *nccl_trainer_buffer(void *self, uint32_t k) {
  return wtx__cuda_trainer_host(&((nccl_trainer *)self)->gpu, k);
}

static int nccl_trainer_put_device(void *self, uint32_t k, uint64_t offset, const void *src,
                                   uint64_t len) {
  return wtx__cuda_trainer_put_device(&((nccl_trainer *)self)->gpu, k, offset, src, len);
}

static int nccl_trainer_prepare(void *self, uint32_t k, const wtx_chunk *ch,
                                Wtx__V1__UpdateInfo *ui, char *err, size_t errlen) {
  nccl_trainer *t = self;
  int rc = wtx__cuda_trainer_upload(&t->gpu, k, ch->bytes, err, errlen);
  if (rc != 0) return rc;
  ui->backend_case = WTX__V1__UPDATE_INFO__BACKEND_NCCL;
  ui->nccl = &t->update;
  return 0;
}

static int nccl_trainer_post(void *self, uint32_t k, const wtx_chunk *ch) {
  nccl_trainer *t = self;
  if (t->broken || t->comm == NULL) return WTX_ESTATE;
  const wtx_cuda *c = t->gpu.cuda;
  int prev;
  wtx__cuda_enter(c, t->gpu.device, &prev);
  int e = c->Broadcast(t->gpu.bufs.dev[k], t->gpu.bufs.dev[k], (size_t)ch->bytes,
                       WTX_NCCL_UINT8, 0, t->comm, t->gpu.stream);
  if (e != WTX_NCCL_SUCCESS) {
    t->broken = 1;
    comm_release(c, &t->comm, 1);
  }
  wtx__cuda_leave(c, prev);
  return e == WTX_NCCL_SUCCESS ? 0 : WTX_EIO;
}

static int nccl_trainer_complete(void *self, uint32_t k, const wtx_stop *stop, char *err,
                                 size_t errlen) {
  (void)k;
  nccl_trainer *t = self;
  if (t->comm == NULL) {
    snprintf(err, errlen, "nccl: the communicator failed earlier");
    return WTX_ESTATE;
  }
  const wtx_cuda *c = t->gpu.cuda;
  int prev;
  wtx__cuda_enter(c, t->gpu.device, &prev);
  char why[400];
  int rc = wtx__cuda_wait(c, t->gpu.stream, t->comm, t->timeout_ms, stop, why, sizeof why);
  if (rc != 0) {
    t->broken = 1;
    comm_release(c, &t->comm, 1); /* stops the broadcast's kernel */
    snprintf(err, errlen, "nccl: broadcast: %s (communicator aborted)", why);
  }
  wtx__cuda_leave(c, prev);
  return rc;
}

const wtx_trainer_transport wtx_nccl_trainer_transport = {
    .name = "nccl",
    .init_case = WTX__V1__INIT_INFO__BACKEND_NCCL,
    .update_case = WTX__V1__UPDATE_INFO__BACKEND_NCCL,
    .default_checksum = WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE,
    .collective_init = 1,
    .create = nccl_trainer_create,
    .init_info = nccl_trainer_init_info,
    .connect = nccl_trainer_connect,
    .buffer = nccl_trainer_buffer,
    .put_device = nccl_trainer_put_device,
    .prepare = nccl_trainer_prepare,
    .post = nccl_trainer_post,
    .complete = nccl_trainer_complete,
    .destroy = nccl_trainer_destroy,
};
