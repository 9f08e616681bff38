/* A bump allocator: many small pieces that share one lifetime (a map's
 * keys, a call's decoded request), carved from a few blocks and freed all
 * at once, instead of a malloc and a free each (120k pieces for a request
 * of 40k ParamMeta; 40k keys for a map of 40k names).
 *
 * Blocks grow from 4 KiB to 64 KiB; a piece over a quarter of that gets a
 * block of its own, and the open block stays open. Under AddressSanitizer
 * every piece gets its own block, so overruns are still seen.
 *
 * Not thread-safe: its owner locks. */
#ifndef WTX_COMMON_ARENA_H
#define WTX_COMMON_ARENA_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wtx__arena_block wtx__arena_block;

/* Zeroed (WTX__ARENA_INIT) is an empty arena. */
typedef struct wtx__arena {
  wtx__arena_block *blocks; /* the open one first */
} wtx__arena;

#define WTX__ARENA_INIT {NULL}

/* n bytes (not zeroed), aligned for any type, the arena's until
 * wtx__arena_free; NULL when out of memory. */
void *wtx__arena_alloc(wtx__arena *a, size_t n);
/* Frees every piece; a is empty and usable again. */
void wtx__arena_free(wtx__arena *a);

#ifdef __cplusplus
}
#endif
#endif /* WTX_COMMON_ARENA_H */
