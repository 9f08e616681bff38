/* A wtx worker whose model lives on the GPU, as an inference engine's does:
 * the stand-in for vLLM in the GPU backends' tests (engine_test on the CUDA
 * TEST DOUBLE; on a real GPU, the same). Not a double of anything of wtx's:
 * it drives the real worker, session and backends through the public model
 * interface.
 *
 * Its model stages every tensor in device memory (wtx_model_ops.
 * stage_device) on the device the backend names, and refuses host staging,
 * so a push to it succeeds only when the bytes went device to device; when
 * the trainer writes into the worker's receive region (cuda_ipc direct), it
 * adopts its tensors there instead (adopt_device), and with --in-place-only
 * it has no other staging (no stage_device), so a push succeeds only when
 * the trainer's copy was the only one. At
 * prepare it copies each staged tensor back to the host and hashes it: a
 * tensor whose device bytes do not hash to the checksum the session
 * verified fails the update. With checksums off (the GPU backends'
 * default) the session verifies nothing, so --sums FILE writes those
 * hashes at each commit ("version V", then "NAME HEX" per tensor) for the
 * test to compare with its own; without --sums, run it with checksums on.
 *
 * --read: the model keeps the version it published on the device (each
 * commit replaces the tensors the update staged, copying those adopted in
 * the receive region), reads them back for a delta's patches
 * (wtx_model_ops.read, device to host), and --sums then lists every
 * tensor it serves, not only those the update staged.
 *
 * Usage: gpu_model_worker --listen HOST:PORT --port-file FILE [--no-check]
 *                         [--in-place-only] [--read] [--sums FILE]
 * (the CUDA runtime as the worker finds it: WTX_CUDART_LIB, ...; the
 * device from WTX_CUDA_DEVICE). --no-check, for throughput figures: prepare
 * trusts the staging (checksums may then be off). SIGTERM or SIGINT ends
 * it. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "cuda/cuda.h"
#include "tests/common/serve_model.h"
#include "wtx/worker.h"

typedef struct staged {
  wtx_tensor_meta meta; /* name: owned copy */
  void *dev;
  int owned; /* dev is ours (stage_device), not the worker's (adopt_device) */
  uint64_t xxh3;
  int has_xxh3;
  uint64_t seen; /* the hash of its device bytes, at prepare */
} staged;

typedef struct gpu_model {
  const wtx_cuda *cuda;
  staged *t;
  size_t n, cap;
  size_t loaded; /* tensors loaded so far: the session loads in staging order */
  int device;
  int no_check;
  int in_place_only;
  int read; /* --read */
  const char *sums; /* --sums FILE, or NULL */
  /* --read: the version published, each tensor's device memory its own
   * (owned), in the order first published. */
  staged *pub;
  size_t n_pub, cap_pub;
} gpu_model;

static void drop_staged(gpu_model *m) {
  int prev;
  wtx__cuda_enter(m->cuda, m->device, &prev);
  for (size_t i = 0; i < m->n; i++) {
    if (m->t[i].owned && m->t[i].dev != NULL) m->cuda->Free(m->t[i].dev);
    free((char *)m->t[i].meta.name);
  }
  wtx__cuda_leave(m->cuda, prev);
  m->n = m->loaded = 0;
}

static int m_begin(void *model, wtx_target target) {
  (void)target;
  drop_staged(model);
  return 0;
}

static int m_stage(void *model, const wtx_tensor_meta *meta, uint8_t **dst) {
  (void)model;
  (void)dst;
  fprintf(stderr, "gpu_model_worker: '%s' staged in host memory, not on the GPU\n", meta->name);
  return WTX_EINVAL;
}

/* A new entry for meta (name copied); NULL when out of memory. */
static staged *add_staged(gpu_model *m, const wtx_tensor_meta *meta, int device) {
  if (m->n == m->cap) {
    size_t cap = m->cap ? 2 * m->cap : 64;
    staged *t = realloc(m->t, cap * sizeof *t);
    if (t == NULL) return NULL;
    m->t = t;
    m->cap = cap;
  }
  staged *s = &m->t[m->n];
  memset(s, 0, sizeof *s);
  s->meta = *meta;
  s->meta.name = strdup(meta->name);
  if (s->meta.name == NULL) return NULL;
  m->device = device;
  m->n++;
  return s;
}

static int m_adopt_device(void *model, const wtx_tensor_meta *meta, int device,
                          const void *src) {
  staged *s = add_staged(model, meta, device);
  if (s == NULL) return WTX_ENOMEM;
  s->dev = (void *)src; /* read only; the worker's until commit returns */
  return 0;
}

