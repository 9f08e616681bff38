/* Delta syncs: what the replicas serve, and the subset to send (see
 * delta.h). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/delta.h"
#include "client/fanout.h"
#include "common/hash.h"
#include "common/patch.h"
#include "common/strmap.h"

int wtx__delta_reserve(wtx__delta *d, size_t n) {
  if (d->known != NULL && d->n == n) return 0;
  wtx__delta_free(d);
  size_t k = n ? n : 1;
  /* Each per-tensor array, zeroed; all or none. */
#define ROOM(f) ((d->f = calloc(k, sizeof *d->f)) != NULL)
  int all = ROOM(known) && ROOM(ok) && ROOM(hashes) && ROOM(metas) && ROOM(map) && ROOM(at) &&
            ROOM(patch) && ROOM(src) && ROOM(patch_off) && ROOM(patch_len) && ROOM(patches);
#undef ROOM
  if (!all) {
    wtx__delta_free(d);
    return WTX_ENOMEM;
  }
  d->n = n;
  return 0;
}

void wtx__delta_free(wtx__delta *d) {
  free(d->known);
  free(d->ok);
  free(d->hashes);
  free(d->metas);
  free(d->map);
  free(d->at);
  free(d->patch);
  free(d->src);
  free(d->patch_off);
  free(d->patch_len);
  free(d->patches);
  free(d->prev);
  free(d->prev_off);
  free(d->prev_ok);
  free(d->pending);
  free(d->arena);
  free(d->chunks);
  free(d->based);
  *d = (wtx__delta){0};
}

/* Narrows d->ok to the tensors replica info serves with the hash known
 * (first: takes its hashes). */
static int narrow(wtx__delta *d, const wtx_weight_info *info, const wtx_tensor_meta *metas,
                  int first) {
  wtx__strmap *names = NULL;
  int rc = wtx__strmap_create(&names);
  if (rc != 0) return rc;
  wtx__strmap_reserve(names, info->n_params);
  for (size_t k = 0; k < info->n_params && rc == 0; k++) {
    rc = wtx__strmap_add(names, info->params[k].meta.name, k, NULL);
    if (rc == WTX_EEXIST) rc = 0; /* the first listed stands */
  }
  for (size_t i = 0; i < d->n && rc == 0; i++) {
    size_t k;
    if (!d->ok[i] || !wtx__strmap_get(names, metas[i].name, &k)) {
      d->ok[i] = 0;
      continue;
    }
    const wtx_param_info *p = &info->params[k];
    if (!p->has_xxh3 || !wtx_tensor_meta_same_layout(&p->meta, &metas[i]))
      d->ok[i] = 0;
    else if (first)
      d->known[i] = p->xxh3;
    else if (d->known[i] != p->xxh3)
      d->ok[i] = 0;
  }
  wtx__strmap_destroy(names);
  return rc;
}

/* The record describes what each replica of c serves now: valid, at
 * those versions (not valid when there is no room to keep them). */
static void mark(wtx__delta *d, const wtx_client *c) {
  size_t n = wtx_client_size(c);
  d->valid = 0;
  if (n != d->n_based) {
    free(d->based);
    d->n_based = 0;
    if ((d->based = calloc(n ? n : 1, sizeof *d->based)) == NULL) return;
    d->n_based = n;
  }
  for (size_t r = 0; r < n; r++)
    snprintf(d->based[r], sizeof d->based[r], "%s", wtx__client_serves(c, r));
  d->valid = 1;
}

int wtx__delta_learn(wtx__delta *d, wtx_client *c, const wtx_tensor_meta *metas) {
  d->valid = 0;
  memset(d->ok, 1, d->n);
  for (size_t r = 0; r < wtx_client_size(c); r++) {
    wtx_weight_info info = {0};
    int rc = wtx_client_weight_info(c, r, 1, &info);
    if (rc == 0) rc = narrow(d, &info, metas, r == 0);
    wtx_weight_info_free(&info);
    if (rc != 0) {
      memset(d->ok, 0, d->n);
      return rc;
    }
  }
  mark(d, c);
  return d->valid ? 0 : WTX_ENOMEM;
}

