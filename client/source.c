/* wtx weight sources (see source.h). */
#include "wtx/source.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/source.h"
#include "common/hash.h"
#include "common/safetensors.h"
#include "common/strmap.h"
#include "cuda/cuda.h"
#include "transport/plan.h"

struct wtx_source {
  const wtx_source_ops *ops;
  void *self;
  /* Host copies of the device tensors ops->next yields (it said 3; the
   * memory source's too): the CUDA runtime, loaded at the first, and one
   * buffer, reused. */
  const wtx_cuda *cuda;
  uint8_t *scratch;
  size_t scratch_len;
};

int wtx_source_create(const wtx_source_ops *ops, void *self, wtx_source **out) {
  *out = NULL;
  if (ops == NULL || ops->version == 0 || ops->version > WTX_SOURCE_OPS_VERSION ||
      ops->metadata == NULL || ops->open == NULL ||
      (ops->next == NULL && ops->next_batch == NULL) || ops->close == NULL)
    return WTX_EINVAL;
  wtx_source *s = calloc(1, sizeof *s);
  if (s == NULL) return WTX_ENOMEM;
  s->ops = ops;
  s->self = self;
  *out = s;
  return 0;
}

void wtx_source_destroy(wtx_source *s) {
  if (s == NULL) return;
  if (s->ops->destroy != NULL) s->ops->destroy(s->self);
  free(s->scratch);
  free(s);
}

const char *wtx_source_name(const wtx_source *s) { return s->ops->name; }

int wtx_source_ownership(wtx_source *s, const wtx_ownership **owners, size_t *n) {
  *owners = NULL;
  *n = 0;
  return s->ops->ownership != NULL ? s->ops->ownership(s->self, owners, n) : 0;
}

int wtx_source_metadata(wtx_source *s, const wtx_tensor_meta **metas, size_t *n) {
  return s->ops->metadata(s->self, metas, n);
}

/* A pass of a source that answers in batches (ops->next_batch): the
 * implementation's own pass, and the batch being handed out one tensor at
 * a time. 4096 tensors a call: the calls' cost disappears even where a
 * tensor costs nothing (a Python source replaying its last pass), and the
 * arrays stay 80 KB. */
#define BATCH 4096
typedef struct batch {
  void *inner;
  size_t at, n;
  const wtx_tensor_meta *metas[BATCH];
  const uint8_t *data[BATCH];
  int kinds[BATCH];
} batch;

int wtx_source_open(wtx_source *s, void **iter) {
  if (s->ops->next_batch == NULL) return s->ops->open(s->self, iter);
  batch *b = calloc(1, sizeof *b);
  if (b == NULL) return WTX_ENOMEM;
  int rc = s->ops->open(s->self, &b->inner);
  if (rc != 0) {
    free(b);
    return rc;
  }
  *iter = b;
  return 0;
}

/* ops->next, from the batch b, which is refilled when handed out. */
static int batch_next(wtx_source *s, batch *b, wtx_tensor_meta *meta, const uint8_t **data) {
  if (b->at == b->n) {
    int r = s->ops->next_batch(s->self, b->inner, BATCH, b->metas, b->data, b->kinds);
    b->at = b->n = 0;
    if (r <= 0) return r;
    if ((size_t)r > BATCH) return WTX_EINVAL;
    b->n = (size_t)r;
  }
  size_t k = b->at++;
  if (b->kinds[k] < 1 || b->kinds[k] > 3 || b->metas[k] == NULL) return WTX_EINVAL;
  *meta = *b->metas[k];
  *data = b->data[k];
  return b->kinds[k];
}

/* A host copy of the device tensor out names, in the source's scratch. */
static int copy_to_host(wtx_source *s, const wtx_tensor_meta *meta, wtx__tensor_data *out) {
  char why[300];
  if (s->cuda == NULL && wtx__cuda_load(0, &s->cuda, why, sizeof why) != 0)
    return WTX_EUNAVAIL;
  size_t n = (size_t)meta->nbytes;
  if (n > s->scratch_len) {
    uint8_t *b = realloc(s->scratch, n);
    if (b == NULL) return WTX_ENOMEM;
    s->scratch = b;
    s->scratch_len = n;
  }
  if (n > 0 && s->cuda->Memcpy(s->scratch, out->device, n, WTX_CUDA_D2H) != WTX_CUDA_SUCCESS)
    return WTX_EIO;
  out->host = s->scratch;
  return 1;
}

