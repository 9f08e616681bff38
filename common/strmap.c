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

#include "common/hash.h"
#include "wtx/error.h"

/* The handle, the value, then the key's bytes; carved from the map's
 * arena, never freed one by one. */
typedef struct item {
  UT_hash_handle hh;
  size_t value;
  char key[];
} item;

/* Arena blocks: items of one map sit together (fewer cache misses, no
 * malloc per key); a clear or destroy frees every block at once. */
typedef struct block {
  struct block *next;
  size_t used, size;
  _Alignas(max_align_t) unsigned char mem[];
} block;

struct wtx__strmap {
  item *head;
  block *blocks; /* newest first */
};

#define BLOCK_MIN 4096u
#define BLOCK_MAX (1u << 20)

static void *arena_alloc(wtx__strmap *m, size_t n) {
  n = (n + _Alignof(max_align_t) - 1) & ~(size_t)(_Alignof(max_align_t) - 1);
  block *b = m->blocks;
  if (b == NULL || b->size - b->used < n) {
    size_t size = b != NULL && b->size < BLOCK_MAX ? 2 * b->size : BLOCK_MIN;
    if (size < n) size = n;
    block *nb = malloc(sizeof *nb + size);
    if (nb == NULL) return NULL;
    *nb = (block){.next = b, .size = size};
    m->blocks = b = nb;
  }
  void *p = b->mem + b->used;
  b->used += n;
  return p;
}

/* Gives back the last n bytes arena_alloc returned (an add that failed). */
static void arena_unalloc(wtx__strmap *m, size_t n) {
  n = (n + _Alignof(max_align_t) - 1) & ~(size_t)(_Alignof(max_align_t) - 1);
  m->blocks->used -= n;
}

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
  it = arena_alloc(m, sizeof *it + len + 1);
  if (it == NULL) return WTX_ENOMEM;
  it->value = value;
  memcpy(it->key, key, len + 1);
  int nomem = 0;
  HASH_ADD_KEYPTR_BYHASHVALUE(hh, m->head, it->key, len, hashv, it);
  if (nomem) {
    arena_unalloc(m, sizeof *it + len + 1);
    return WTX_ENOMEM;
  }
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
  while (m->blocks != NULL) {
    block *b = m->blocks;
    m->blocks = b->next;
    free(b);
  }
}
