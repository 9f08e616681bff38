/* Copying a chunk out of device memory into the model's staging (gpu_out.h). */
#include "transport/gpu_out.h"

#include <stdio.h>
#include <string.h>

#include "common/log.h"

int wtx__gpu_out_open(wtx__gpu_out *g, const wtx_cuda *c, uint32_t timeout_ms) {
  memset(g, 0, sizeof *g);
  g->cuda = c;
  g->timeout_ms = timeout_ms;
  int e = c->StreamCreate(&g->stream);
  if (e != WTX_CUDA_SUCCESS) g->stream = NULL;
  return e;
}

void wtx__gpu_out_close(wtx__gpu_out *g) {
  if (g->cuda == NULL) return;
  if (g->bounce != NULL) g->cuda->FreeHost(g->bounce);
  if (g->stream != NULL) g->cuda->StreamDestroy(g->stream);
  memset(g, 0, sizeof *g);
}

/* The pinned bounce buffer, allocated on first need; 0 or a CUDA error. */
static int bounce(wtx__gpu_out *g) {
  if (g->bounce != NULL) return WTX_CUDA_SUCCESS;
  int e = g->cuda->MallocHost((void **)&g->bounce, WTX__GPU_BOUNCE);
  if (e != WTX_CUDA_SUCCESS) g->bounce = NULL;
  return e;
}

static int to_host(wtx__gpu_out *g, const uint8_t *src, const char *who, wtx_rx *rx) {
  const wtx_cuda *c = g->cuda;
  for (;;) {
    uint8_t *dst;
    size_t room = wtx_rx_next(rx, &dst), n = room;
    if (room == 0) return 0;
    /* Without pinned memory (MallocHost failed), tensor by tensor. */
    int bounced = room < WTX__GPU_SMALL && bounce(g) == WTX_CUDA_SUCCESS;
    if (bounced) {
      uint64_t left = wtx_rx_remaining(rx);
      n = left < WTX__GPU_BOUNCE ? (size_t)left : WTX__GPU_BOUNCE;
      dst = g->bounce;
    }
    /* Device to host: cudaMemcpy returns once the bytes are there. */
    int e = c->Memcpy(dst, src, n, WTX_CUDA_D2H);
    if (e != WTX_CUDA_SUCCESS) {
      wtx_rx_errorf(rx, "%s: copy out: %s", who, c->GetErrorString(e));
      return WTX_EIO;
    }
    src += n;
    int rc = bounced ? wtx_rx_bytes(rx, dst, n) : wtx_rx_commit(rx, n);
    if (rc != 0) return rc;
  }
}

/* Queues the device-to-device copies of n bytes at src into the tensors
 * rx names next; host: a host copy of them to hash, or NULL. 0, a CUDA
 * error (*e) or an rx error. */
static int queue_piece(wtx__gpu_out *g, const uint8_t *src, size_t n, const uint8_t *host,
                       wtx_rx *rx, int *e) {
  for (size_t done = 0, k; done < n; done += k) {
    uint8_t *dst;
    if ((k = wtx_rx_next(rx, &dst)) == 0) return WTX_EPROTO; /* never: n <= remaining */
    if (k > n - done) k = n - done;
    /* Staged in place (a direct receive into a model that adopts it): the
     * bytes are already there. */
    if (dst != src + done)
      *e = g->cuda->MemcpyAsync(dst, src + done, k, WTX_CUDA_D2D, g->stream);
    if (*e != WTX_CUDA_SUCCESS) return WTX_EIO;
    int rc = wtx_rx_commit_device(rx, k, host != NULL ? host + done : NULL);
    if (rc != 0) return rc;
  }
  return 0;
}

