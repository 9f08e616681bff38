/* The string -> index map over uthash (see strmap.h). */
#include "common/strmap.h"

#include <stdlib.h>
#include <string.h>

/* Out of memory inside uthash is an error for the caller, never an exit:
 * HASH_ADD rolls back and sets the adder's `nomem`. */
#define HASH_NONFATAL_OOM 1
#define uthash_nonfatal_oom(obj) (nomem = 1)
#include <uthash.h>

#include "wtx/error.h"

/* One allocation per key: the handle, the value, then the key's bytes. */
typedef struct item {
  UT_hash_handle hh;
  size_t value;
  char key[];
} item;

struct wtx__strmap {
  item *head;
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

int wtx__strmap_add(wtx__strmap *m, const char *key, size_t value) {
  size_t len = strlen(key);
  item *it = NULL;
  HASH_FIND(hh, m->head, key, len, it);
  if (it != NULL) return WTX_EEXIST;
  it = malloc(sizeof *it + len + 1);
  if (it == NULL) return WTX_ENOMEM;
  it->value = value;
  memcpy(it->key, key, len + 1);
  int nomem = 0;
  HASH_ADD_KEYPTR(hh, m->head, it->key, len, it);
  if (nomem) {
    free(it);
    return WTX_ENOMEM;
  }
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
  item *it, *tmp;
  HASH_ITER(hh, m->head, it, tmp) {
    HASH_DEL(m->head, it);
    free(it);
  }
}
