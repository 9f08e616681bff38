/* A string -> index map: the parameter names of an update (duplicate
 * detection) and of a published version (lookup by name), one hash table
 * for both, over uthash (Debian's uthash-dev). Lookups and inserts are O(1)
 * expected, so an update of N parameters costs O(N).
 *
 * Not thread-safe: its owner locks. */
#ifndef WTX_COMMON_STRMAP_H
#define WTX_COMMON_STRMAP_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wtx__strmap wtx__strmap;

/* An empty map; *out is the caller's until wtx__strmap_destroy. */
int wtx__strmap_create(wtx__strmap **out);
/* Frees m and every key it copied (NULL: no-op). */
void wtx__strmap_destroy(wtx__strmap *m);
/* Maps a copy of key to value; *stored (stored may be NULL) is that copy,
 * which m owns until clear or destroy, so callers can point at it instead
 * of keeping their own. WTX_EEXIST when key is present (its value stays),
 * WTX_ENOMEM; m is unchanged on error. */
int wtx__strmap_add(wtx__strmap *m, const char *key, size_t value, const char **stored);
/* As wtx__strmap_add, but m keeps key itself, not a copy: key must stay
 * unchanged until m is cleared or destroyed (an owner that holds the names
 * already: a copy each would be megabytes more at 40k names). */
int wtx__strmap_add_borrowed(wtx__strmap *m, const char *key, size_t value);
/* The first of n names that appears a second time among them, or NULL:
 * name i is the string pointer at (const char *)names + i * stride, as the
 * name field that starts a wtx_tensor_meta in an array of them, or of
 * structs that begin with one. O(n) expected, through a map of its own
 * (reserved for n, names borrowed). *rc: 0, or WTX_ENOMEM (then NULL). */
const char *wtx__strmap_first_duplicate(const void *names, size_t n, size_t stride, int *rc);
/* Starts loading the bucket key falls in, for a caller about to add or
 * look up many keys: an insert's cost is mostly the miss on its bucket
 * (a 40k-key table's buckets are a megabyte), which a prefetch a few keys
 * ahead hides. No effect on m. */
void wtx__strmap_prefetch(const wtx__strmap *m, const char *key);
/* 1 with *value (may be NULL) set when key is present, else 0. */
int wtx__strmap_get(const wtx__strmap *m, const char *key, size_t *value);
size_t wtx__strmap_count(const wtx__strmap *m);
/* Sizes m's table for n keys in all (at most 4M buckets), so that adding
 * them does not grow it step by step: for callers that know how many keys
 * come. An empty map (new or cleared) gets a table that size at its next
 * add, smaller than its last one too; a cleared map not reserved again
 * keeps its last size. Best effort: without the memory, m stays as it is. */
void wtx__strmap_reserve(wtx__strmap *m, size_t n);
/* Removes every key. */
void wtx__strmap_clear(wtx__strmap *m);

#ifdef __cplusplus
}
#endif
#endif /* WTX_COMMON_STRMAP_H */
