/* The string -> index map over uthash (see strmap.h). */
#include "common/strmap.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>

/* Out of memory inside uthash is an error for the caller, never an exit:
 * HASH_ADD rolls back and sets the adder's `nomem`. */
#define HASH_NONFATAL_OOM 1
#define uthash_nonfatal_oom(obj) (nomem = 1)
/* XXH3 (already linked for checksums) instead of uthash's default Jenkins
 * hash: parameter names are long and share prefixes. */
#define HASH_FUNCTION(keyptr, keylen, hashv) \
  ((hashv) = (unsigned)XXH3_64bits((keyptr), (size_t)(keylen)))
/* A bloom filter of 2^18 bits (32 KiB per map) in front of the buckets:
 * every add first looks its key up, and a key that is not there is then
 * mostly told so without walking a chain (a cache miss per item). */
#define HASH_BLOOM 18
#include <uthash.h>
/* The table's size is each map's (log2 buckets), not uthash's 32 to start
 * with: uthash makes a table at a map's first add with these, and these
 * two names are read only there, inside wtx__strmap_add (m in scope; as
 * in uthash 2.3, Debian 12's). */
#undef HASH_INITIAL_NUM_BUCKETS
#undef HASH_INITIAL_NUM_BUCKETS_LOG2
#define HASH_INITIAL_NUM_BUCKETS (1U << m->log2)
#define HASH_INITIAL_NUM_BUCKETS_LOG2 (m->log2)

#include "common/arena.h"
#include "common/hash.h"
#include "wtx/error.h"

/* The handle, the value, then the key's bytes; carved from the map's
 * arena (its items sit together: fewer cache misses, no malloc per key),
 * never freed one by one. */
typedef struct item {
  UT_hash_handle hh;
  size_t value;
  char key[];
} item;

struct wtx__strmap {
  item *head;
  /* The table's buckets, log2: kept at least the keys' count (uthash alone
   * lets chains grow to ten before it doubles, then doubles one step at a
   * time: at 40k keys, adding them cost 200 ns each, mostly cache misses
   * in long chains and in re-linking every key at each step). A cleared
   * map keeps its size for the next fill. */
  unsigned log2;
  wtx__arena arena;
};

#define MIN_LOG2 5U  /* uthash's own start */
#define MAX_LOG2 22U /* 4M buckets (64 MiB): a reservation stops here */

static unsigned log2_for(size_t n) {
  unsigned l = MIN_LOG2;
  while (l < MAX_LOG2 && ((size_t)1 << l) < n) l++;
  return l;
}

/* Doubles the table until it has at least n buckets (as far as memory
 * allows: a table that cannot grow stays as it is, and still works). An
 * empty map's next table is made for n, larger or smaller than the last
 * one. */
static void grow(wtx__strmap *m, size_t n) {
  n = n < ((size_t)1 << MAX_LOG2) ? n : ((size_t)1 << MAX_LOG2);
  if (m->head == NULL) {
    m->log2 = log2_for(n);
    return;
  }
  UT_hash_table *tbl = m->head->hh.tbl;
  int oomed = 0;
  while (tbl->num_buckets < n && !oomed) HASH_EXPAND_BUCKETS(hh, tbl, oomed);
  m->log2 = tbl->log2_num_buckets;
}

int wtx__strmap_create(wtx__strmap **out) {
  *out = calloc(1, sizeof **out);
  if (*out == NULL) return WTX_ENOMEM;
  (*out)->log2 = MIN_LOG2;
  return 0;
}

void wtx__strmap_reserve(wtx__strmap *m, size_t n) { grow(m, n); }

void wtx__strmap_destroy(wtx__strmap *m) {
  if (m == NULL) return;
  wtx__strmap_clear(m);
  free(m);
}

/* Adds key unless present: copied into the item, or with borrow the
 * caller's own string, which must outlive the map. */
static int add(wtx__strmap *m, const char *key, size_t value, int borrow, const char **stored) {
  size_t len = strlen(key);
  unsigned hashv = 0;
  HASH_VALUE(key, len, hashv);
  item *it = NULL;
  HASH_FIND_BYHASHVALUE(hh, m->head, key, len, hashv, it);
  if (it != NULL) return WTX_EEXIST;
  if (m->head != NULL && m->head->hh.tbl->num_items >= m->head->hh.tbl->num_buckets)
    grow(m, (size_t)m->head->hh.tbl->num_buckets * 2);
  /* On failure below the piece stays unused in the arena until clear. */
  it = wtx__arena_alloc(&m->arena, sizeof *it + (borrow ? 0 : len + 1));
  if (it == NULL) return WTX_ENOMEM;
  it->value = value;
  if (!borrow) key = memcpy(it->key, key, len + 1);
  int nomem = 0;
  HASH_ADD_KEYPTR_BYHASHVALUE(hh, m->head, key, len, hashv, it);
  if (nomem) return WTX_ENOMEM;
  if (stored != NULL) *stored = key;
  return 0;
}

int wtx__strmap_add(wtx__strmap *m, const char *key, size_t value, const char **stored) {
  return add(m, key, value, 0, stored);
}

int wtx__strmap_add_borrowed(wtx__strmap *m, const char *key, size_t value) {
  return add(m, key, value, 1, NULL);
}

static const char *name_at(const void *names, size_t stride, size_t i) {
  return *(const char *const *)((const char *)names + i * stride);
}

const char *wtx__strmap_first_duplicate(const void *names, size_t n, size_t stride, int *rc) {
  wtx__strmap *m = NULL;
  const char *dup = NULL;
  if ((*rc = wtx__strmap_create(&m)) != 0) return NULL;
  wtx__strmap_reserve(m, n);
  for (size_t i = 0; i < n && *rc == 0 && dup == NULL; i++) {
    if (i + 8 < n) wtx__strmap_prefetch(m, name_at(names, stride, i + 8));
    if ((*rc = wtx__strmap_add_borrowed(m, name_at(names, stride, i), i)) == WTX_EEXIST) {
      dup = name_at(names, stride, i);
      *rc = 0;
    }
  }
  wtx__strmap_destroy(m);
  return dup;
}

void wtx__strmap_prefetch(const wtx__strmap *m, const char *key) {
  if (m->head == NULL) return;
  unsigned hashv = 0, bkt = 0;
  HASH_VALUE(key, strlen(key), hashv);
  HASH_TO_BKT(hashv, m->head->hh.tbl->num_buckets, bkt);
  __builtin_prefetch(&m->head->hh.tbl->buckets[bkt], 1);
}

int wtx__strmap_get(const wtx__strmap *m, const char *key, size_t *value) {
  item *it = NULL;
  HASH_FIND(hh, m->head, key, strlen(key), it);
  if (it != NULL && value != NULL) *value = it->value;
  return it != NULL;
}

size_t wtx__strmap_count(const wtx__strmap *m) { return HASH_COUNT(m->head); }

void wtx__strmap_clear(wtx__strmap *m) {
  HASH_CLEAR(hh, m->head);
  wtx__arena_free(&m->arena);
}
