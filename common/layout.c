/* Parameter tables and their identity (see layout.h). */
#include "common/layout.h"

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

int wtx__layout_add(wtx__layout *l, const wtx_tensor_meta *meta) {
  if (l->n == l->cap) {
    size_t cap = l->cap ? 2 * l->cap : 64;
    wtx_tensor_meta *m = realloc(l->metas, cap * sizeof *m);
    if (m != NULL) l->metas = m;
    uint64_t *e = m != NULL ? realloc(l->ends, cap * sizeof *e) : NULL;
    if (e == NULL) return WTX_ENOMEM;
    l->ends = e;
    l->cap = cap;
  }
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

static void put_le(uint8_t *p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; i++) p[i] = (uint8_t)(v >> (8 * i));
}

uint64_t wtx__layout_xxh3(const wtx_tensor_meta *metas, size_t n) {
  XXH3_state_t *h = XXH3_createState();
  if (h == NULL) return 0;
  XXH3_64bits_reset(h);
  for (size_t i = 0; i < n; i++) {
    const wtx_tensor_meta *m = &metas[i];
    uint8_t b[8 + 8 * WTX_MAX_DIMS];
    size_t nd = m->ndim <= WTX_MAX_DIMS ? m->ndim : WTX_MAX_DIMS;
    XXH3_64bits_update(h, m->name, strlen(m->name) + 1);
    put_le(b, (uint64_t)m->dtype, 4);
    put_le(b + 4, nd, 4);
    for (size_t d = 0; d < nd; d++) put_le(b + 8 + 8 * d, m->shape[d], 8);
    XXH3_64bits_update(h, b, 8 + 8 * nd);
  }
  uint64_t v = XXH3_64bits_digest(h);
  XXH3_freeState(h);
  return v;
}
