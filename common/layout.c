/* Parameter tables and their identity (see layout.h). */
#include "common/layout.h"

#include <endian.h>
#include <stdlib.h>
#include <string.h>

#include "common/hash.h"
#include "wtx/error.h"

int wtx__layout_init(wtx__layout *l) {
  memset(l, 0, sizeof *l);
  return wtx__strmap_create(&l->names);
}

void wtx__layout_free(wtx__layout *l) {
  free(l->metas);
  free(l->ends);
  wtx__strmap_destroy(l->names);
  memset(l, 0, sizeof *l);
}

void wtx__layout_clear(wtx__layout *l) {
  l->n = 0;
  wtx__strmap_clear(l->names);
}

void wtx__layout_reserve(wtx__layout *l, size_t n) { wtx__strmap_reserve(l->names, n); }

void wtx__layout_prefetch(const wtx__layout *l, const char *name) {
  wtx__strmap_prefetch(l->names, name);
}

int wtx__layout_room(wtx__layout *l, size_t k) {
  if (l->n + k <= l->cap) return 0;
  size_t cap = l->cap ? 2 * l->cap : 64;
  while (cap < l->n + k) cap *= 2;
  wtx_tensor_meta *m = realloc(l->metas, cap * sizeof *m);
  if (m != NULL) l->metas = m;
  uint64_t *e = m != NULL ? realloc(l->ends, cap * sizeof *e) : NULL;
  if (e == NULL) return WTX_ENOMEM;
  l->ends = e;
  l->cap = cap;
  return 0;
}

int wtx__layout_add(wtx__layout *l, const wtx_tensor_meta *meta) {
  if (wtx__layout_room(l, 1) != 0) return WTX_ENOMEM;
  const char *name;
  int rc = wtx__strmap_add(l->names, meta->name, l->n, &name);
  if (rc != 0) return rc;
  l->metas[l->n] = *meta;
  l->metas[l->n].name = name;
  l->ends[l->n] = (l->n > 0 ? l->ends[l->n - 1] : 0) + meta->nbytes;
  l->n++;
  return 0;
}

uint64_t wtx__layout_bytes(const wtx__layout *l, size_t first, size_t n) {
  if (n == 0) return 0;
  return l->ends[first + n - 1] - (first > 0 ? l->ends[first - 1] : 0);
}

void wtx__layout_swap(wtx__layout *a, wtx__layout *b) {
  wtx__layout t = *a;
  *a = *b;
  *b = t;
}

/* Little-endian stores, one move each: a byte loop here was most of the
 * cost of a 40k-tensor table's identity. */
static void put_le32(uint8_t *p, uint32_t v) {
  v = htole32(v);
  memcpy(p, &v, 4);
}

static void put_le64(uint8_t *p, uint64_t v) {
  v = htole64(v);
  memcpy(p, &v, 8);
}

/* The table's bytes are gathered in pieces of this size and hashed a piece
 * at a time: two streaming updates per tensor cost more than the hash of
 * 40k tensors' names and shapes (a trainer computes it for each table it
 * plans, a worker at each publish of params). */
#define PIECE ((size_t)64 << 10)

uint64_t wtx__layout_xxh3(const wtx_tensor_meta *metas, size_t n) {
  XXH3_state_t *h = XXH3_createState();
  uint8_t *b = malloc(PIECE);
  uint64_t v = 0;
  if (h == NULL || b == NULL) goto done;
  XXH3_64bits_reset(h);
  size_t used = 0;
  for (size_t i = 0; i < n; i++) {
    const wtx_tensor_meta *m = &metas[i];
    size_t nd = m->ndim <= WTX_MAX_DIMS ? m->ndim : WTX_MAX_DIMS;
    size_t name = strlen(m->name) + 1, k = name + 8 + 8 * nd;
    if (used + k > PIECE) {
      XXH3_64bits_update(h, b, used);
      used = 0;
    }
    if (k > PIECE) { /* a name longer than any valid one: hashed where it is */
      XXH3_64bits_update(h, m->name, name);
      name = 0;
    }
    memcpy(b + used, m->name, name);
    uint8_t *p = b + used + name;
    put_le32(p, (uint32_t)m->dtype);
    put_le32(p + 4, (uint32_t)nd);
    for (size_t d = 0; d < nd; d++) put_le64(p + 8 + 8 * d, m->shape[d]);
    used += name + 8 + 8 * nd;
  }
  XXH3_64bits_update(h, b, used);
  v = XXH3_64bits_digest(h);
done:
  XXH3_freeState(h);
  free(b);
  return v;
}
