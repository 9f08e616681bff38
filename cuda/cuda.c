/* Run-time loading of the CUDA runtime and NCCL (see cuda.h). */
#include "cuda/cuda.h"

#include <dlfcn.h>
#include <stddef.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/clock.h"
#include "wtx/error.h"

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static wtx_cuda api;
static int have_rt, have_nccl;
static char load_err[600];

static void *open_first(const char *env, const char *const *names, char *tried,
                        size_t len) {
  const char *e = getenv(env);
  if (e != NULL && e[0] != '\0') {
    void *h = dlopen(e, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) snprintf(tried, len, "%s=%s: %s", env, e, dlerror());
    return h;
  }
  size_t o = 0;
  for (size_t i = 0; names[i] != NULL; i++) {
    void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (h != NULL) return h;
    o += (size_t)snprintf(tried + o, o < len ? len - o : 0, "%s%s", i ? ", " : "",
                          names[i]);
  }
  return NULL;
}

/* The entry points of each library, by the field of api they fill. */
typedef struct sym {
  size_t off; /* of the field in wtx_cuda */
  const char *name;
} sym;
#define SYM(field, name) {offsetof(wtx_cuda, field), name}
static const sym rt_syms[] = {
    SYM(SetDevice, "cudaSetDevice"),
    SYM(GetDevice, "cudaGetDevice"),
    SYM(GetDeviceProperties, "cudaGetDeviceProperties"),
    SYM(Malloc, "cudaMalloc"),
    SYM(Free, "cudaFree"),
    SYM(MallocHost, "cudaMallocHost"),
    SYM(FreeHost, "cudaFreeHost"),
    SYM(Memcpy, "cudaMemcpy"),
    SYM(MemcpyAsync, "cudaMemcpyAsync"),
    SYM(StreamCreate, "cudaStreamCreate"),
    SYM(StreamDestroy, "cudaStreamDestroy"),
    SYM(StreamQuery, "cudaStreamQuery"),
    SYM(StreamSynchronize, "cudaStreamSynchronize"),
    SYM(IpcGetMemHandle, "cudaIpcGetMemHandle"),
    SYM(IpcOpenMemHandle, "cudaIpcOpenMemHandle"),
    SYM(IpcCloseMemHandle, "cudaIpcCloseMemHandle"),
    SYM(GetErrorString, "cudaGetErrorString"),
};
static const sym nccl_syms[] = {
    SYM(GetUniqueId, "ncclGetUniqueId"),
    SYM(CommInitRankConfig, "ncclCommInitRankConfig"),
    SYM(Broadcast, "ncclBroadcast"),
    SYM(Send, "ncclSend"),
    SYM(Recv, "ncclRecv"),
    SYM(CommGetAsyncError, "ncclCommGetAsyncError"),
    SYM(CommAbort, "ncclCommAbort"),
    SYM(CommDestroy, "ncclCommDestroy"),
    SYM(NcclErrorString, "ncclGetErrorString"),
    SYM(NcclLastError, "ncclGetLastError"),
};
#undef SYM

/* Fills api's fields that the n entries of t name from library h: NULL, or
 * the first name h lacks. Caller holds mu. */
static const char *load_syms(void *h, const sym *t, size_t n) {
  for (size_t i = 0; i < n; i++) {
    void *p = dlsym(h, t[i].name);
    if (p == NULL) return t[i].name;
    memcpy((char *)&api + t[i].off, &p, sizeof p); /* POSIX: data and code pointers alike */
  }
  return NULL;
}

int wtx__cuda_load(int with_nccl, const wtx_cuda **out, char *err, size_t errlen) {
  pthread_mutex_lock(&mu);
  const char *missing = NULL;
  char tried[400] = "";
  if (!have_rt) { /* a failure is not kept: the next call tries again */
    load_err[0] = '\0';
    static const char *const rt[] = {"libcudart.so.13", "libcudart.so.12",
                                     "libcudart.so", NULL};
    void *h = open_first("WTX_CUDART_LIB", rt, tried, sizeof tried);
    if (h == NULL) {
      snprintf(load_err, sizeof load_err, "CUDA runtime not found (tried %s); "
               "install CUDA or set WTX_CUDART_LIB", tried);
    } else {
      missing = load_syms(h, rt_syms, sizeof rt_syms / sizeof *rt_syms);
      if (missing != NULL)
        snprintf(load_err, sizeof load_err, "CUDA runtime lacks %s", missing);
      else
        have_rt = 1;
    }
  }
  int rc = have_rt ? 0 : WTX_EUNAVAIL;
  if (rc != 0) snprintf(err, errlen, "%s", load_err);
  if (rc == 0 && with_nccl && !have_nccl) {
    static const char *const nc[] = {"libnccl.so.2", "libnccl.so", NULL};
    void *h = open_first("WTX_NCCL_LIB", nc, tried, sizeof tried);
    missing = NULL;
    if (h == NULL) {
      snprintf(err, errlen, "NCCL not found (tried %s); install NCCL or set "
               "WTX_NCCL_LIB", tried);
      rc = WTX_EUNAVAIL;
    } else {
      missing = load_syms(h, nccl_syms, sizeof nccl_syms / sizeof *nccl_syms);
      if (missing != NULL) {
        snprintf(err, errlen, "NCCL lacks %s", missing);
        rc = WTX_EUNAVAIL;
      } else {
        have_nccl = 1;
      }
    }
  }
  pthread_mutex_unlock(&mu);
  *out = rc == 0 ? &api : NULL;
  return rc;
}