int wtx__source_next(wtx_source *s, void *iter, int host_copy, wtx_tensor_meta *meta,
                     wtx__tensor_data *out) {
  *out = (wtx__tensor_data){0};
  int r = s->ops->next_batch != NULL ? batch_next(s, iter, meta, &out->host)
                                     : s->ops->next(s->self, iter, meta, &out->host);
  if (r != WTX_NEXT_DEVICE) {
    out->stays = r == WTX_NEXT_STAYS;
    return r == WTX_NEXT_STAYS ? WTX_NEXT_TENSOR : r;
  }
  out->device = out->host; /* device memory that stays put */
  out->host = NULL;
  return host_copy ? copy_to_host(s, meta, out) : 1;
}

int wtx_source_next(wtx_source *s, void *iter, wtx_tensor_meta *meta,
                    const uint8_t **data) {
  wtx__tensor_data d;
  int r = wtx__source_next(s, iter, 1, meta, &d);
  *data = d.host;
  return r;
}

void wtx_source_close(wtx_source *s, void *iter) {
  if (s->ops->next_batch == NULL) {
    s->ops->close(s->self, iter);
    return;
  }
  batch *b = iter;
  s->ops->close(s->self, b->inner);
  free(b);
}

int wtx_source_total_bytes(wtx_source *s, uint64_t *out) {
  const wtx_tensor_meta *m;
  size_t n;
  int rc = wtx_source_metadata(s, &m, &n);
  *out = 0;
  for (size_t i = 0; rc == 0 && i < n; i++) *out += m[i].nbytes;
  return rc;
}

/* ---- a table of tensors: the memory and safetensors sources ---- */

/* Parameters with their bytes at hand; iteration walks the table. */
typedef struct table {
  wtx_tensor_meta *metas;
  const uint8_t **data;
  uint8_t *device; /* per tensor: data is device memory (memory source) */
  size_t n;
  char *names; /* storage of the metas' names */
  wtx_st_file **files;
  size_t n_files;
  /* An owned table (wtx_source_memory_owned): the ranks' ownership, and
   * what this rank holds of each tensor (shape: its part's; nbytes 0:
   * nothing, which a pass skips). */
  const wtx_ownership *own;
  wtx_tensor_meta *local;
} table;

static int table_metadata(void *self, const wtx_tensor_meta **metas, size_t *n) {
  table *t = self;
  *metas = t->metas;
  *n = t->n;
  return 0;
}

/* The built-in sources' pass: the position of the next tensor. */
static int open_pos(void *self, void **iter) {
  (void)self;
  size_t *pos = calloc(1, sizeof *pos);
  if (pos == NULL) return WTX_ENOMEM;
  *iter = pos;
  return 0;
}

static void close_pos(void *self, void *iter) {
  (void)self;
  free(iter);
}

/* 2: host memory or a mapped file; 3: device memory (the library makes a
 * host copy where one is needed). Both stay put until close. */
static int table_next(void *self, void *iter, wtx_tensor_meta *meta,
                      const uint8_t **data) {
  table *t = self;
  size_t *pos = iter;
  if (*pos >= t->n) return 0;
  while (t->local != NULL && *pos < t->n && t->local[*pos].nbytes == 0) (*pos)++;
  if (*pos >= t->n) return 0;
  size_t i = (*pos)++;
  *meta = t->local != NULL ? t->local[i] : t->metas[i];
  *data = t->data[i];
  return t->device != NULL && t->device[i] && t->metas[i].nbytes > 0 ? WTX_NEXT_DEVICE
                                                                      : WTX_NEXT_STAYS;
}

static void table_destroy(void *self) {
  table *t = self;
  for (size_t i = 0; i < t->n_files; i++) wtx_st_close(t->files[i]);
  free(t->files);
  free(t->metas);
  free(t->data);
  free(t->device);
  free(t->names);
  free(t->local);
  free(t);
}

/* A table for n tensors whose names take name_bytes in all. */
static table *table_new(size_t n, size_t name_bytes) {
  table *t = calloc(1, sizeof *t);
  if (t == NULL) return NULL;
  t->metas = calloc(n ? n : 1, sizeof *t->metas);
  t->data = calloc(n ? n : 1, sizeof *t->data);
  t->names = malloc(name_bytes ? name_bytes : 1);
  if (t->metas == NULL || t->data == NULL || t->names == NULL) {
    table_destroy(t);
    return NULL;
  }
  return t;
}

static int table_ownership(void *self, const wtx_ownership **owners, size_t *n) {
  table *t = self;
  *owners = t->own;
  *n = t->own != NULL ? t->n : 0;
  return 0;
}

