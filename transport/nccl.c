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
#include <endian.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/hash.h"
#include "cuda/cuda.h"
#include "transport/gpu_out.h"
#include "transport/nccl_rank.h"
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
  uint32_t senders; /* trainer ranks that send (NcclInitInfo.senders); <= 1: rank 0 broadcasts */
  /* With senders and checksums: each chunk's span sums, sent after its
   * bytes (no sender sees a whole tensor), on the device and on the host. */
  void *sums_dev;
  uint64_t *sums;
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
  if (w->sums_dev != NULL) c->Free(w->sums_dev);
  free(w->sums);
  wtx__gpu_region_drop(&w->region, c, "nccl", NULL);
  wtx__gpu_out_close(&w->out);
  if (w->stream != NULL) c->StreamDestroy(w->stream);
  wtx__cuda_leave(c, prev);
  free(w);
}

/* Bytes of one chunk's span sums at most: one per tensor it touches. */
#define SUMS_BYTES ((size_t)WTX_MAX_CHUNK_PARAMS * 8)

/* Whether chunks carry span sums after their bytes: several senders, and
 * checksums on. */
static int span_sums(const nccl_worker *w) {
  return w->senders > 1 &&
         w->wire.checksum == WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64;
}

/* The fields of many senders (NcclInitInfo.senders) that need no GPU to
 * check: the senders are the communicator's first ranks, this worker is
 * past them, and no direct receive is asked for. */