int wtx__cuda_uuid(const wtx_cuda *c, int device, uint8_t uuid[16]) {
  /* cudaDeviceProp begins with char name[256] then the 16-byte uuid; the
   * rest of the struct (about 1 KiB, growing by version) is not read. */
  static _Thread_local unsigned char prop[16384];
  int e = c->GetDeviceProperties(prop, device);
  if (e != WTX_CUDA_SUCCESS) return WTX_EUNAVAIL;
  memcpy(uuid, prop + 256, 16);
  return 0;
}

int wtx__cuda_device(const char *ordinal, int *out, char *err, size_t errlen) {
  const char *from = "cuda_device";
  if (ordinal == NULL) {
    from = "WTX_CUDA_DEVICE";
    ordinal = getenv(from);
    if (ordinal == NULL || ordinal[0] == '\0') ordinal = "0";
  }
  size_t n = strspn(ordinal, "0123456789");
  if (n == 0 || n > 4 || ordinal[n] != '\0') {
    snprintf(err, errlen, "%s: not a device ordinal (0, 1, ...)", from);
    return WTX_EINVAL;
  }
  *out = atoi(ordinal);
  return 0;
}

int wtx__cuda_enter(const wtx_cuda *c, int device, int *prev) {
  if (c->GetDevice(prev) != WTX_CUDA_SUCCESS) *prev = -1;
  return c->SetDevice(device);
}

void wtx__cuda_leave(const wtx_cuda *c, int prev) {
  if (prev >= 0) c->SetDevice(prev);
}

const char *wtx__nccl_error(const wtx_cuda *c, void *comm, int result, char *buf,
                            size_t len) {
  const char *detail = c->NcclLastError != NULL ? c->NcclLastError(comm) : NULL;
  snprintf(buf, len, "%s%s%s", c->NcclErrorString(result),
           detail != NULL && detail[0] != '\0' ? ": " : "", detail != NULL ? detail : "");
  return buf;
}

static void pause_200us(void) {
  struct timespec ts = {0, 200000};
  nanosleep(&ts, NULL);
}

int wtx__nccl_join(const wtx_cuda *c, void **comm, int nranks, const wtx_nccl_id *id,
                   int rank, uint32_t timeout_ms, const wtx_stop *stop,
                   char *err, size_t errlen) {
  wtx_nccl_config cfg = {sizeof cfg, WTX_NCCL_CONFIG_MAGIC, WTX_NCCL_CONFIG_VERSION, 0,
                         INT_MIN, INT_MIN, INT_MIN, NULL};
  *comm = NULL;
  int e = c->CommInitRankConfig(comm, nranks, *id, rank, &cfg);
  int64_t until = wtx__clock_ms() + timeout_ms;
  int rc = 0;
  char why[400];
  while (rc == 0 && e == WTX_NCCL_IN_PROGRESS) {
    if (*comm == NULL || c->CommGetAsyncError(*comm, &e) != WTX_NCCL_SUCCESS) break;
    if (e != WTX_NCCL_IN_PROGRESS) break;
    if (wtx_stop_now(stop)) rc = WTX_ECANCELED;
    else if (wtx__clock_ms() >= until) rc = WTX_ETIMEDOUT;
    else pause_200us();
  }
  if (rc == 0 && e == WTX_NCCL_SUCCESS) return 0;
  if (rc == WTX_ECANCELED) snprintf(why, sizeof why, "cancelled");
  else if (rc == WTX_ETIMEDOUT)
    snprintf(why, sizeof why, "not every rank joined within %u ms", timeout_ms);
  else wtx__nccl_error(c, *comm, e, why, sizeof why);
  snprintf(err, errlen, "%s", why);
  if (*comm != NULL) c->CommAbort(*comm); /* ends NCCL's init threads too */
  *comm = NULL;
  return rc != 0 ? rc : WTX_EUNAVAIL;
}

