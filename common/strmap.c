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
  wtx__arena arena;
};

int wtx__strmap_create(wtx__strmap **out) {
  *out = calloc(1, sizeof **out);
  return *out != NULL ? 0 : WTX_ENOMEM;
}

void wtx__strmap_destroy(wtx__strmap *m) {
  if (m == NULL) return;
  wtx__strmap_clear(m);
  free(m);
}

int wtx__strmap_add(wtx__strmap *m, const char *key, size_t value, const char **stored) {
  size_t len = strlen(key);
  unsigned hashv = 0;
  HASH_VALUE(key, len, hashv);
  item *it = NULL;
  HASH_FIND_BYHASHVALUE(hh, m->head, key, len, hashv, it);
  if (it != NULL) return WTX_EEXIST;
  /* On failure below the piece stays unused in the arena until clear. */
  it = wtx__arena_alloc(&m->arena, sizeof *it + len + 1);
  if (it == NULL) return WTX_ENOMEM;
  it->value = value;
  memcpy(it->key, key, len + 1);
  int nomem = 0;
  HASH_ADD_KEYPTR_BYHASHVALUE(hh, m->head, it->key, len, hashv, it);
  if (nomem) return WTX_ENOMEM;
  if (stored != NULL) *stored = it->key;
  return 0;
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