static const wtx_source_ops table_ops_memory = {
    .version = WTX_SOURCE_OPS_VERSION,
    .name = "memory",
    .metadata = table_metadata,
    .open = open_pos,
    .next = table_next,
    .close = close_pos,
    .destroy = table_destroy,
    .ownership = table_ownership, /* none unless wtx_source_memory_owned */
};

static const wtx_source_ops table_ops_safetensors = {
    .version = WTX_SOURCE_OPS_VERSION,
    .name = "safetensors",
    .metadata = table_metadata,
    .open = open_pos,
    .next = table_next,
    .close = close_pos,
    .destroy = table_destroy,
};

/* Names must be unique; unique says they are known to be (one safetensors
 * file, whose reader refused a name twice), else they are checked, in
 * O(n). */
static int table_finish(table *t, const wtx_source_ops *ops, int unique, wtx_source **out,
                        char *err, size_t errlen) {
  int rc = 0;
  const char *dup =
      unique ? NULL : wtx__strmap_first_duplicate(t->metas, t->n, sizeof *t->metas, &rc);
  if (dup != NULL) {
    snprintf(err, errlen, "parameter '%s' appears twice", dup);
    rc = WTX_EINVAL;
  }
  if (rc == 0) rc = wtx_source_create(ops, t, out);
  if (rc != 0) table_destroy(t);
  return rc;
}

/* wtx_source_memory; null_ok: data may be NULL (an owned table's tensors
 * a rank holds nothing of, checked by the caller). */
static int memory_source(const wtx_memory_tensor *tensors, size_t n, int null_ok,
                         wtx_source **out, char *err, size_t errlen) {
  *out = NULL;
  size_t name_bytes = 0;
  for (size_t i = 0; i < n; i++) name_bytes += strlen(tensors[i].name) + 1;
  table *t = table_new(n, name_bytes);
  if (t == NULL) return WTX_ENOMEM;
  char *p = t->names;
  for (size_t i = 0; i < n; i++) {
    const wtx_memory_tensor *m = &tensors[i];
    wtx_tensor_meta *pm = &t->metas[i];
    char why[1400];
    int rc = wtx_tensor_meta_set(pm, m->name, m->dtype, m->shape, m->ndim, why,
                                 sizeof why);
    if (rc == 0 && pm->nbytes > 0 && m->data == NULL && !null_ok) {
      snprintf(why, sizeof why, "data: NULL for %llu bytes",
               (unsigned long long)pm->nbytes);
      rc = WTX_EINVAL;
    }
    if (rc != 0) {
      snprintf(err, errlen, "tensor '%s' (index %zu): %s", m->name, i, why);
      table_destroy(t);
      return rc;
    }
    strcpy(p, m->name);
    pm->name = p;
    p += strlen(m->name) + 1;
    t->data[i] = m->data;
    if (m->device) {
      if (t->device == NULL && (t->device = calloc(n, 1)) == NULL) {
        table_destroy(t);
        return WTX_ENOMEM;
      }
      /* Said now, not at the first pass: no CUDA runtime to copy it with. */
      const wtx_cuda *cuda;
      char why[400] = "";
      int lrc = wtx__cuda_load(0, &cuda, why, sizeof why);
      if (lrc != 0) {
        snprintf(err, errlen, "tensor '%s' is in device memory: %s", m->name, why);
        table_destroy(t);
        return lrc;
      }
      t->device[i] = 1;
    }
    t->n++;
  }
  return table_finish(t, &table_ops_memory, 0, out, err, errlen);
}

int wtx_source_memory(const wtx_memory_tensor *tensors, size_t n,
                      wtx_source **out, char *err, size_t errlen) {
  return memory_source(tensors, n, 0, out, err, errlen);
}


/* What rank holds of m under o (checked): *local with the part's shape,
 * nbytes 0 when nothing. */
static void owned_part(const wtx_tensor_meta *m, const wtx_ownership *o, uint32_t rank,
                       wtx_tensor_meta *local) {
  *local = *m;
  wtx_box b;
  if (!wtx_ownership_rank_box(m, o, rank, &b) || wtx_box_elements(&b) == 0) {
    local->nbytes = 0;
    return;
  }
  for (size_t d = 0; d < m->ndim; d++) local->shape[d] = b.len[d];
  local->nbytes = wtx_box_elements(&b) * wtx_dtype_size(m->dtype);
}

