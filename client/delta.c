/* Delta syncs: what the replicas serve, and the subset to send (see
 * delta.h). */
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "common/hash.h"

#include "client/delta.h"
#include "common/strmap.h"

int wtx__delta_reserve(wtx__delta *d, size_t n) {
  if (d->known != NULL && d->n == n) return 0;
  wtx__delta_free(d);
  d->known = calloc(n ? n : 1, sizeof *d->known);
  d->ok = calloc(n ? n : 1, sizeof *d->ok);
  d->hashes = calloc(n ? n : 1, sizeof *d->hashes);
  d->metas = calloc(n ? n : 1, sizeof *d->metas);
  d->map = calloc(n ? n : 1, sizeof *d->map);
  d->at = calloc(n ? n : 1, sizeof *d->at);
  d->len = calloc(n ? n : 1, sizeof *d->len);
  if (!d->known || !d->ok || !d->hashes || !d->metas || !d->map || !d->at || !d->len) {
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
  free(d->len);
  free(d->chunks);
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
  d->valid = 1;
  return 0;
}

int wtx__delta_plan(wtx__delta *d, const wtx_tensor_meta *metas, uint64_t buffer_size,
                    size_t max_params, int packed) {
  uint64_t *sizes = malloc((d->n ? d->n : 1) * sizeof *sizes);
  if (sizes == NULL) return WTX_ENOMEM;
  d->m = 0;
  for (size_t i = 0; i < d->n; i++) {
    if (d->ok[i] && d->known[i] == d->hashes[i]) continue;
    d->metas[d->m] = metas[i];
    d->map[d->m] = i;
    sizes[d->m++] = metas[i].nbytes;
  }
  free(d->chunks);
  d->chunks = NULL;
  d->n_chunks = 0;
  d->total = 0;
  int rc = d->m > 0 ? wtx_chunks_plan(sizes, d->m, buffer_size, max_params, packed,
                                      &d->chunks, &d->n_chunks) : 0;
  free(sizes);
  for (size_t k = 0; rc == 0 && k < d->n_chunks; k++) d->total += d->chunks[k].bytes;
  return rc;
}

void wtx__delta_landed(wtx__delta *d) {
  memcpy(d->known, d->hashes, d->n * sizeof *d->known);
  memset(d->ok, 1, d->n);
  d->valid = 1;
}

/* The hash pass's work: tensors hashed by whichever thread takes the next. */
typedef struct hash_job {
  const uint8_t *const *at;
  const uint64_t *len;
  uint64_t *out;
  size_t n;
  atomic_size_t next;
} hash_job;

static void *hash_some(void *arg) {
  hash_job *j = arg;
  for (size_t i; (i = atomic_fetch_add(&j->next, 1)) < j->n;)
    if (j->at[i] != NULL) j->out[i] = XXH3_64bits(j->at[i], j->len[i]);
  return NULL;
}

/* Threads for the hash pass: one per online core, at most HASH_THREADS
 * (memory bandwidth, not cores, bounds it past a few). */
#define HASH_THREADS 8

void wtx__delta_hash(const uint8_t *const *at, const uint64_t *len, size_t n, uint64_t *out) {
  hash_job j = {.at = at, .len = len, .out = out, .n = n};
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