static int check_senders(const Wtx__V1__NcclInitInfo *ni, const wtx_wire_params *wire,
                         char *err, size_t errlen) {
  if (ni->senders <= 1) return 0;
  if (ni->senders >= ni->world_size || ni->rank_offset < ni->senders) {
    snprintf(err, errlen, "init_info.nccl.senders: %u trainer ranks, but world_size is %u "
             "and this worker's rank_offset %u (workers come after the senders)",
             ni->senders, ni->world_size, ni->rank_offset);
    return WTX_EINVAL;
  }
  (void)wire;
  if (ni->direct_bytes > 0) {
    snprintf(err, errlen, "init_info.nccl.direct_bytes: not offered with several senders "
             "(init_info.nccl.senders)");
    return WTX_EINVAL;
  }
  return 0;
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
  int rc = check_senders(ni, wire, err, errlen);
  if (rc != 0) return rc;
  int device;
  rc = wtx__cuda_device(env != NULL ? env->cuda_device : NULL, &device, err, errlen);
  const wtx_cuda *c;
  if (rc == 0) rc = wtx__cuda_load(1, &c, err, errlen);
  if (rc != 0) return rc;
  nccl_worker *w = calloc(1, sizeof *w);
  if (w == NULL) return WTX_ENOMEM;
  w->cuda = c;
  w->wire = *wire;
  w->senders = ni->senders;
  w->device = device;
  w->region.bytes = ni->direct_bytes;
  w->region.max = env != NULL ? env->max_model_bytes : 0;
  w->rank = (int)ni->rank_offset;
  atomic_init(&w->cancelled, 0);
  int prev;
  int e = wtx__cuda_enter(c, w->device, &prev);
  if (e == WTX_CUDA_SUCCESS) e = c->StreamCreate(&w->stream);
  if (e == WTX_CUDA_SUCCESS) e = c->Malloc(&w->buf, (size_t)wire->buffer_size);
  if (e == WTX_CUDA_SUCCESS && span_sums(w)) e = c->Malloc(&w->sums_dev, SUMS_BYTES);
  if (e == WTX_CUDA_SUCCESS && span_sums(w) && (w->sums = malloc(SUMS_BYTES)) == NULL)
    e = 2; /* cudaErrorMemoryAllocation */
  if (e == WTX_CUDA_SUCCESS) e = wtx__gpu_out_open(&w->out, c, wire->timeout_ms);
  wtx__cuda_leave(c, prev);
  if (e != WTX_CUDA_SUCCESS) {
    snprintf(err, errlen, "nccl: device %d: %s", w->device, c->GetErrorString(e));
    nccl_worker_destroy(w);
    return WTX_CUDA_INIT_FAILED(e);
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

static int nccl_worker_put_box(void *self, void *dst, const wtx_box *whole, const void *src,
                               const wtx_box *box, size_t es, char *err, size_t errlen) {
  nccl_worker *w = self;
  return wtx__gpu_out_box(&w->out, w->device, dst, whole, src, box, es, "nccl", err, errlen);
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

static int broadcast_in(nccl_worker *w, uint64_t n, int sender, uint32_t n_sums, wtx_rx *rx);

/* The rank this chunk comes from: 0 (the broadcast's root), or with many
 * senders the one NcclUpdateInfo.sender names; -1 with rx's error set. */
static int chunk_sender(const nccl_worker *w, const Wtx__V1__UpdateInfo *info, wtx_rx *rx) {
  uint32_t s = info->nccl != NULL ? info->nccl->sender : 0;
  if (w->senders <= 1 && s == 0) return 0;
  if (s < w->senders) return (int)s;
  wtx_rx_errorf(rx, "update_info.nccl.sender: %u, but this session has %u sender%s", s,
                w->senders > 1 ? w->senders : 1, w->senders > 1 ? "s" : "");
  return -1;
}

static int nccl_worker_receive(void *self, const Wtx__V1__UpdateInfo *info, wtx_rx *rx) {
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
  int sender = chunk_sender(w, info, rx);
  if (sender < 0) return WTX_EINVAL;
  /* one sum per tensor the chunk touches, as tcp's trailer with senders */
  uint32_t n_sums = info->layout != NULL ? info->layout->count : (uint32_t)info->n_params;
  if (span_sums(w) && (n_sums > WTX_MAX_CHUNK_PARAMS || wtx_rx_span_checksums(rx) != 0)) {
    wtx_rx_errorf(rx, "update_info: %u tensors in a chunk, at most %d", n_sums,
                  WTX_MAX_CHUNK_PARAMS);
    return WTX_EINVAL;
  }
  int prev;
  wtx__cuda_enter(c, w->device, &prev);
  int rc = broadcast_in(w, n, sender, n_sums, rx);
  wtx__cuda_leave(c, prev);
  return rc;
}

/* Receives n bytes by broadcast (or, with many senders, from sender's
 * ncclSend) into the receive region at the chunk's stream offset (a direct
 * session) or else into the device buffer, then copies them out (nothing
 * to copy for a model that adopted the region). A failed or timed-out
 * receive is aborted at once. The current device is the worker's. */
static int broadcast_in(nccl_worker *w, uint64_t n, int sender, uint32_t n_sums, wtx_rx *rx) {
  const wtx_cuda *c = w->cuda;
  char err[400];
  uint64_t at = wtx_rx_stream_offset(rx);
  uint8_t *dst = wtx__gpu_region_at(&w->region, at, n);
  if (dst == NULL) dst = w->buf;
  int e = w->senders > 1
              ? c->Recv(dst, (size_t)n, WTX_NCCL_UINT8, sender, w->comm, w->stream)
              : c->Broadcast(dst, dst, (size_t)n, WTX_NCCL_UINT8, 0, w->comm, w->stream);
  if (e == WTX_NCCL_SUCCESS && span_sums(w))
    e = c->Recv(w->sums_dev, (size_t)n_sums * 8, WTX_NCCL_UINT8, sender, w->comm, w->stream);
  wtx_stop stop = {.flag = &w->cancelled};
  int rc = e == WTX_NCCL_SUCCESS ? wtx__cuda_wait(c, w->stream, w->comm, w->wire.timeout_ms,
                                                  &stop, err, sizeof err)
                                 : WTX_EIO;
  if (e != WTX_NCCL_SUCCESS) wtx__nccl_error(c, w->comm, e, err, sizeof err);
  if (rc != 0) {
    w->broken = 1;
    comm_release(c, &w->comm, 1);
    char from[40] = "";
    if (w->senders > 1) snprintf(from, sizeof from, " from trainer rank %d", sender);
    wtx_rx_errorf(rx, "nccl: %s of %llu bytes as rank %d%s: %s (communicator aborted)",
                  w->senders > 1 ? "receive" : "broadcast", (unsigned long long)n, w->rank,
                  from, err);
    return rc;
  }
  if (span_sums(w)) {
    if (c->Memcpy(w->sums, w->sums_dev, (size_t)n_sums * 8, WTX_CUDA_D2H) != WTX_CUDA_SUCCESS) {
      wtx_rx_errorf(rx, "nccl: reading the chunk's checksums back from the device");
      return WTX_EIO;
    }
    for (uint32_t i = 0; i < n_sums; i++) w->sums[i] = le64toh(w->sums[i]);
    int rc = wtx_rx_checksums(rx, w->sums, n_sums);
    if (rc != 0) return rc;
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
    .put_box = nccl_worker_put_box,
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

/* ---- a trainer rank of many senders (nccl_rank.h) ---- */

struct wtx__nccl_rank {
  wtx__cuda_trainer gpu; /* one buffer: a chunk at a time */
  void *comm;
  int broken;
  atomic_int cancelled;
};

int wtx__nccl_rank_open(uint64_t buffer_size, uint32_t timeout_ms, wtx__nccl_rank **out,
                        char *err, size_t errlen) {
  wtx__nccl_rank *r = calloc(1, sizeof *r);
  if (r == NULL) return WTX_ENOMEM;
  atomic_init(&r->cancelled, 0);
  int rc = wtx__cuda_trainer_open(&r->gpu, "nccl", 1, 1, buffer_size + SUMS_BYTES, timeout_ms,
                                  err, errlen);
  if (rc != 0) {
    free(r);
    return rc;
  }
  *out = r;
  return 0;
}

int wtx__nccl_rank_new_id(wtx__nccl_rank *r, uint8_t *id, char *err, size_t errlen) {
  const wtx_cuda *c = r->gpu.cuda;
  wtx_nccl_id nid;
  int e = c->GetUniqueId(&nid);
  if (e != WTX_NCCL_SUCCESS) {
    char why[300];
    snprintf(err, errlen, "nccl: ncclGetUniqueId: %s", wtx__nccl_error(c, NULL, e, why, sizeof why));
    return WTX_EUNAVAIL;
  }
  memcpy(id, &nid, WTX__NCCL_ID_BYTES);
  return 0;
}

/* The communicator is done with: aborted when it failed. */
static void rank_drop(wtx__nccl_rank *r) {
  int prev;
  wtx__cuda_enter(r->gpu.cuda, r->gpu.device, &prev);
  comm_release(r->gpu.cuda, &r->comm, r->broken);
  wtx__cuda_leave(r->gpu.cuda, prev);
  r->broken = 0;
}

int wtx__nccl_rank_join(wtx__nccl_rank *r, const uint8_t *id, int nranks, int rank, char *err,
                        size_t errlen) {
  rank_drop(r);
  wtx_nccl_id nid;
  memcpy(&nid, id, sizeof nid);
  char why[400];
  wtx_stop stop = {.flag = &r->cancelled};
  int prev;
  wtx__cuda_enter(r->gpu.cuda, r->gpu.device, &prev);
  int rc = wtx__nccl_join(r->gpu.cuda, &r->comm, nranks, &nid, rank, r->gpu.timeout_ms, &stop,
                          why, sizeof why);
  wtx__cuda_leave(r->gpu.cuda, prev);
  if (rc != 0)
    snprintf(err, errlen, "nccl: joining the communicator as trainer rank %d of %d on device "
             "%d: %s", rank, nranks, r->gpu.device, why);
  return rc;
}

int wtx__nccl_rank_ready(const wtx__nccl_rank *r) { return r->comm != NULL && !r->broken; }

/* Packs the chunk into the pinned buffer, then its span sums after it;
 * the bytes to upload. */
static uint64_t pack_chunk(uint8_t *host, const struct iovec *iov, size_t n, uint64_t bytes,
                           const uint64_t *ends, size_t n_ends, int sums) {
  for (size_t i = 0, at = 0; i < n; at += iov[i].iov_len, i++)
    memcpy(host + at, iov[i].iov_base, iov[i].iov_len);
  for (size_t i = 0; sums && i < n_ends; i++) {
    uint64_t from = i > 0 ? ends[i - 1] : 0, v = htole64(XXH3_64bits(host + from, ends[i] - from));
    memcpy(host + bytes + 8 * i, &v, 8);
  }
  return bytes + (sums ? 8 * n_ends : 0);
}

int wtx__nccl_rank_send(wtx__nccl_rank *r, int peer, const struct iovec *iov, size_t n,
                        uint64_t bytes, const uint64_t *ends, size_t n_ends, int sums,
                        char *err, size_t errlen) {
  const wtx_cuda *c = r->gpu.cuda;
  if (!wtx__nccl_rank_ready(r) || bytes + SUMS_BYTES > r->gpu.bufs.size ||
      (sums && (n_ends == 0 || n_ends > WTX_MAX_CHUNK_PARAMS || ends[n_ends - 1] != bytes))) {
    snprintf(err, errlen, "nccl: no communicator to send on, a chunk of %llu bytes over the "
             "buffer, or spans that do not end at its end", (unsigned long long)bytes);
    return WTX_ESTATE;
  }
  uint64_t total = pack_chunk(wtx__cuda_trainer_host(&r->gpu, 0), iov, n, bytes, ends, n_ends, sums);
  int rc = wtx__cuda_trainer_upload(&r->gpu, 0, total, err, errlen);
  if (rc != 0) return rc;
  int prev;
  wtx__cuda_enter(c, r->gpu.device, &prev);
  char why[400];
  wtx_stop stop = {.flag = &r->cancelled};
  uint8_t *dev = r->gpu.bufs.dev[0];
  int e = c->Send(dev, (size_t)bytes, WTX_NCCL_UINT8, peer, r->comm, r->gpu.stream);
  if (e == WTX_NCCL_SUCCESS && sums)
    e = c->Send(dev + bytes, total - bytes, WTX_NCCL_UINT8, peer, r->comm, r->gpu.stream);
  rc = e == WTX_NCCL_SUCCESS ? wtx__cuda_wait(c, r->gpu.stream, r->comm, r->gpu.timeout_ms,
                                              &stop, why, sizeof why)
                             : WTX_EIO;
  if (e != WTX_NCCL_SUCCESS) wtx__nccl_error(c, r->comm, e, why, sizeof why);
  wtx__cuda_leave(c, prev);
  if (rc != 0) {
    r->broken = 1;
    rank_drop(r); /* what unblocks the stream */
    snprintf(err, errlen, "nccl: sending %llu bytes to rank %d: %s (communicator aborted)",
             (unsigned long long)bytes, peer, why);
  }
  return rc;
}

void wtx__nccl_rank_cancel(wtx__nccl_rank *r) { atomic_store(&r->cancelled, 1); }

void wtx__nccl_rank_rearm(wtx__nccl_rank *r) { atomic_store(&r->cancelled, 0); }

void wtx__nccl_rank_destroy(wtx__nccl_rank *r) {
  if (r == NULL) return;
  rank_drop(r);
  wtx__cuda_trainer_close(&r->gpu);
  free(r);
}