static int m_stage_device(void *model, const wtx_tensor_meta *meta, int device, void **dst) {
  gpu_model *m = model;
  staged *s = add_staged(m, meta, device);
  if (s == NULL) return WTX_ENOMEM;
  s->owned = 1;
  int prev;
  int e = wtx__cuda_enter(m->cuda, device, &prev);
  if (e == WTX_CUDA_SUCCESS) e = m->cuda->Malloc(&s->dev, meta->nbytes ? meta->nbytes : 1);
  wtx__cuda_leave(m->cuda, prev);
  if (e != WTX_CUDA_SUCCESS) {
    s->dev = NULL;
    return WTX_ENOMEM;
  }
  *dst = s->dev;
  return 0;
}

/* The session loads tensors in the order it staged them: the next one, by
 * name (a tensor loaded out of that order is an error here). */
static int m_loaded(void *model, const wtx_tensor_meta *meta, const uint64_t *xxh3) {
  gpu_model *m = model;
  if (m->loaded >= m->n || strcmp(m->t[m->loaded].meta.name, meta->name) != 0) {
    fprintf(stderr, "gpu_model_worker: '%s' loaded out of staging order\n", meta->name);
    return WTX_ENOENT;
  }
  staged *s = &m->t[m->loaded++];
  s->has_xxh3 = xxh3 != NULL;
  s->xxh3 = xxh3 != NULL ? *xxh3 : 0;
  return 0;
}

/* Hashes staged tensor s's device bytes (a copy to the host) into
 * s->seen; it must match what the session verified, when it verified. */
static int hash_device(gpu_model *m, staged *s, char *err, size_t errlen) {
  uint8_t *host = malloc(s->meta.nbytes ? s->meta.nbytes : 1);
  int copied = host != NULL &&
               (s->meta.nbytes == 0 ||
                m->cuda->Memcpy(host, s->dev, s->meta.nbytes, WTX_CUDA_D2H) == WTX_CUDA_SUCCESS);
  if (copied) s->seen = XXH3_64bits(host, s->meta.nbytes);
  free(host);
  if (!copied) {
    snprintf(err, errlen, "'%s': cannot copy its device staging to the host", s->meta.name);
    return WTX_EIO;
  }
  if (s->has_xxh3 ? s->seen == s->xxh3 : m->sums != NULL) return 0;
  snprintf(err, errlen, "'%s': its device staging does not hold the bytes the session "
           "verified%s", s->meta.name, s->has_xxh3 ? "" : " (no checksum: turn them on)");
  return WTX_ECHECKSUM;
}

static int m_prepare(void *model, const char *version, char *err, size_t errlen) {
  (void)version;
  gpu_model *m = model;
  int rc = 0, prev;
  if (m->no_check) return 0;
  wtx__cuda_enter(m->cuda, m->device, &prev);
  for (size_t i = 0; rc == 0 && i < m->n; i++) rc = hash_device(m, &m->t[i], err, errlen);
  wtx__cuda_leave(m->cuda, prev);
  return rc;
}

/* --sums: the version and each tensor's device hash, replaced whole. */
static void write_sums(const gpu_model *m, const char *version) {
  char tmp[4200];
  snprintf(tmp, sizeof tmp, "%s.tmp", m->sums);
  FILE *f = fopen(tmp, "w");
  if (f == NULL) return;
  fprintf(f, "version %s\n", version);
  const staged *t = m->read ? m->pub : m->t;
  for (size_t i = 0; i < (m->read ? m->n_pub : m->n); i++)
    fprintf(f, "%s %016llx\n", t[i].meta.name, (unsigned long long)t[i].seen);
  if (fclose(f) == 0) rename(tmp, m->sums);
}

/* --read: staged tensor s replaces its name's in the published version
 * (appended when new); the device memory becomes the version's, a copy
 * where s was adopted in the receive region (the worker's). */
static int publish_one(gpu_model *m, staged *s) {
  size_t i = 0;
  while (i < m->n_pub && strcmp(m->pub[i].meta.name, s->meta.name) != 0) i++;
  if (i == m->n_pub && m->n_pub == m->cap_pub) {
    size_t cap = m->cap_pub ? 2 * m->cap_pub : 64;
    staged *p = realloc(m->pub, cap * sizeof *p);
    if (p == NULL) return WTX_ENOMEM;
    m->pub = p;
    m->cap_pub = cap;
  }
  void *dev = s->dev;
  if (!s->owned && m->cuda->Malloc(&dev, s->meta.nbytes ? s->meta.nbytes : 1) != 0)
    return WTX_ENOMEM;
  if (!s->owned && m->cuda->Memcpy(dev, s->dev, s->meta.nbytes, WTX_CUDA_D2D) != 0) {
    m->cuda->Free(dev);
    return WTX_EIO;
  }
  if (i < m->n_pub) {
    m->cuda->Free(m->pub[i].dev);
    free((char *)m->pub[i].meta.name);
  } else {
    m->n_pub++;
  }
  m->pub[i] = *s;
  m->pub[i].owned = 1;
  m->pub[i].dev = dev;
  s->meta.name = strdup(s->meta.name); /* the staged entry's, freed with it */
  s->owned = 0;
  return s->meta.name != NULL ? 0 : WTX_ENOMEM;
}

