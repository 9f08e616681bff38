/* The bump allocator (see arena.h). */
#include "common/arena.h"

#include <stdint.h>
#include <stdlib.h>

struct wtx__arena_block {
  wtx__arena_block *next;
  size_t used, cap;
  max_align_t data[];
};

#define BLOCK_MIN ((size_t)4 << 10)
#define BLOCK_MAX ((size_t)64 << 10)

/* The capacity of the block a piece of n bytes opens after block b. */
static size_t block_cap(const wtx__arena_block *b, size_t n) {
#ifdef __SANITIZE_ADDRESS__
  (void)b;
  return n;
#else
  if (n > BLOCK_MAX / 4) return n;
  size_t cap = b == NULL ? BLOCK_MIN : b->cap >= BLOCK_MAX / 2 ? BLOCK_MAX : 2 * b->cap;
  return cap < n ? n : cap;
#endif
}

void *wtx__arena_alloc(wtx__arena *a, size_t n) {
  const size_t align = _Alignof(max_align_t);
  if (n > SIZE_MAX - sizeof(wtx__arena_block) - align) return NULL;
  n = n == 0 ? align : (n + align - 1) & ~(align - 1);
  wtx__arena_block *b = a->blocks;
  if (b == NULL || b->cap - b->used < n) {
    size_t cap = block_cap(b, n);
    wtx__arena_block *nb = malloc(sizeof *nb + cap);
    if (nb == NULL) return NULL;
    nb->used = 0;
    nb->cap = cap;
    if (b != NULL && cap == n) { /* a piece of its own: the open block stays open */
      nb->next = b->next;
      b->next = nb;
    } else {
      nb->next = b;
      a->blocks = nb;
    }
    b = nb;
  }
  void *p = (char *)b->data + b->used;
  b->used += n;
  return p;
}

void wtx__arena_free(wtx__arena *a) {
  while (a->blocks != NULL) {
    wtx__arena_block *next = a->blocks->next;
    free(a->blocks);
    a->blocks = next;
  }
}
