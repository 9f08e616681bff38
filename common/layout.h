/* A parameter table: the tensors of an update, in order, with their names
 * interned and indexed. The worker keeps the table of the last update it
 * published per target, so a later update may name its tensors by
 * position in it (UpdateInfo.layout) instead of resending 40k names every
 * RL step; both sides agree on the table by its XXH3 (wtx__layout_xxh3).
 *
 * Not thread-safe: its owner locks. */
#ifndef WTX_COMMON_LAYOUT_H
#define WTX_COMMON_LAYOUT_H

#include <stddef.h>
#include <stdint.h>

#include "common/strmap.h"
#include "wtx/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wtx__layout {
  wtx_tensor_meta *metas; /* names point at names' keys */
  uint64_t *ends;         /* ends[i]: the bytes of metas[0..i] */
  size_t n, cap;
  wtx__strmap *names;     /* name -> position */
} wtx__layout;

/* An empty table (WTX_ENOMEM). */
int wtx__layout_init(wtx__layout *l);
/* Frees what l holds; l may be zeroed or initialized. */
void wtx__layout_free(wtx__layout *l);
/* Empties l for reuse. */
void wtx__layout_clear(wtx__layout *l);
/* Room for n tensors in all (a hint: adds past it still work). */
void wtx__layout_reserve(wtx__layout *l, size_t n);
/* wtx__strmap_prefetch for name, a few adds ahead. */
void wtx__layout_prefetch(const wtx__layout *l, const char *name);
/* Room for k more tensors, so that the next k adds move no meta
 * (WTX_ENOMEM). */
int wtx__layout_room(wtx__layout *l, size_t k);
/* Appends a copy of meta (its name copied); WTX_EEXIST when the name is
 * already in l, WTX_ENOMEM; l is unchanged on error. meta may be the slot
 * it goes to, &l->metas[l->n] (room made first), for a caller that fills
 * the table's own memory rather than a copy of its own. */
int wtx__layout_add(wtx__layout *l, const wtx_tensor_meta *meta);
/* The bytes of tensors [first, first + n) of l (in range). */
uint64_t wtx__layout_bytes(const wtx__layout *l, size_t first, size_t n);
/* Swaps the contents of a and b. */
void wtx__layout_swap(wtx__layout *a, wtx__layout *b);

/* The table's identity, as wtx.v1 defines it (ParamRange.table_xxh3):
 * XXH3-64, seed 0, over each tensor in order: its name's bytes and one 0
 * byte, dtype and the number of dims as 4-byte little-endian integers, then
 * each dim as an 8-byte little-endian integer. */
uint64_t wtx__layout_xxh3(const wtx_tensor_meta *metas, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* WTX_COMMON_LAYOUT_H */