int wtx_source_memory_owned(const wtx_memory_tensor *tensors, const wtx_ownership *owners,
                            size_t n, uint32_t rank, wtx_source **out, char *err,
                            size_t errlen) {
  *out = NULL;
  wtx_source *full = NULL;
  int rc = memory_source(tensors, n, 1, &full, err, errlen);
  if (rc != 0) return rc;
  table *t = full->self;
  t->local = calloc(n ? n : 1, sizeof *t->local);
  if (t->local == NULL) rc = WTX_ENOMEM;
  for (size_t i = 0; rc == 0 && i < n; i++) {
    /* Any rank may be named: the world is not known here. */
    rc = wtx_ownership_check(&t->metas[i], &owners[i], UINT32_MAX, err, errlen);
    if (rc == 0) owned_part(&t->metas[i], &owners[i], rank, &t->local[i]);
    if (rc == 0 && t->local[i].nbytes > 0 && t->data[i] == NULL) {
      snprintf(err, errlen, "tensor '%s' (index %zu): data NULL, but rank %u owns %llu "
               "bytes of it", t->metas[i].name, i, rank,
               (unsigned long long)t->local[i].nbytes);
      rc = WTX_EINVAL;
    }
  }
  t->own = owners;
  if (rc == 0) *out = full;
  else wtx_source_destroy(full);
  return rc;
}

int wtx_source_safetensors(const char *const *paths, size_t n, wtx_source **out,
                           char *err, size_t errlen) {
  *out = NULL;
  if (n == 0) {
    snprintf(err, errlen, "no safetensors file given");
    return WTX_EINVAL;
  }
  wtx_st_file **files = calloc(n, sizeof *files);
  if (files == NULL) return WTX_ENOMEM;
  size_t count = 0, name_bytes = 0;
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    rc = wtx_st_open(paths[i], &files[i], err, errlen);
    if (rc != 0) break;
    for (size_t j = 0; j < wtx_st_count(files[i]); j++) {
      count++;
      name_bytes += strlen(wtx_st_tensor_at(files[i], j)->meta.name) + 1;
    }
  }
  table *t = rc == 0 ? table_new(count, name_bytes) : NULL;
  if (rc == 0 && t == NULL) rc = WTX_ENOMEM;
  if (rc != 0) {
    for (size_t i = 0; i < n; i++) wtx_st_close(files[i]);
    free(files);
    return rc;
  }
  t->files = files;
  t->n_files = n;
  char *p = t->names;
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < wtx_st_count(files[i]); j++) {
      const wtx_st_tensor *st = wtx_st_tensor_at(files[i], j);
      wtx_tensor_meta *pm = &t->metas[t->n];
      *pm = st->meta;
      strcpy(p, st->meta.name);
      pm->name = p;
      p += strlen(st->meta.name) + 1;
      t->data[t->n++] = st->data;
    }
  return table_finish(t, &table_ops_safetensors, n == 1, out, err, errlen);
}

/* ---- synthetic ---- */

/* The content is generated once, at the first pass, and kept: like a
 * trainer's weights, it is in memory when a sync starts. */
typedef struct synth {
  wtx_tensor_meta *metas;
  char (*names)[96];
  size_t n;
  uint64_t seed, max_bytes;
  uint8_t *data;
  uint64_t *offsets;
} synth;

static void synth_add(synth *s, const char *name, uint64_t a, uint64_t b) {
  wtx_tensor_meta *m = &s->metas[s->n];
  snprintf(s->names[s->n], sizeof s->names[s->n], "%s", name);
  m->name = s->names[s->n];
  m->dtype = WTX_DTYPE_BFLOAT16;
  m->shape[0] = a;
  m->shape[1] = b;
  m->ndim = b ? 2 : 1;
  m->nbytes = a * (b ? b : 1) * 2;
  if (m->nbytes > s->max_bytes) s->max_bytes = m->nbytes;
  s->n++;
}

static uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

static int synth_metadata(void *self, const wtx_tensor_meta **metas, size_t *n) {
  synth *s = self;
  *metas = s->metas;
  *n = s->n;
  return 0;
}

static int synth_open(void *self, void **iter) {
  synth *s = self;
  if (s->data == NULL) {
    uint64_t total = 0;
    s->offsets = malloc((s->n + 1) * sizeof *s->offsets);
    if (s->offsets == NULL) return WTX_ENOMEM;
    for (size_t i = 0; i < s->n; i++) {
      s->offsets[i] = total;
      total += s->metas[i].nbytes;
    }
    if ((s->data = malloc(total ? total : 1)) == NULL) return WTX_ENOMEM;
    for (size_t i = 0; i < s->n; i++) {
      const wtx_tensor_meta *m = &s->metas[i];
      uint8_t *dst = s->data + s->offsets[i];
      uint64_t seed = s->seed ^ XXH3_64bits(m->name, strlen(m->name));
      for (uint64_t w = 0; w * 8 < m->nbytes; w++) {
        uint64_t v = splitmix(seed ^ w);
        size_t k = m->nbytes - w * 8 < 8 ? (size_t)(m->nbytes - w * 8) : 8;
        memcpy(dst + w * 8, &v, k);
      }
    }
  }
  return open_pos(self, iter);
}

