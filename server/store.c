/* The embedded in-memory parameter store: staged tensors become visible
 * atomically at commit; readers hold refcounted snapshots, so publishing never
 * frees bytes a reader still sees. Tensors not in an update carry over from
 * the previous version without a copy (their buffers are shared).
 *
 * Buffers a version no longer needs go to a pool (up to one model's worth of
 * bytes) and the next update stages into them: every RL step replaces the
 * weights, and fresh memory would cost a page fault per page each time. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "server/worker.h"

typedef struct pool pool;

typedef struct blob {
  atomic_int refs;
  uint64_t len;
  pool *pool;        /* where it returns when unreferenced */
  struct blob *next; /* in the pool */
  uint8_t data[];
} blob;

/* Free buffers kept for reuse, at most cap bytes. */
struct pool {
  pthread_mutex_t mu;
  blob *free;
  uint64_t bytes, cap;
};

static blob *blob_new(pool *p, uint64_t len) {
  pthread_mutex_lock(&p->mu);
  blob **pp = &p->free;
  while (*pp != NULL && (*pp)->len != len) pp = &(*pp)->next;
  blob *b = *pp;
  if (b != NULL) {
    *pp = b->next;
    p->bytes -= len;
  }
  pthread_mutex_unlock(&p->mu);
  if (b == NULL) {
    b = malloc(sizeof *b + (len ? len : 1));
    if (b == NULL) return NULL;
    b->len = len;
    b->pool = p;
  }
  atomic_init(&b->refs, 1);
  b->next = NULL;
  return b;
}

static void blob_unref(blob *b) {
  if (b == NULL || atomic_fetch_sub(&b->refs, 1) != 1) return;
  pool *p = b->pool;
  pthread_mutex_lock(&p->mu);
  int keep = p->bytes + b->len <= p->cap;
  if (keep) {
    b->next = p->free;
    p->free = b;
    p->bytes += b->len;
  }
  pthread_mutex_unlock(&p->mu);
  if (!keep) free(b);
}

static void pool_drain(pool *p) {
  while (p->free != NULL) {
    blob *b = p->free;
    p->free = b->next;
    free(b);
  }
  p->bytes = 0;
}

typedef struct entry {
  wtx_tensor_meta meta; /* meta.name owned */
  blob *b;
  uint64_t xxh3;
} entry;

/* name -> index, open addressing */
typedef struct index {
  size_t *slots; /* index + 1; 0 = empty */
  size_t cap;
} index_t;

static int index_build(index_t *ix, const entry *e, size_t n) {
  ix->cap = 16;
  while (ix->cap < n * 2) ix->cap *= 2;
  ix->slots = calloc(ix->cap, sizeof *ix->slots);
  if (ix->slots == NULL) return WTX_ENOMEM;
  for (size_t i = 0; i < n; i++) {
    size_t h = XXH3_64bits(e[i].meta.name, strlen(e[i].meta.name)) & (ix->cap - 1);
    while (ix->slots[h] != 0) h = (h + 1) & (ix->cap - 1);
    ix->slots[h] = i + 1;
  }
  return 0;
}

static long index_find(const index_t *ix, const entry *e, const char *name) {
  if (ix->slots == NULL) return -1;
  size_t h = XXH3_64bits(name, strlen(name)) & (ix->cap - 1);
  while (ix->slots[h] != 0) {
    if (strcmp(e[ix->slots[h] - 1].meta.name, name) == 0)
      return (long)(ix->slots[h] - 1);
    h = (h + 1) & (ix->cap - 1);
  }
  return -1;
}

typedef struct snapshot {
  atomic_int refs;
  char *version;
  uint64_t generation;
  entry *e;
  size_t n;
  index_t ix;
  uint64_t total;
  wtx_store_param *view; /* built for readers */
} snapshot;

static void snapshot_unref(snapshot *s) {
  if (s == NULL || atomic_fetch_sub(&s->refs, 1) != 1) return;
  for (size_t i = 0; i < s->n; i++) {
    free((char *)s->e[i].meta.name);
    blob_unref(s->e[i].b);
  }
  free(s->e);
  free(s->ix.slots);
  free(s->view);
  free(s->version);
  free(s);
}