/* 1 (err says why) when comm (may be NULL) reports an asynchronous error. */
static int comm_failed(const wtx_cuda *c, void *comm, char *err, size_t errlen) {
  int ae = WTX_NCCL_SUCCESS;
  if (comm == NULL || c->CommGetAsyncError(comm, &ae) != WTX_NCCL_SUCCESS ||
      ae == WTX_NCCL_SUCCESS || ae == WTX_NCCL_IN_PROGRESS)
    return 0;
  char why[400];
  snprintf(err, errlen, "NCCL: %s", wtx__nccl_error(c, comm, ae, why, sizeof why));
  return 1;
}

int wtx__cuda_wait(const wtx_cuda *c, void *stream, void *comm,
                   uint32_t timeout_ms, const wtx_stop *stop, char *err,
                   size_t errlen) {
  int64_t until = wtx__clock_ms() + timeout_ms;
  for (;;) {
    int q = c->StreamQuery(stream);
    /* A collective whose peer failed can end early on the stream with
     * garbage in its buffer: done means done without an async error. */
    if (q == WTX_CUDA_SUCCESS && comm_failed(c, comm, err, errlen)) return WTX_EIO;
    if (q == WTX_CUDA_SUCCESS) return 0;
    if (q != WTX_CUDA_NOT_READY) {
      snprintf(err, errlen, "CUDA stream: %s", c->GetErrorString(q));
      return WTX_EIO;
    }
    if (comm_failed(c, comm, err, errlen)) return WTX_EIO;
    if (wtx_stop_now(stop)) {
      snprintf(err, errlen, "cancelled");
      return WTX_ECANCELED;
    }
    if (wtx__clock_ms() >= until) {
      snprintf(err, errlen, "no progress within %u ms (a peer is gone?)", timeout_ms);
      return WTX_ETIMEDOUT;
    }
    pause_200us();
  }
}

static void buffers_destroy(wtx__cuda_buffers *b) {
  for (uint32_t k = 0; b->dev != NULL && k < b->n; k++)
    if (b->dev[k] != NULL) b->cuda->Free(b->dev[k]);
  free(b->dev);
  if (b->host != NULL) b->cuda->FreeHost(b->host);
  memset(b, 0, sizeof *b);
}

/* num pinned host buffers and num device buffers of size bytes on the
 * current device. */
static int buffers_create(const wtx_cuda *c, uint32_t n, uint64_t size,
                          wtx__cuda_buffers *b, char *why, size_t len) {
  memset(b, 0, sizeof *b);
  b->cuda = c;
  b->n = n;
  b->size = size;
  b->dev = calloc(n, sizeof *b->dev);
  int e = b->dev != NULL ? c->MallocHost((void **)&b->host, (size_t)(size * n))
                         : WTX_CUDA_SUCCESS;
  if (b->dev == NULL || e != WTX_CUDA_SUCCESS) {
    b->host = NULL;
    snprintf(why, len, "cannot allocate %u pinned host buffers of %llu bytes%s%s", n,
             (unsigned long long)size, e ? ": " : "", e ? c->GetErrorString(e) : "");
    buffers_destroy(b);
    return WTX_ENOMEM;
  }
  for (uint32_t k = 0; k < n; k++) {
    if ((e = c->Malloc(&b->dev[k], (size_t)size)) != WTX_CUDA_SUCCESS) {
      b->dev[k] = NULL;
      snprintf(why, len, "cannot allocate %u device buffers of %llu bytes: %s", n,
               (unsigned long long)size, c->GetErrorString(e));
      buffers_destroy(b);
      return WTX_EUNAVAIL;
    }
  }
  return 0;
}

int wtx__cuda_trainer_open(wtx__cuda_trainer *t, const char *who, int with_nccl,
                           uint32_t num, uint64_t size, uint32_t timeout_ms,
                           char *err, size_t errlen) {
  memset(t, 0, sizeof *t);
  int rc = wtx__cuda_load(with_nccl, &t->cuda, err, errlen);
  if (rc != 0) return rc;
  const wtx_cuda *c = t->cuda;
  if ((rc = wtx__cuda_device(NULL, &t->device, err, errlen)) != 0) return rc;
  t->timeout_ms = timeout_ms;
  char why[300] = "";
  int prev;
  int e = wtx__cuda_enter(c, t->device, &prev);
  if (e == WTX_CUDA_SUCCESS) e = c->StreamCreate(&t->stream);
  if (e != WTX_CUDA_SUCCESS) {
    t->stream = NULL;
    snprintf(why, sizeof why, "%s", c->GetErrorString(e));
  } else {
    buffers_create(c, num, size, &t->bufs, why, sizeof why);
  }
  t->pieces = calloc(num, sizeof *t->pieces);
  if (why[0] == '\0' && t->pieces == NULL) snprintf(why, sizeof why, "out of memory");
  wtx__cuda_leave(c, prev);
  if (why[0] == '\0') return 0;
  snprintf(err, errlen, "%s: device %d: %s", who, t->device, why);
  wtx__cuda_trainer_close(t);
  return WTX_EUNAVAIL;
}

