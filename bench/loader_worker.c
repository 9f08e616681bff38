/* A worker whose model loads as an inference engine's loader does: each
 * update's tensors are received somewhere, then copied at commit into the
 * model's own parameters (vLLM's load_weights). For bench/inplace.sh.
 *
 * --in-place: the model reads each tensor where it lands
 * (wtx_model_ops.adopt_chunk): over shm with many senders, in the worker's
 * receive region, which each rank writes into. Otherwise it stages: each
 * tensor into a staging buffer of its own, kept from update to update (the
 * cheapest staging there is: no page is faulted in twice), which each
 * rank's ring is copied into. The parameters are allocated at the first
 * commit and kept; tensors come in the same order every update.
 *
 * Usage: loader_worker --listen HOST:PORT --port-file FILE [--in-place]
 * SIGTERM or SIGINT ends it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/common/serve_model.h"
#include "wtx/worker.h"

typedef struct loader {
  const uint8_t **src; /* this update's, by position */
  uint8_t **staging;   /* without --in-place, by position, kept */
  uint8_t **param;     /* by position, kept */
  uint64_t *nbytes;
  size_t n, cap, n_param;
} loader;

static int room(loader *m) {
  if (m->n < m->cap) return 0;
  size_t cap = m->cap ? 2 * m->cap : 1024;
  const uint8_t **src = realloc(m->src, cap * sizeof *src);
  if (src != NULL) m->src = src;
  uint8_t **st = src != NULL ? realloc(m->staging, cap * sizeof *st) : NULL;
  if (st != NULL) m->staging = st;
  uint8_t **p = st != NULL ? realloc(m->param, cap * sizeof *p) : NULL;
  if (p != NULL) m->param = p;
  uint64_t *nb = p != NULL ? realloc(m->nbytes, cap * sizeof *nb) : NULL;
  if (nb == NULL) return WTX_ENOMEM;
  m->nbytes = nb;
  for (size_t i = m->cap; i < cap; i++) m->staging[i] = m->param[i] = NULL;
  m->cap = cap;
  return 0;
}

static int l_begin(void *model, wtx_target target) {
  (void)target;
  ((loader *)model)->n = 0;
  return 0;
}

static int l_stage(void *model, const wtx_tensor_meta *meta, uint8_t **dst) {
  loader *m = model;
  if (room(m) != 0) return WTX_ENOMEM;
  size_t i = m->n;
  if (m->staging[i] != NULL && m->nbytes[i] != meta->nbytes) {
    free(m->staging[i]);
    m->staging[i] = NULL;
  }
  if (m->staging[i] == NULL && (m->staging[i] = malloc(meta->nbytes ? meta->nbytes : 1)) == NULL)
    return WTX_ENOMEM;
  m->nbytes[i] = meta->nbytes;
  m->src[m->n++] = *dst = m->staging[i];
  return 0;
}

static int l_adopt_chunk(void *model, const wtx_tensor_meta *metas, size_t n,
                         const uint8_t *const *src) {
  loader *m = model;
  for (size_t i = 0; i < n; i++) {
    if (room(m) != 0) return WTX_ENOMEM;
    m->nbytes[m->n] = metas[i].nbytes;
    m->src[m->n++] = src[i];
  }
  return 0;
}

static int l_loaded(void *model, const wtx_tensor_meta *meta, const uint64_t *xxh3) {
  (void)model, (void)meta, (void)xxh3;
  return 0;
}

/* The loader's copy into parameters, allocated once. */
static int l_prepare(void *model, const char *version, char *err, size_t errlen) {
  (void)version;
  loader *m = model;
  for (size_t i = 0; i < m->n; i++) {
    if (m->param[i] == NULL && (m->param[i] = malloc(m->nbytes[i] ? m->nbytes[i] : 1)) == NULL) {
      snprintf(err, errlen, "loader_worker: out of memory");
      return WTX_ENOMEM;
    }
    memcpy(m->param[i], m->src[i], m->nbytes[i]);
  }
  return 0;
}

static int l_commit(void *model, const char *version) {
  (void)model, (void)version;
  return 0;
}

static void l_abort(void *model) { ((loader *)model)->n = 0; }

int main(int argc, char **argv) {
  const char *listen = NULL, *port_file = NULL;
  int in_place = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--in-place") == 0) in_place = 1;
    else if (i + 1 == argc) break;
    else if (strcmp(argv[i], "--listen") == 0) listen = argv[++i];
    else if (strcmp(argv[i], "--port-file") == 0) port_file = argv[++i];
  }
  if (listen == NULL || port_file == NULL) {
    fprintf(stderr, "usage: loader_worker --listen HOST:PORT --port-file FILE [--in-place]\n");
    return 2;
  }
  loader m = {0};
  wtx_model_ops ops = {
      .version = WTX_MODEL_OPS_VERSION,
      .begin = l_begin,
      .stage = l_stage,
      .loaded = l_loaded,
      .prepare = l_prepare,
      .commit = l_commit,
      .abort = l_abort,
      .adopt_chunk = in_place ? l_adopt_chunk : NULL,
  };
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.listen = listen;
  o.model_ops = &ops;
  o.model = &m;
  int rc = wtxtest_serve_model("loader_worker", &o, port_file);
  for (size_t i = 0; i < m.cap; i++) {
    free(m.staging[i]);
    free(m.param[i]);
  }
  free(m.src);
  free(m.staging);
  free(m.param);
  free(m.nbytes);
  return rc;
}