struct wtx_store {
  pthread_mutex_t mu;
  pool pool;
  snapshot *pub[2]; /* main, draft */
  entry *declared;
  size_t n_declared;
  index_t declared_ix;
  /* staging */
  int staging;
  int target;
  entry *st;
  size_t n_st, cap_st;
};

int wtx_store_create(wtx_store **out) {
  wtx_store *s = calloc(1, sizeof *s);
  if (s == NULL) return WTX_ENOMEM;
  pthread_mutex_init(&s->mu, NULL);
  pthread_mutex_init(&s->pool.mu, NULL);
  *out = s;
  return 0;
}

static void staged_free(wtx_store *s) {
  for (size_t i = 0; i < s->n_st; i++) {
    free((char *)s->st[i].meta.name);
    blob_unref(s->st[i].b);
  }
  free(s->st);
  s->st = NULL;
  s->n_st = s->cap_st = 0;
}

void wtx_store_destroy(wtx_store *s) {
  if (s == NULL) return;
  staged_free(s);
  snapshot_unref(s->pub[0]);
  snapshot_unref(s->pub[1]);
  for (size_t i = 0; i < s->n_declared; i++) free((char *)s->declared[i].meta.name);
  free(s->declared);
  free(s->declared_ix.slots);
  pool_drain(&s->pool);
  pthread_mutex_destroy(&s->pool.mu);
  pthread_mutex_destroy(&s->mu);
  free(s);
}

static int meta_copy(wtx_tensor_meta *dst, const wtx_tensor_meta *src) {
  *dst = *src;
  dst->name = strdup(src->name);
  return dst->name != NULL ? 0 : WTX_ENOMEM;
}