void wtx__cuda_trainer_close(wtx__cuda_trainer *t) {
  if (t->cuda == NULL) return;
  for (uint32_t k = 0; t->pieces != NULL && k < t->bufs.n; k++) free(t->pieces[k].p);
  int prev;
  wtx__cuda_enter(t->cuda, t->device, &prev); /* frees belong to its device */
  if (t->bufs.cuda != NULL) buffers_destroy(&t->bufs);
  if (t->stream != NULL) t->cuda->StreamDestroy(t->stream);
  wtx__cuda_leave(t->cuda, prev);
  free(t->pieces);
  memset(t, 0, sizeof *t);
}

uint8_t *wtx__cuda_trainer_host(wtx__cuda_trainer *t, uint32_t k) {
  return t->bufs.host + k * t->bufs.size;
}

int wtx__cuda_trainer_put_device(wtx__cuda_trainer *t, uint32_t k, uint64_t offset,
                                 const void *src, uint64_t len) {
  wtx__cuda_pieces *ps = &t->pieces[k];
  if (ps->n == ps->cap) {
    size_t cap = ps->cap ? 2 * ps->cap : 16;
    wtx__cuda_piece *p = realloc(ps->p, cap * sizeof *p);
    if (p == NULL) return WTX_ENOMEM;
    ps->p = p;
    ps->cap = cap;
  }
  ps->p[ps->n++] = (wtx__cuda_piece){offset, len, src};
  return 0;
}

/* Enqueues buffer k's chunk of bytes on the stream into dev: host ranges
 * from host buffer k, device ranges device to device. */
static int enqueue_upload(wtx__cuda_trainer *t, uint32_t k, uint8_t *dev, uint64_t bytes) {
  const wtx_cuda *c = t->cuda;
  const uint8_t *host = wtx__cuda_trainer_host(t, k);
  uint64_t at = 0;
  int e = WTX_CUDA_SUCCESS;
  const wtx__cuda_pieces *ps = &t->pieces[k];
  for (size_t i = 0; e == WTX_CUDA_SUCCESS && i <= ps->n; i++) {
    const wtx__cuda_piece *p = i < ps->n ? &ps->p[i] : NULL;
    uint64_t end = p != NULL ? p->offset : bytes;
    if (end > at)
      e = c->MemcpyAsync(dev + at, host + at, (size_t)(end - at), WTX_CUDA_H2D, t->stream);
    if (p != NULL && e == WTX_CUDA_SUCCESS && p->len > 0)
      e = c->MemcpyAsync(dev + p->offset, p->src, (size_t)p->len, WTX_CUDA_D2D, t->stream);
    if (p != NULL) at = p->offset + p->len;
  }
  return e;
}

int wtx__cuda_trainer_upload_to(wtx__cuda_trainer *t, uint32_t k, void *const *dsts,
                                size_t n_dsts, uint64_t bytes, char *err, size_t errlen) {
  const wtx_cuda *c = t->cuda;
  int prev;
  int e = wtx__cuda_enter(c, t->device, &prev);
  for (size_t d = 0; e == WTX_CUDA_SUCCESS && d < n_dsts; d++)
    e = enqueue_upload(t, k, dsts[d], bytes);
  t->pieces[k].n = 0;
  char why[300];
  /* Waited for even after a failed enqueue: nothing may land later. */
  int rc = wtx__cuda_wait(c, t->stream, NULL, t->timeout_ms, NULL, why, sizeof why);
  if (e != WTX_CUDA_SUCCESS) {
    rc = WTX_EIO;
    snprintf(why, sizeof why, "%s", c->GetErrorString(e));
  }
  wtx__cuda_leave(c, prev);
  if (rc != 0) snprintf(err, errlen, "copy of buffer %u's chunk on device %d: %s", k,
                        t->device, why);
  return rc;
}

int wtx__cuda_trainer_upload(wtx__cuda_trainer *t, uint32_t k, uint64_t bytes, char *err,
                             size_t errlen) {
  void *dev = t->bufs.dev[k];
  return wtx__cuda_trainer_upload_to(t, k, &dev, 1, bytes, err, errlen);
}