static int m_commit(void *model, const char *version) {
  gpu_model *m = model;
  fprintf(stderr, "gpu_model_worker: version %s loaded from device staging\n", version);
  int prev, rc = 0;
  wtx__cuda_enter(m->cuda, m->device, &prev);
  for (size_t i = 0; m->read && rc == 0 && i < m->n; i++) rc = publish_one(m, &m->t[i]);
  wtx__cuda_leave(m->cuda, prev);
  if (rc != 0) fprintf(stderr, "gpu_model_worker: cannot keep version %s\n", version);
  if (m->sums != NULL && !m->no_check) write_sums(m, version);
  drop_staged(model);
  return rc;
}

/* --read: the published bytes of meta's tensor, device to host. */
static int m_read(void *model, wtx_target target, const wtx_tensor_meta *meta, uint8_t *dst,
                  char *err, size_t errlen) {
  gpu_model *m = model;
  size_t i = 0;
  while (i < m->n_pub && strcmp(m->pub[i].meta.name, meta->name) != 0) i++;
  if (target != WTX_TARGET_MAIN || i == m->n_pub || m->pub[i].meta.nbytes != meta->nbytes) {
    snprintf(err, errlen, "'%s': not published here as the update has it", meta->name);
    return WTX_ENOENT;
  }
  int prev;
  int e = wtx__cuda_enter(m->cuda, m->device, &prev);
  if (e == WTX_CUDA_SUCCESS && meta->nbytes > 0)
    e = m->cuda->Memcpy(dst, m->pub[i].dev, meta->nbytes, WTX_CUDA_D2H);
  wtx__cuda_leave(m->cuda, prev);
  if (e == WTX_CUDA_SUCCESS) return 0;
  snprintf(err, errlen, "'%s': cannot copy it to the host", meta->name);
  return WTX_EIO;
}

static void m_abort(void *model) { drop_staged(model); }

static const wtx_model_ops gpu_model_ops = {
    .version = WTX_MODEL_OPS_VERSION,
    .begin = m_begin,
    .stage = m_stage,
    .loaded = m_loaded,
    .prepare = m_prepare,
    .commit = m_commit,
    .abort = m_abort,
    .stage_device = m_stage_device,
    .adopt_device = m_adopt_device,
};

int main(int argc, char **argv) {
  const char *listen = NULL, *port_file = NULL;
  gpu_model m = {0};
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--no-check") == 0) m.no_check = 1;
    else if (strcmp(argv[i], "--read") == 0) m.read = 1;
    else if (strcmp(argv[i], "--in-place-only") == 0) m.in_place_only = 1;
    else if (i + 1 == argc) break;
    else if (strcmp(argv[i], "--listen") == 0) listen = argv[++i];
    else if (strcmp(argv[i], "--port-file") == 0) port_file = argv[++i];
    else if (strcmp(argv[i], "--sums") == 0) m.sums = argv[++i];
    else i++; /* another flag with its value (--log-level warn): ignored */
  }
  if (listen == NULL || port_file == NULL) {
    fprintf(stderr, "usage: gpu_model_worker --listen HOST:PORT --port-file FILE "
            "[--no-check] [--in-place-only] [--read] [--sums FILE]\n");
    return 2;
  }
  wtxtest_block_stop_signals(); /* before the CUDA runtime's threads */
  char err[1024] = "";
  if (wtx__cuda_load(0, &m.cuda, err, sizeof err) != 0) {
    fprintf(stderr, "gpu_model_worker: %s\n", err);
    return 1;
  }
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.listen = listen;
  /* --in-place-only: a model that can only adopt (no stage_device), as
   * the worker then sees it: one that refuses boxes. */
  wtx_model_ops ops = gpu_model_ops;
  if (m.in_place_only) ops.stage_device = NULL;
  if (m.read) ops.read = m_read;
  o.model_ops = &ops;
  o.model = &m;
  int rc = wtxtest_serve_model("gpu_model_worker", &o, port_file);
  drop_staged(&m);
  free(m.t);
  for (size_t i = 0; i < m.n_pub; i++) {
    m.cuda->Free(m.pub[i].dev);
    free((char *)m.pub[i].meta.name);
  }
  free(m.pub);
  return rc;
}