int wtx_store_declare(wtx_store *s, const wtx_tensor_meta *metas, size_t n) {
  pthread_mutex_lock(&s->mu);
  int rc = 0;
  if (s->pub[0] != NULL || s->staging || s->declared != NULL) {
    rc = WTX_ESTATE;
  } else if ((s->declared = calloc(n ? n : 1, sizeof *s->declared)) == NULL) {
    rc = WTX_ENOMEM;
  } else {
    for (size_t i = 0; i < n && rc == 0; i++) {
      rc = meta_copy(&s->declared[i].meta, &metas[i]);
      if (rc == 0) s->n_declared++;
    }
    if (rc == 0) rc = index_build(&s->declared_ix, s->declared, s->n_declared);
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

/* dst shares src's bytes (one more reference) under a copied name. */
static int entry_share(entry *dst, const entry *src) {
  int rc = meta_copy(&dst->meta, &src->meta);
  if (rc != 0) return rc;
  dst->b = src->b;
  atomic_fetch_add(&src->b->refs, 1);
  dst->xxh3 = src->xxh3;
  return 0;
}

static int same_shape(const wtx_tensor_meta *a, const wtx_tensor_meta *b) {
  if (a->ndim != b->ndim) return 0;
  for (size_t i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i]) return 0;
  return 1;
}

static void shape_str(const wtx_tensor_meta *m, char *buf, size_t len) {
  size_t off = (size_t)snprintf(buf, len, "[");
  for (size_t i = 0; i < m->ndim && off < len; i++)
    off += (size_t)snprintf(buf + off, len - off, "%s%llu", i ? ", " : "",
                            (unsigned long long)m->shape[i]);
  if (off < len) snprintf(buf + off, len - off, "]");
}

int wtx_store_check(wtx_store *s, int target, const wtx_tensor_meta *meta,
                    char *err, size_t errlen) {
  pthread_mutex_lock(&s->mu);
  const entry *e = NULL;
  size_t n = 0;
  const index_t *ix = NULL;
  if (target == WTX_TARGET_MAIN && s->declared != NULL) {
    e = s->declared;
    n = s->n_declared;
    ix = &s->declared_ix;
  } else if (s->pub[target] != NULL && s->pub[target]->generation > 0) {
    e = s->pub[target]->e;
    n = s->pub[target]->n;
    ix = &s->pub[target]->ix;
  }
  int rc = 0;
  if (e != NULL) {
    long i = index_find(ix, e, meta->name);
    if (i < 0) {
      snprintf(err, errlen, "parameter '%s' is not in the model (%zu parameters)",
               meta->name, n);
      rc = WTX_ENOENT;
    } else if (e[i].meta.dtype != meta->dtype) {
      snprintf(err, errlen, "parameter '%s': dtype %s, the model holds %s",
               meta->name, wtx_dtype_name(meta->dtype),
               wtx_dtype_name(e[i].meta.dtype));
      rc = WTX_EINVAL;
    } else if (!same_shape(&e[i].meta, meta)) {
      char a[160], b[160];
      shape_str(meta, a, sizeof a);
      shape_str(&e[i].meta, b, sizeof b);
      snprintf(err, errlen, "parameter '%s': shape %s, the model holds %s",
               meta->name, a, b);
      rc = WTX_EINVAL;
    }
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

static int store_begin(void *model, int target) {
  wtx_store *s = model;
  pthread_mutex_lock(&s->mu);
  int rc = 0;
  if (s->staging) {
    rc = WTX_ESTATE;
  } else {
    s->staging = 1;
    s->target = target;
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

static int store_stage(void *model, const wtx_tensor_meta *meta, uint8_t **dst) {
  wtx_store *s = model;
  blob *b = blob_new(&s->pool, meta->nbytes);
  if (b == NULL) return WTX_ENOMEM;
  pthread_mutex_lock(&s->mu);
  int rc = 0;
  if (s->n_st == s->cap_st) {
    size_t cap = s->cap_st ? s->cap_st * 2 : 64;
    entry *e = realloc(s->st, cap * sizeof *e);
    if (e == NULL) rc = WTX_ENOMEM;
    else {
      s->st = e;
      s->cap_st = cap;
    }
  }
  if (rc == 0) rc = meta_copy(&s->st[s->n_st].meta, meta);
  if (rc == 0) {
    s->st[s->n_st].b = b;
    s->st[s->n_st].xxh3 = 0;
    s->n_st++;
    *dst = b->data;
  } else {
    blob_unref(b);
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

static int store_loaded(void *model, const wtx_tensor_meta *meta,
                        uint64_t xxh3) {
  wtx_store *s = model;
  pthread_mutex_lock(&s->mu);
  int rc = WTX_ENOENT;
  /* The tensor completing is almost always the last one staged. */
  for (size_t i = s->n_st; i-- > 0;)
    if (strcmp(s->st[i].meta.name, meta->name) == 0) {
      s->st[i].xxh3 = xxh3;
      rc = 0;
      break;
    }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

static int build_view(snapshot *snap) {
  snap->view = calloc(snap->n ? snap->n : 1, sizeof *snap->view);
  if (snap->view == NULL) return WTX_ENOMEM;
  snap->total = 0;
  for (size_t i = 0; i < snap->n; i++) {
    snap->view[i].meta = snap->e[i].meta;
    snap->view[i].data = snap->e[i].b->data;
    snap->view[i].xxh3 = snap->e[i].xxh3;
    snap->total += snap->e[i].meta.nbytes;
  }
  return index_build(&snap->ix, snap->e, snap->n);
}

static int store_commit(void *model, const char *version) {
  wtx_store *s = model;
  pthread_mutex_lock(&s->mu);
  snapshot *old = s->pub[s->target];
  snapshot *snap = calloc(1, sizeof *snap);
  int rc = snap != NULL ? 0 : WTX_ENOMEM;
  if (rc == 0) {
    atomic_init(&snap->refs, 1);
    snap->version = strdup(version);
    snap->generation = (old ? old->generation : 0) + 1;
    size_t cap = s->n_st + (old ? old->n : 0);
    snap->e = calloc(cap ? cap : 1, sizeof *snap->e);
    if (snap->version == NULL || snap->e == NULL) rc = WTX_ENOMEM;
  }
  /* Previous tensors first, in their order, replaced where the update has
   * them; then tensors new to this version, in update order. */
  index_t stix = {0};
  if (rc == 0) rc = index_build(&stix, s->st, s->n_st);
  char *used = rc == 0 ? calloc(s->n_st ? s->n_st : 1, 1) : NULL;
  if (rc == 0 && used == NULL) rc = WTX_ENOMEM;
  for (size_t i = 0; rc == 0 && old != NULL && i < old->n; i++) {
    long j = index_find(&stix, s->st, old->e[i].meta.name);
    const entry *src = j >= 0 ? &s->st[j] : &old->e[i];
    if (j >= 0) used[j] = 1;
    rc = entry_share(&snap->e[snap->n], src);
    if (rc == 0) snap->n++;
  }
  for (size_t j = 0; rc == 0 && j < s->n_st; j++) {
    if (used[j]) continue;
    rc = entry_share(&snap->e[snap->n], &s->st[j]);
    if (rc == 0) snap->n++;
  }
  free(used);
  free(stix.slots);
  if (rc == 0) rc = build_view(snap);
  if (rc == 0) {
    s->pub[s->target] = snap;
    /* Keep up to one spare copy of the largest model published. */
    pthread_mutex_lock(&s->pool.mu);
    if (snap->total > s->pool.cap) s->pool.cap = snap->total;
    pthread_mutex_unlock(&s->pool.mu);
    snapshot_unref(old);
    staged_free(s);
    s->staging = 0;
  } else if (snap != NULL) {
    atomic_store(&snap->refs, 1);
    snapshot_unref(snap);
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

static void store_abort(void *model) {
  wtx_store *s = model;
  pthread_mutex_lock(&s->mu);
  staged_free(s);
  s->staging = 0;
  pthread_mutex_unlock(&s->mu);
}

static int store_check(void *model, int target, const wtx_tensor_meta *meta,
                       char *err, size_t errlen) {
  return wtx_store_check(model, target, meta, err, errlen);
}

const wtx_model_ops wtx_store_model_ops = {
    .check = store_check,
    .begin = store_begin,
    .stage = store_stage,
    .loaded = store_loaded,
    .commit = store_commit,
    .abort = store_abort,
};

int wtx_store_acquire(wtx_store *s, int target, wtx_store_view *out) {
  if (target != WTX_TARGET_MAIN && target != WTX_TARGET_DRAFT) return WTX_EINVAL;
  memset(out, 0, sizeof *out);
  out->version = "";
  pthread_mutex_lock(&s->mu);
  snapshot *snap = s->pub[target];
  if (snap != NULL) {
    atomic_fetch_add(&snap->refs, 1);
    out->version = snap->version;
    out->generation = snap->generation;
    out->params = snap->view;
    out->n_params = snap->n;
    out->total_bytes = snap->total;
    out->internal = snap;
  }
  pthread_mutex_unlock(&s->mu);
  return 0;
}

void wtx_store_release(wtx_store *s, wtx_store_view *v) {
  (void)s;
  snapshot_unref(v->internal);
  memset(v, 0, sizeof *v);
}

int wtx_store_set_version(wtx_store *s, const char *version, char **previous) {
  /* Readers hold the version string through their snapshot: publish a new
   * snapshot that shares every tensor of the current one (if any). */
  pthread_mutex_lock(&s->mu);
  snapshot *old = s->pub[0];
  size_t n = old != NULL ? old->n : 0;
  snapshot *snap = calloc(1, sizeof *snap);
  int rc = snap != NULL ? 0 : WTX_ENOMEM;
  if (rc == 0) {
    atomic_init(&snap->refs, 1);
    snap->version = strdup(version);
    snap->e = calloc(n ? n : 1, sizeof *snap->e);
    snap->generation = old != NULL ? old->generation : 0;
    if (snap->version == NULL || snap->e == NULL) rc = WTX_ENOMEM;
  }
  for (size_t i = 0; rc == 0 && i < n; i++) {
    rc = entry_share(&snap->e[i], &old->e[i]);
    if (rc == 0) snap->n++;
  }
  if (rc == 0) rc = build_view(snap);
  if (rc == 0 && previous != NULL) {
    *previous = strdup(old != NULL ? old->version : "");
    if (*previous == NULL) rc = WTX_ENOMEM;
  }
  if (rc == 0) {
    s->pub[0] = snap;
    snapshot_unref(old);
  } else {
    snapshot_unref(snap);
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}