int wtx__delta_plan(wtx__delta *d, const wtx_tensor_meta *metas, uint64_t buffer_size,
                    size_t max_params, int packed, int patches) {
  uint64_t *sizes = malloc((d->n ? d->n : 1) * sizeof *sizes);
  uint8_t *whole = calloc(d->n ? d->n : 1, 1);
  if (sizes == NULL || whole == NULL) {
    free(sizes);
    free(whole);
    return WTX_ENOMEM;
  }
  d->m = 0;
  for (size_t i = 0; i < d->n; i++) {
    if (d->ok[i] && d->known[i] == d->hashes[i]) continue;
    int patched = patches && d->patch_len[i] > 0;
    d->metas[d->m] = metas[i];
    d->map[d->m] = i;
    d->patch[d->m] = patched ? &d->patches[i] : NULL;
    d->src[d->m] = patched ? d->arena + d->patch_off[i] : NULL;
    whole[d->m] = (uint8_t)patched; /* the worker applies a patch within its chunk */
    sizes[d->m++] = patched ? d->patch_len[i] : metas[i].nbytes;
  }
  free(d->chunks);
  d->chunks = NULL;
  d->n_chunks = 0;
  d->total = 0;
  int rc = d->m > 0 ? wtx_chunks_plan_whole(sizes, whole, d->m, buffer_size, max_params, packed,
                                            &d->chunks, &d->n_chunks) : 0;
  free(sizes);
  free(whole);
  for (size_t k = 0; rc == 0 && k < d->n_chunks; k++) d->total += d->chunks[k].bytes;
  return rc;
}

void wtx__delta_landed(wtx__delta *d, int diffed, const wtx_client *c) {
  memcpy(d->known, d->hashes, d->n * sizeof *d->known);
  memset(d->ok, 1, d->n);
  mark(d, c);
  /* Without this sync's diff, prev missed what it changed. */
  if (!diffed && d->prev_ok != NULL) memset(d->prev_ok, 0, d->n);
  for (size_t i = 0; d->pending != NULL && i < d->n; i++) {
    d->prev_ok[i] |= d->pending[i];
    d->pending[i] = 0;
  }
}

void wtx__delta_failed(wtx__delta *d) {
  if (d->pending != NULL) memset(d->pending, 0, d->n);
}

/* prev and its bookkeeping, the model's size: made once. */
static int prev_make(wtx__delta *d, const wtx_tensor_meta *metas) {
  if (d->prev != NULL) return 0;
  uint64_t total = 0;
  d->prev_off = malloc((d->n ? d->n : 1) * sizeof *d->prev_off);
  d->prev_ok = calloc(d->n ? d->n : 1, 1);
  d->pending = calloc(d->n ? d->n : 1, 1);
  if (!d->prev_off || !d->prev_ok || !d->pending) return WTX_ENOMEM;
  for (size_t i = 0; i < d->n; i++) {
    d->prev_off[i] = total;
    total += metas[i].nbytes;
  }
  return (d->prev = malloc(total ? total : 1)) != NULL ? 0 : WTX_ENOMEM;
}

/* Room for want more bytes in *arena (*cap bytes, used so far). */
static int arena_room(uint8_t **arena, uint64_t *cap, uint64_t used, uint64_t want) {
  if (used + want <= *cap) return 0;
  uint64_t c = *cap ? *cap : (1u << 20);
  while (c < used + want) c *= 2;
  uint8_t *a = realloc(*arena, c);
  if (a == NULL) return WTX_ENOMEM;
  *arena = a;
  *cap = c;
  return 0;
}

int wtx__delta_patch(const uint8_t *cur, uint8_t *prev, const wtx_tensor_meta *m,
                     uint64_t max_bytes, uint8_t **arena, uint64_t *cap, uint64_t *used,
                     uint64_t *count) {
  size_t es = wtx_dtype_size(m->dtype);
  int idt = wtx__patch_index_dtype(m->nbytes / es);
  uint64_t per = wtx__patch_index_size(idt) + es;
  uint64_t most = m->nbytes > 0 ? (m->nbytes - 1 < max_bytes ? m->nbytes - 1 : max_bytes) / per
                                : 0;
  *count = 0;
  if (most == 0) return 0;
  int rc = arena_room(arena, cap, *used, most * per);
  if (rc != 0) return rc;
  uint64_t k = wtx__patch_diff(cur, prev, m->nbytes, es, idt, most, *arena + *used);
  if (k == 0 || k > most) return 0;
  wtx__patch_apply(m, idt, k, *arena + *used, prev);
  *count = k;
  *used += k * per;
  return 0;
}

/* Tensor i as a patch of prev, when cheaper than whole and at most
 * max_bytes: its bytes at arena + *used, and prev patched. */