static int to_device(wtx__gpu_out *g, const uint8_t *src, const char *who, wtx_rx *rx) {
  const wtx_cuda *c = g->cuda;
  int verify = wtx_rx_verifying(rx), rc = 0, e = WTX_CUDA_SUCCESS;
  if (verify && (e = bounce(g)) != WTX_CUDA_SUCCESS) {
    wtx_rx_errorf(rx, "%s: pinned memory to hash device staging: %s", who,
                  c->GetErrorString(e));
    return WTX_ENOMEM;
  }
  for (uint64_t left; rc == 0 && (left = wtx_rx_remaining(rx)) > 0; ) {
    size_t n = verify && left > WTX__GPU_BOUNCE ? WTX__GPU_BOUNCE : (size_t)left;
    if (verify && (e = c->Memcpy(g->bounce, src, n, WTX_CUDA_D2H)) != WTX_CUDA_SUCCESS) {
      rc = WTX_EIO;
      break;
    }
    rc = queue_piece(g, src, n, verify ? g->bounce : NULL, rx, &e);
    src += n;
  }
  /* Whatever happened, nothing queued may land after receive returns. */
  char why[300];
  int waited = wtx__cuda_wait(c, g->stream, NULL, g->timeout_ms, NULL, why, sizeof why);
  if (e != WTX_CUDA_SUCCESS)
    wtx_rx_errorf(rx, "%s: copy into device staging: %s", who, c->GetErrorString(e));
  else if (rc == 0 && waited != 0)
    wtx_rx_errorf(rx, "%s: copy into device staging: %s", who, why);
  return rc != 0 ? rc : waited;
}

int wtx__gpu_out_copy(wtx__gpu_out *g, const uint8_t *src, const char *who, wtx_rx *rx) {
  return wtx_rx_on_device(rx) ? to_device(g, src, who, rx) : to_host(g, src, who, rx);
}

typedef struct box_arg {
  wtx__gpu_out *g;
  uint8_t *dst;
  const uint8_t *src;
  size_t es;
  int e; /* the first CUDA error */
} box_arg;

static int box_run(void *arg, uint64_t in_dst, uint64_t in_src, uint64_t n) {
  box_arg *b = arg;
  b->e = b->g->cuda->MemcpyAsync(b->dst + in_dst * b->es, b->src + in_src * b->es, n * b->es,
                                 WTX_CUDA_H2D, b->g->stream);
  return b->e != WTX_CUDA_SUCCESS;
}

int wtx__gpu_out_box(wtx__gpu_out *g, int device, void *dst, const wtx_box *whole,
                     const void *src, const wtx_box *box, size_t es, const char *who, char *err,
                     size_t errlen) {
  box_arg b = {g, dst, src, es, WTX_CUDA_SUCCESS};
  int prev;
  wtx__cuda_enter(g->cuda, device, &prev);
  wtx_box_runs(whole, NULL, box, box_run, &b);
  /* Whatever happened, nothing queued may land after this returns. */
  char why[300];
  int waited = wtx__cuda_wait(g->cuda, g->stream, NULL, g->timeout_ms, NULL, why, sizeof why);
  wtx__cuda_leave(g->cuda, prev);
  if (b.e != WTX_CUDA_SUCCESS)
    snprintf(err, errlen, "%s: box into device staging: %s", who, g->cuda->GetErrorString(b.e));
  else if (waited != 0)
    snprintf(err, errlen, "%s: box into device staging: %s", who, why);
  return b.e != WTX_CUDA_SUCCESS ? WTX_EIO : waited;
}

void wtx__gpu_region_drop(wtx__gpu_region *r, const wtx_cuda *c, const char *who,
                          const char *why) {
  if (r->base != NULL) c->Free(r->base);
  r->base = NULL;
  if (why != NULL)
    wtx__log(WTX__LOG_WARN, "event=direct_declined backend=%s bytes=%llu reason=\"%s\"", who,
            (unsigned long long)r->bytes, why);
}

void wtx__gpu_region_open(wtx__gpu_region *r, const wtx_cuda *c, const char *who) {
  if (r->bytes == 0) return;
  if (r->max > 0 && r->bytes > r->max) {
    char why[80];
    snprintf(why, sizeof why, "over --max-model-bytes %llu", (unsigned long long)r->max);
    wtx__gpu_region_drop(r, c, who, why);
    return;
  }
  int e = c->Malloc((void **)&r->base, (size_t)r->bytes);
  if (e != WTX_CUDA_SUCCESS) {
    r->base = NULL;
    wtx__gpu_region_drop(r, c, who, c->GetErrorString(e));
  }
}

uint8_t *wtx__gpu_region_at(const wtx__gpu_region *r, uint64_t at, uint64_t n) {
  if (r->base == NULL || at > r->bytes || n > r->bytes - at) return NULL;
  return r->base + at;
}

int wtx__gpu_region_get(const wtx__gpu_region *r, uint8_t **base, uint64_t *bytes) {
  if (r->base == NULL) return WTX_ENOENT;
  *base = r->base;
  *bytes = r->bytes;
  return 0;
}