static int synth_next(void *self, void *iter, wtx_tensor_meta *meta,
                      const uint8_t **data) {
  synth *s = self;
  size_t *pos = iter;
  if (*pos >= s->n) return 0;
  *meta = s->metas[*pos];
  *data = s->data + s->offsets[*pos];
  (*pos)++;
  return 2; /* held in memory until the source goes */
}

static void synth_destroy(void *self) {
  synth *s = self;
  free(s->data);
  free(s->offsets);
  free(s->metas);
  free(s->names);
  free(s);
}

static const wtx_source_ops synth_ops = {
    .version = WTX_SOURCE_OPS_VERSION,
    .name = "synthetic",
    .metadata = synth_metadata,
    .open = synth_open,
    .next = synth_next,
    .close = close_pos,
    .destroy = synth_destroy,
};

int wtx_source_synthetic(uint64_t total_bytes, uint64_t seed, wtx_source **out) {
  *out = NULL;
  /* hidden h, vocab 4h, per layer 12 h^2 + 2h parameters: pick h, then the
   * number of layers that fills total_bytes. */
  uint64_t h = 64;
  while (12 * (h * 2) * (h * 2) * 2 * 8 <= total_bytes && h < 8192) h *= 2;
  uint64_t per_layer = (12 * h * h + 2 * h) * 2;
  uint64_t embed = 4 * h * h * 2;
  uint64_t layers = total_bytes > embed ? (total_bytes - embed) / per_layer : 1;
  if (layers == 0) layers = 1;
  if (layers > 4096) layers = 4096;
  synth *s = calloc(1, sizeof *s);
  if (s == NULL) return WTX_ENOMEM;
  s->seed = seed;
  s->metas = calloc(layers * 8 + 2, sizeof *s->metas);
  s->names = calloc(layers * 8 + 2, sizeof *s->names);
  if (s->metas == NULL || s->names == NULL) {
    synth_destroy(s);
    return WTX_ENOMEM;
  }
  synth_add(s, "model.embed_tokens.weight", 4 * h, h);
  static const char *const proj[] = {"self_attn.q_proj", "self_attn.k_proj",
                                     "self_attn.v_proj", "self_attn.o_proj"};
  char name[96];
  for (uint64_t l = 0; l < layers; l++) {
    unsigned long long ll = (unsigned long long)l;
    for (int j = 0; j < 4; j++) {
      snprintf(name, sizeof name, "model.layers.%llu.%s.weight", ll, proj[j]);
      synth_add(s, name, h, h);
    }
    snprintf(name, sizeof name, "model.layers.%llu.mlp.up_proj.weight", ll);
    synth_add(s, name, 4 * h, h);
    snprintf(name, sizeof name, "model.layers.%llu.mlp.down_proj.weight", ll);
    synth_add(s, name, h, 4 * h);
    snprintf(name, sizeof name, "model.layers.%llu.input_layernorm.weight", ll);
    synth_add(s, name, h, 0);
    snprintf(name, sizeof name,
             "model.layers.%llu.post_attention_layernorm.weight", ll);
    synth_add(s, name, h, 0);
  }
  synth_add(s, "model.norm.weight", h, 0);
  int rc = wtx_source_create(&synth_ops, s, out);
  if (rc != 0) synth_destroy(s);
  return rc;
}

/* ---- layer grouping ---- */

int wtx_param_layer(const char *name, uint64_t *layer) {
  const char *p = name;
  while (*p) {
    const char *end = strchr(p, '.');
    size_t len = end ? (size_t)(end - p) : strlen(p);
    size_t k = 0;
    while (k < len && isdigit((unsigned char)p[k])) k++;
    if (len > 0 && k == len && len <= 18) {
      *layer = strtoull(p, NULL, 10);
      return 1;
    }
    if (end == NULL) break;
    p = end + 1;
  }
  return 0;
}

size_t wtx_param_groups(const wtx_tensor_meta *metas, size_t n, size_t *starts) {
  size_t g = 0;
  int prev_has = -1;
  uint64_t prev = 0;
  for (size_t i = 0; i < n; i++) {
    uint64_t l = 0;
    int has = wtx_param_layer(metas[i].name, &l);
    if (i == 0 || has != prev_has || (has && l != prev)) starts[g++] = i;
    prev_has = has;
    prev = l;
  }
  return g;
}