static int diff_one(wtx__delta *d, const wtx_tensor_meta *m, size_t i, uint64_t max_bytes,
                    uint64_t *used) {
  uint64_t at = *used, k = 0;
  int rc = wtx__delta_patch(d->at[i], d->prev + d->prev_off[i], m, max_bytes, &d->arena,
                            &d->arena_cap, used, &k);
  if (rc != 0 || k == 0) return rc;
  wtx__v1__patch__init(&d->patches[i]);
  d->patches[i].index_dtype = (Wtx__V1__DType)wtx__patch_index_dtype(
      m->nbytes / wtx_dtype_size(m->dtype));
  d->patches[i].count = k;
  d->patches[i].result_xxh3 = d->hashes[i];
  d->patch_off[i] = at;
  d->patch_len[i] = *used - at;
  return 0;
}

int wtx__delta_diff(wtx__delta *d, const wtx_tensor_meta *metas, uint64_t max_bytes, int make,
                    int all) {
  int rc = prev_make(d, metas);
  uint64_t used = 0;
  for (size_t i = 0; rc == 0 && i < d->n; i++) {
    d->patch_len[i] = 0;
    if (d->at[i] == NULL) {
      d->prev_ok[i] = 0; /* not at hand: sent whole while it changes */
      continue;
    }
    int changed = all || !(d->ok[i] && d->known[i] == d->hashes[i]);
    if (!changed && d->prev_ok[i]) continue;
    if (make && changed && d->prev_ok[i] && metas[i].nbytes > 0)
      rc = diff_one(d, &metas[i], i, max_bytes, &used);
    /* prev becomes the tensor: by its patch (which wrote what changed
     * only), or whole. */
    if (d->patch_len[i] == 0) memcpy(d->prev + d->prev_off[i], d->at[i], metas[i].nbytes);
    d->prev_ok[i] = 0;
    d->pending[i] = 1;
  }
  return rc;
}

/* The hash pass's work: tensors hashed by whichever thread takes the next. */
typedef struct hash_job {
  const uint8_t *const *at;
  const wtx_tensor_meta *metas; /* tensor i's length */
  uint64_t *out;
  size_t n;
  atomic_size_t next;
} hash_job;

static void *hash_some(void *arg) {
  hash_job *j = arg;
  for (size_t i; (i = atomic_fetch_add(&j->next, 1)) < j->n;)
    if (j->at[i] != NULL) j->out[i] = XXH3_64bits(j->at[i], j->metas[i].nbytes);
  return NULL;
}

/* Threads for the hash pass: one per online core, at most HASH_THREADS
 * (memory bandwidth, not cores, bounds it past a few). */
#define HASH_THREADS 8

void wtx__delta_hash(const uint8_t *const *at, const wtx_tensor_meta *metas, size_t n,
                     uint64_t *out) {
  hash_job j = {.at = at, .metas = metas, .out = out, .n = n};
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  size_t k = cores > 1 ? (size_t)cores : 1;
  if (k > HASH_THREADS) k = HASH_THREADS;
  if (k > n) k = n;
  pthread_t th[HASH_THREADS];
  size_t started = 0;
  while (started + 1 < k && pthread_create(&th[started], NULL, hash_some, &j) == 0) started++;
  hash_some(&j); /* this thread too; alone when no thread could start */
  for (size_t i = 0; i < started; i++) pthread_join(th[i], NULL);
}

int wtx__delta_check_patch(const wtx_patch *p, wtx_tensor_meta *m, uint8_t *wire,
                           uint64_t *bytes, char *why, size_t len) {
  size_t isz = wtx__patch_index_size(p->index_dtype), es;
  if (wire == NULL) {
    if (wtx_tensor_meta_set(m, p->name != NULL ? p->name : "", p->dtype, p->shape, p->ndim,
                            why, len) != 0)
      return WTX_EINVAL;
    es = wtx_dtype_size(m->dtype);
    *bytes = wtx__patch_bytes(p->index_dtype, p->count, es);
    int rc = wtx__patch_check(m, p->index_dtype, p->count, NULL, *bytes, why, len);
    if (rc == 0 && (p->indices == NULL || p->values == NULL)) {
      snprintf(why, len, "indices and values are needed");
      rc = WTX_EINVAL;
    }
    return rc;
  }
  es = wtx_dtype_size(m->dtype);
  memcpy(wire, p->indices, p->count * isz);
  memcpy(wire + p->count * isz, p->values, p->count * es);
  return wtx__patch_check(m, p->index_dtype, p->count, wire, *bytes, why, len);
}

/* Caller patch p as tensor j of the table: its meta, description and bytes
 * (indices then values) at arena + *used, checked as the worker checks it. */
