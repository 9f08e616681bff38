/* A wtx worker whose model reads its tensors on the host where they land
 * and keeps its own copy, as a loader that copies into its parameters
 * does (wtx_model_ops.adopt_chunk): the stand-in for such an engine in the
 * shm many-senders tests. Not a double of anything of wtx's: it drives the
 * real worker, session and backends through the public model interface.
 *
 * Its model adopts every tensor in place in the worker's receive region,
 * and with --in-place-only it has no staging at all (stage refuses), so a
 * sync to it succeeds only when every byte was written there by its
 * sender and never copied by the worker. At prepare it hashes each
 * adopted tensor where it lies (a tensor whose bytes there do not hash to
 * the checksum the session verified fails the update) and copies it into
 * memory of its own, which commit publishes; --sums FILE then writes the
 * version published and the hash of each tensor it serves ("version V",
 * then "NAME HEX" per tensor) for the test to compare with its own.
 *
 * Usage: host_model_worker --listen HOST:PORT --port-file FILE
 *                          [--in-place-only] [--sums FILE]
 * SIGTERM or SIGINT ends it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "tests/common/serve_model.h"
#include "wtx/worker.h"

typedef struct tensor {
  char *name;
  uint64_t nbytes;
  const uint8_t *src; /* adopted: the worker's; else data */
  uint8_t *data;      /* staged (no --in-place-only), or the copy prepare made */
  uint64_t xxh3;
  int has_xxh3;
} tensor;

typedef struct host_model {
  tensor *t; /* this update's, in staging order */
  size_t n, cap;
  tensor *pub; /* the version published */
  size_t n_pub;
  int in_place_only;
  const char *sums;
} host_model;

static void drop(tensor *t, size_t n) {
  for (size_t i = 0; i < n; i++) {
    free(t[i].name);
    free(t[i].data);
  }
}

static void m_abort(void *model) {
  host_model *m = model;
  drop(m->t, m->n);
  m->n = 0;
}

static int m_begin(void *model, wtx_target target) {
  (void)target;
  m_abort(model);
  return 0;
}

static tensor *add(host_model *m, const wtx_tensor_meta *meta) {
  if (m->n == m->cap) {
    size_t cap = m->cap ? 2 * m->cap : 64;
    tensor *t = realloc(m->t, cap * sizeof *t);
    if (t == NULL) return NULL;
    m->t = t;
    m->cap = cap;
  }
  tensor *t = &m->t[m->n];
  *t = (tensor){.name = strdup(meta->name), .nbytes = meta->nbytes};
  if (t->name == NULL) return NULL;
  m->n++;
  return t;
}

static int m_stage(void *model, const wtx_tensor_meta *meta, uint8_t **dst) {
  host_model *m = model;
  if (m->in_place_only) return WTX_ENOTSUP; /* a copy by the worker: the test fails */
  tensor *t = add(m, meta);
  if (t == NULL || (t->data = malloc(meta->nbytes ? meta->nbytes : 1)) == NULL)
    return WTX_ENOMEM;
  t->src = *dst = t->data;
  return 0;
}

static int m_adopt_chunk(void *model, const wtx_tensor_meta *metas, size_t n,
                         const uint8_t *const *src) {
  host_model *m = model;
  for (size_t i = 0; i < n; i++) {
    tensor *t = add(m, &metas[i]);
    if (t == NULL) return WTX_ENOMEM;
    t->src = src[i];
  }
  return 0;
}

static int m_loaded(void *model, const wtx_tensor_meta *meta, const uint64_t *xxh3) {
  host_model *m = model;
  for (size_t i = m->n; i-- > 0;)
    if (strcmp(m->t[i].name, meta->name) == 0) {
      m->t[i].has_xxh3 = xxh3 != NULL;
      m->t[i].xxh3 = xxh3 != NULL ? *xxh3 : 0;
      return 0;
    }
  return WTX_ENOENT;
}

/* Each tensor hashed where it lies, against what the session verified,
 * and copied: the adopted bytes are the worker's only until commit. */
static int m_prepare(void *model, const char *version, char *err, size_t errlen) {
  (void)version;
  host_model *m = model;
  for (size_t i = 0; i < m->n; i++) {
    tensor *t = &m->t[i];
    uint64_t h = XXH3_64bits(t->src, t->nbytes);
    if (t->has_xxh3 && h != t->xxh3) {
      snprintf(err, errlen, "host_model_worker: '%s' does not hash where it lies to the "
               "checksum the session verified", t->name);
      return WTX_ECHECKSUM;
    }
    t->xxh3 = h;
    if (t->data == NULL) {
      if ((t->data = malloc(t->nbytes ? t->nbytes : 1)) == NULL) return WTX_ENOMEM;
      memcpy(t->data, t->src, t->nbytes);
      t->src = t->data;
    }
  }
  return 0;
}

/* --sums: the version and each tensor's hash, replaced whole. */
static void write_sums(const host_model *m, const char *version) {
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp", m->sums);
  FILE *f = fopen(tmp, "w");
  if (f == NULL) return;
  fprintf(f, "version %s\n", version);
  for (size_t i = 0; i < m->n_pub; i++)
    fprintf(f, "%s %016llx\n", m->pub[i].name, (unsigned long long)m->pub[i].xxh3);
  if (fclose(f) == 0) rename(tmp, m->sums);
}

/* The update replaces the version published (every sync of these tests
 * sends the whole model). */
static int m_commit(void *model, const char *version) {
  host_model *m = model;
  drop(m->pub, m->n_pub);
  free(m->pub);
  m->pub = m->t;
  m->n_pub = m->n;
  m->t = NULL;
  m->n = m->cap = 0;
  if (m->sums != NULL) write_sums(m, version);
  return 0;
}

static const wtx_model_ops host_model_ops = {
    .version = WTX_MODEL_OPS_VERSION,
    .begin = m_begin,
    .stage = m_stage,
    .loaded = m_loaded,
    .prepare = m_prepare,
    .commit = m_commit,
    .abort = m_abort,
    .adopt_chunk = m_adopt_chunk,
};

int main(int argc, char **argv) {
  const char *listen = NULL, *port_file = NULL;
  host_model m = {0};
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--in-place-only") == 0) m.in_place_only = 1;
    else if (i + 1 == argc) break;
    else if (strcmp(argv[i], "--listen") == 0) listen = argv[++i];
    else if (strcmp(argv[i], "--port-file") == 0) port_file = argv[++i];
    else if (strcmp(argv[i], "--sums") == 0) m.sums = argv[++i];
    else i++; /* another flag with its value (--log-level warn): ignored */
  }
  if (listen == NULL || port_file == NULL) {
    fprintf(stderr, "usage: host_model_worker --listen HOST:PORT --port-file FILE "
            "[--in-place-only] [--sums FILE]\n");
    return 2;
  }
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.listen = listen;
  o.model_ops = &host_model_ops;
  o.model = &m;
  int rc = wtxtest_serve_model("host_model_worker", &o, port_file);
  m_abort(&m);
  free(m.t);
  drop(m.pub, m.n_pub);
  free(m.pub);
  return rc;
}