static int caller_one(wtx__delta *d, const wtx_patch *p, size_t j, uint64_t buffer_size,
                      uint64_t *used, char *err, size_t errlen) {
  char why[1200] = "";
  wtx_tensor_meta *m = &d->metas[j];
  uint64_t bytes;
  int rc = wtx__delta_check_patch(p, m, NULL, &bytes, why, sizeof why);
  if (rc == 0 && bytes > buffer_size) {
    snprintf(err, errlen, "patches[%zu]: the patch of '%s' is %llu bytes, more than a buffer "
             "(%llu): send the tensor whole", j, m->name, (unsigned long long)bytes,
             (unsigned long long)buffer_size);
    return WTX_ETOOBIG;
  }
  if (rc == 0 && (rc = arena_room(&d->arena, &d->arena_cap, *used, bytes)) != 0) return rc;
  if (rc == 0) rc = wtx__delta_check_patch(p, m, d->arena + *used, &bytes, why, sizeof why);
  if (rc != 0) {
    snprintf(err, errlen, "patches[%zu]: %s", j, why);
    return rc;
  }
  wtx__v1__patch__init(&d->patches[j]);
  d->patches[j].index_dtype = (Wtx__V1__DType)p->index_dtype;
  d->patches[j].count = p->count;
  d->patch_off[j] = *used;
  d->patch_len[j] = bytes;
  *used += bytes;
  return 0;
}

int wtx__delta_caller(wtx__delta *d, const wtx_patch *p, size_t n, uint64_t buffer_size,
                      size_t max_params, int packed, char *err, size_t errlen) {
  int rc = wtx__delta_reserve(d, n);
  if (rc != 0) return rc;
  uint64_t used = 0;
  for (size_t j = 0; j < n && rc == 0; j++)
    rc = caller_one(d, &p[j], j, buffer_size, &used, err, errlen);
  const char *dup = rc == 0 ? wtx__strmap_first_duplicate(d->metas, n, sizeof *d->metas, &rc)
                            : NULL;
  if (dup != NULL) {
    snprintf(err, errlen, "patches: '%s' is patched twice; merge its patches into one", dup);
    return WTX_EINVAL;
  }
  for (size_t j = 0; j < n && rc == 0; j++) {
    d->map[j] = j;
    d->patch[j] = &d->patches[j];
    d->src[j] = d->arena + d->patch_off[j];
    d->ok[j] = 0; /* every one sent */
  }
  d->m = n;
  return rc != 0 ? rc : wtx__delta_plan(d, d->metas, buffer_size, max_params, packed, 1);
}

void wtx__delta_forget(wtx__delta *d) {
  wtx__delta_failed(d);
  d->valid = 0;
  if (d->prev_ok != NULL) memset(d->prev_ok, 0, d->n);
}

int wtx__delta_names(const wtx_tensor_meta *metas, size_t n, wtx__strmap **out) {
  int rc = wtx__strmap_create(out);
  if (rc == 0) wtx__strmap_reserve(*out, n);
  for (size_t i = 0; rc == 0 && i < n; i++) rc = wtx__strmap_add(*out, metas[i].name, i, NULL);
  if (rc != 0) {
    wtx__strmap_destroy(*out);
    *out = NULL;
  }
  return rc;
}

int wtx__delta_patch_param(const wtx__strmap *names, const wtx_tensor_meta *metas,
                           const wtx_patch *p, size_t j, size_t *param, char *err,
                           size_t errlen) {
  wtx_tensor_meta m;
  char why[1200] = "";
  uint64_t bytes = 0;
  if (p->name == NULL || !wtx__strmap_get(names, p->name, param)) {
    snprintf(err, errlen, "patches[%zu]: '%s' is not in the source's metadata", j,
             p->name != NULL ? p->name : "");
    return WTX_EINVAL;
  }
  int rc = wtx__delta_check_patch(p, &m, NULL, &bytes, why, sizeof why);
  if (rc == 0 && !wtx_tensor_meta_same_layout(&m, &metas[*param])) {
    snprintf(err, errlen, "patches[%zu]: '%s' is not the source's dtype and shape", j, p->name);
    return WTX_EINVAL;
  }
  uint8_t *wire = rc == 0 ? malloc(bytes + 1) : NULL;
  if (rc == 0 && wire == NULL) return WTX_ENOMEM;
  if (rc == 0) rc = wtx__delta_check_patch(p, &m, wire, &bytes, why, sizeof why);
  free(wire);
  if (rc != 0) snprintf(err, errlen, "patches[%zu]: %s", j, why);
  return rc;
}
