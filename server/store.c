/* The embedded in-memory parameter store: staged tensors become visible
 * atomically at commit; readers hold refcounted snapshots, so publishing never
 * frees bytes a reader still sees. Tensors not in an update carry over from
 * the previous version without a copy (their buffers are shared).
 *
 * Buffers a version no longer needs go to a pool (up to one model's worth of
 * bytes) and the next update stages into them: every RL step replaces the
 * weights, and fresh memory would cost a page fault per page each time.
 *
 * Small tensors (SMALL bytes or fewer: biases, norms, an MoE model's tens of
 * thousands of tiny ones) are not a buffer each but packed into slabs that
 * belong to one version (and the versions relabelling shares it with): a
 * version holds its slabs, not each small tensor, so publishing and
 * releasing one touches a few slabs instead of 40k buffers (each a cache
 * miss and an atomic). A small tensor a publish carries over is copied into
 * the new version's slabs instead of shared, so that a slab never outlives
 * its version: one carried tensor would otherwise pin a whole slab, version
 * after version, and memory would grow with every partial update. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Out of memory in uthash is the caller's error, never an exit. */
#define HASH_NONFATAL_OOM 1
#define uthash_nonfatal_oom(obj) (nomem = 1)
#include <uthash.h>

#include "common/arena.h"
#include "common/hash.h"
#include "common/strmap.h"
#include "server/store.h"
#include "wtx/worker.h"

/* The published versions, by target. */
#define PUB(s, target) ((s)->pub[(target) == WTX_TARGET_DRAFT])

typedef struct pool pool;

/* data starts on a 64-byte line: a receive streams whole aligned lines
 * into it while hashing them (wtx__copy_hash), which needs the tensor's
 * first byte at a line's start. */
typedef struct blob {
  atomic_int refs;
  uint64_t len;
  pool *pool;        /* where it returns when unreferenced */
  struct blob *next; /* in the pool */
  _Alignas(64) uint8_t data[];
} blob;

/* The free buffers of one length: a version's tensor of that length
 * reuses one in O(1), whatever the number of lengths. */
typedef struct size_class {
  UT_hash_handle hh;
  uint64_t len;
  blob *free;
  size_t n; /* buffers in free */
} size_class;

struct entry;

/* Tensors of at most SMALL bytes go in slabs: the first of an update
 * SLAB_FIRST bytes, each next one twice the last, up to SLAB_MAX (a small
 * model wastes little, a large one allocates few); each tensor 16-byte
 * aligned, as malloc would. */
#define SMALL WTX__STORE_SMALL
#define SLAB_FIRST (16u << 10)
#define SLAB_MAX (256u << 10)
#define SLAB_ALIGN 16

/* Free buffers kept for reuse, at most cap bytes; and the arrays of one
 * unreferenced snapshot, which the next one reuses (megabytes at 40k
 * tensors: fresh ones would cost a page fault per page every publish).
 *
 * Staging takes buffers without the lock: the first tensor of a length an
 * update stages moves that length's whole free list into `mine`, which
 * only the staging side touches (the session calls the model ops one at a
 * time), and what is left goes back when staging ends. An update of 40k
 * tensors then locks once per length, not once per tensor. */
struct pool {
  pthread_mutex_t mu;
  size_class *classes; /* by len; kept (empty) until the store goes */
  /* bytes: in classes' lists; held: moved to mine since staging began
   * (counted against cap until it ends, used or not). Both under mu. */
  uint64_t bytes, held, cap;
  atomic_uint_fast64_t allocated; /* bytes of every blob malloc'd and not freed */
  size_class *mine, *last; /* staging side only; last: the length staged last */
  struct entry *spare_e;
  wtx_store_param *spare_view;
  size_t spare_cap;
};

/* The class of length len in *table, made on first use; NULL when out of
 * memory. */
static size_class *class_in(size_class **table, uint64_t len) {
  size_class *c = NULL;
  HASH_FIND(hh, *table, &len, sizeof len, c);
  if (c != NULL || (c = calloc(1, sizeof *c)) == NULL) return c;
  c->len = len;
  int nomem = 0;
  HASH_ADD(hh, *table, len, sizeof c->len, c);
  if (nomem) {
    free(c);
    return NULL;
  }
  return c;
}

/* Staging's free buffers of length len, refilled from the shared pool when
 * empty; NULL when out of memory. */
static size_class *mine_of(pool *p, uint64_t len) {
  size_class *m = p->last != NULL && p->last->len == len ? p->last : class_in(&p->mine, len);
  if (m == NULL || m->free != NULL) return p->last = m;
  pthread_mutex_lock(&p->mu);
  size_class *c = NULL;
  HASH_FIND(hh, p->classes, &len, sizeof len, c);
  if (c != NULL && c->free != NULL) {
    m->free = c->free;
    m->n = c->n;
    c->free = NULL;
    c->n = 0;
    p->bytes -= m->n * len;
    p->held += m->n * len;
  }
  pthread_mutex_unlock(&p->mu);
  return p->last = m;
}

/* A buffer of len bytes for staging, with one reference. */
static blob *blob_new(pool *p, uint64_t len) {
  size_class *m = mine_of(p, len);
  blob *b = m != NULL ? m->free : NULL;
  if (b != NULL) {
    m->free = b->next;
    m->n--;
  } else {
    size_t size = sizeof *b + (len ? len : 1);
    b = aligned_alloc(_Alignof(blob), (size + _Alignof(blob) - 1) & ~(_Alignof(blob) - 1));
    if (b == NULL) return NULL;
    b->len = len;
    b->pool = p;
    atomic_fetch_add(&p->allocated, len);
  }
  atomic_init(&b->refs, 1);
  b->next = NULL;
  return b;
}

/* Puts unreferenced b in the pool, or in *drop when the pool is full; *c
 * caches the class of the length put last. Caller holds p->mu. */
static void pool_put(pool *p, blob *b, size_class **c, blob **drop) {
  int keep = p->bytes + p->held + b->len <= p->cap;
  if (keep && (*c == NULL || (*c)->len != b->len)) *c = class_in(&p->classes, b->len);
  if (keep && *c != NULL) {
    b->next = (*c)->free;
    (*c)->free = b;
    (*c)->n++;
    p->bytes += b->len;
  } else {
    b->next = *drop;
    *drop = b;
  }
}

static void blobs_free(blob *b) {
  while (b != NULL) {
    blob *next = b->next;
    atomic_fetch_sub(&b->pool->allocated, b->len);
    free(b);
    b = next;
  }
}

/* Puts the unreferenced blobs of list (linked by next) in the pool under
 * one lock; those it has no room for are freed. ended: staging has ended,
 * so what it held no longer counts against the cap. */
static void pool_put_list(pool *p, blob *list, int ended) {
  size_class *c = NULL;
  blob *drop = NULL;
  pthread_mutex_lock(&p->mu);
  if (ended) p->held = 0;
  while (list != NULL) {
    blob *b = list;
    list = b->next;
    pool_put(p, b, &c, &drop);
  }
  pthread_mutex_unlock(&p->mu);
  blobs_free(drop);
}

static void blob_unref(blob *b) {
  if (b == NULL || atomic_fetch_sub(&b->refs, 1) != 1) return;
  b->next = NULL;
  pool_put_list(b->pool, b, 0);
}

/* Staging ended: what it took and did not use goes back to the shared
 * pool. */
static void mine_return(pool *p) {
  size_class *m, *tmp;
  blob *list = NULL;
  HASH_ITER(hh, p->mine, m, tmp) {
    while (m->free != NULL) {
      blob *b = m->free;
      m->free = b->next;
      b->next = list;
      list = b;
    }
    m->n = 0;
  }
  pool_put_list(p, list, 1);
}

static void classes_drain(size_class **table) {
  size_class *c, *tmp;
  HASH_ITER(hh, *table, c, tmp) {
    blobs_free(c->free);
    HASH_DEL(*table, c);
    free(c);
  }
}

static void pool_drain(pool *p) {
  classes_drain(&p->classes);
  classes_drain(&p->mine);
  p->last = NULL;
  p->bytes = p->held = 0;
  free(p->spare_e);
  free(p->spare_view);
  p->spare_e = NULL;
  p->spare_view = NULL;
  p->spare_cap = 0;
}

/* A tensor of a version or of the staged update: its bytes and their
 * hash. What it is (name, dtype, shape) is its layout's: entry i of a
 * snapshot is lay->metas[i]. Entries stay 32 bytes, so the arrays a
 * publish walks (the staged update, the old version, the new one: 40k
 * entries each for an MoE model) stay small. */
typedef struct entry {
  blob *b;       /* its own buffer, one reference; NULL: in a slab */
  uint8_t *data; /* b->data, or in one of the version's slabs */
  uint64_t xxh3;
  int has_xxh3;
} entry;

/* The slabs a version (or the staged update) holds, one reference each;
 * the last is being filled, up to used bytes, unless shared (then full). */
typedef struct slabs {
  blob **v;
  size_t n, cap;
  uint64_t used;  /* bytes of v[n - 1] given out */
  uint64_t bytes; /* the slabs' lengths, summed */
} slabs;

/* Room for k more slabs in sl. */
static int slabs_grow(slabs *sl, size_t k) {
  if (sl->n + k <= sl->cap) return 0;
  size_t cap = sl->cap ? sl->cap : 8;
  while (cap < sl->n + k) cap *= 2;
  blob **v = realloc(sl->v, cap * sizeof *v);
  if (v == NULL) return WTX_ENOMEM;
  sl->v = v;
  sl->cap = cap;
  return 0;
}

/* k (at most SMALL) bytes in sl's last slab, or in a new one from pool p
 * when it has no room; NULL when out of memory. */
static uint8_t *slab_alloc(pool *p, slabs *sl, uint64_t k) {
  uint64_t at = (sl->used + SLAB_ALIGN - 1) & ~(uint64_t)(SLAB_ALIGN - 1);
  if (sl->n == 0 || at + k > sl->v[sl->n - 1]->len) {
    uint64_t len = sl->n == 0 ? SLAB_FIRST : sl->v[sl->n - 1]->len * 2;
    blob *b = slabs_grow(sl, 1) == 0 ? blob_new(p, len < SLAB_MAX ? len : SLAB_MAX) : NULL;
    if (b == NULL) return NULL;
    sl->v[sl->n++] = b;
    sl->bytes += b->len;
    at = 0;
  }
  sl->used = at + k;
  return sl->v[sl->n - 1]->data + at;
}

/* dst holds src's slabs too (one more reference each), all full to it. */
static int slabs_share(slabs *dst, const slabs *src) {
  if (src == NULL || src->n == 0) return 0;
  if (slabs_grow(dst, src->n) != 0) return WTX_ENOMEM;
  for (size_t i = 0; i < src->n; i++) {
    atomic_fetch_add(&src->v[i]->refs, 1);
    dst->v[dst->n++] = src->v[i];
  }
  dst->bytes += src->bytes;
  dst->used = dst->v[dst->n - 1]->len;
  return 0;
}

/* Lets go of sl's slabs (those no longer held go back to pool p under one
 * lock); sl is empty after, its array kept. */
static void slabs_release(pool *p, slabs *sl) {
  blob *dead = NULL;
  for (size_t i = 0; i < sl->n; i++)
    if (atomic_fetch_sub(&sl->v[i]->refs, 1) == 1) {
      sl->v[i]->next = dead;
      dead = sl->v[i];
    }
  if (dead != NULL) pool_put_list(p, dead, 0);
  sl->n = 0;
  sl->used = sl->bytes = 0;
}

/* Releases the n blobs of e: those no longer referenced go back to the
 * pool under one lock (a snapshot of 40k tensors is released at once).
 * Tensors in slabs are their version's slabs' to release. */
static void blobs_unref(pool *p, const entry *e, size_t n) {
  blob *dead = NULL;
  for (size_t i = 0; i < n; i++) {
    blob *b = e[i].b;
    if (b != NULL && atomic_fetch_sub(&b->refs, 1) == 1) {
      b->next = dead;
      dead = b;
    }
  }
  if (dead != NULL) pool_put_list(p, dead, 0);
}

/* A version's tensors in order (metas) and their index (name ->
 * position). Every snapshot with the same tensors in the same order shares
 * one (every RL step after the first), so publishing copies no meta and
 * builds no index. The metas' names are the index's keys, or, in a first
 * version's layout (staged_take), names' strings, which the index
 * borrows. */
typedef struct layout {
  atomic_int refs;
  wtx__strmap *ix;
  wtx_tensor_meta *metas;
  size_t n;
  wtx__arena names;
} layout;

static void layout_free(layout *l) {
  if (l == NULL) return;
  wtx__strmap_destroy(l->ix);
  wtx__arena_free(&l->names);
  free(l->metas);
  free(l);
}

static void layout_unref(layout *l) {
  if (l != NULL && atomic_fetch_sub(&l->refs, 1) == 1) layout_free(l);
}

/* A new layout of the n metas (malloc'd; the layout takes them, or frees
 * them on failure; NULL when n is 0), each named by its key in a new
 * index. Duplicate names are WTX_EEXIST (callers have refused them
 * before). */
static int layout_build(wtx_tensor_meta *metas, size_t n, layout **out) {
  layout *l = calloc(1, sizeof *l);
  if (l != NULL) l->metas = metas != NULL ? metas : malloc(sizeof *l->metas);
  int rc = l != NULL && l->metas != NULL ? 0 : WTX_ENOMEM;
  if (rc != 0) {
    free(metas);
    goto fail;
  }
  l->n = n;
  rc = wtx__strmap_create(&l->ix);
  for (size_t i = 0; rc == 0 && i < n; i++)
    rc = wtx__strmap_add(l->ix, l->metas[i].name, i, &l->metas[i].name);
  if (rc != 0) goto fail;
  atomic_init(&l->refs, 1);
  *out = l;
  return 0;
fail:
  layout_free(l);
  return rc;
}

typedef struct snapshot {
  atomic_int refs;
  pool *pool; /* where its blobs and arrays go */
  char *version;
  uint64_t generation;
  entry *e;
  size_t n, cap; /* cap: entries e and view have room for */
  layout *lay; /* what e's tensors are, and their index */
  slabs sl;    /* where e's small tensors are */
  uint64_t total;
  uint64_t alloc; /* bytes of memory it holds: its own buffers and its slabs */
  size_t own;     /* entries with a buffer of their own (not in a slab) */
  /* For readers, built by the first wtx_store_acquire (under the store's
   * lock): a publish nobody reads (most RL steps, when only the model
   * serves) pays nothing for it. */
  wtx_store_param *view;
  int viewed;
} snapshot;

/* Arrays for a snapshot of up to n entries: the spare ones when they are
 * large enough. */
static int arrays_take(pool *p, size_t n, snapshot *snap) {
  pthread_mutex_lock(&p->mu);
  if (p->spare_e != NULL && p->spare_cap >= n) {
    snap->e = p->spare_e;
    snap->view = p->spare_view;
    snap->cap = p->spare_cap;
    p->spare_e = NULL;
    p->spare_view = NULL;
    p->spare_cap = 0; /* else arrays_give finds no room and frees them */
  }
  pthread_mutex_unlock(&p->mu);
  if (snap->e != NULL) return 0;
  snap->cap = n;
  snap->e = malloc(n * sizeof *snap->e);
  snap->view = malloc(n * sizeof *snap->view);
  return snap->e != NULL && snap->view != NULL ? 0 : WTX_ENOMEM;
}

/* snap's reader view, built on first use (into the array arrays_take
 * allocated, so it cannot fail). Caller holds the store's mu. */
static void snapshot_view(snapshot *snap) {
  for (size_t i = 0; !snap->viewed && i < snap->n; i++)
    snap->view[i] = (wtx_store_param){snap->lay->metas[i], snap->e[i].data,
                                      snap->e[i].xxh3, snap->e[i].has_xxh3};
  snap->viewed = 1;
}

/* Keeps s's arrays as the spare when they are the larger. */
static void arrays_give(pool *p, snapshot *s) {
  pthread_mutex_lock(&p->mu);
  if (s->e != NULL && s->view != NULL && s->cap > p->spare_cap) {
    entry *e = p->spare_e;
    wtx_store_param *v = p->spare_view;
    p->spare_e = s->e;
    p->spare_view = s->view;
    p->spare_cap = s->cap;
    s->e = e;
    s->view = v;
  }
  pthread_mutex_unlock(&p->mu);
  free(s->e);
  free(s->view);
}

static void snapshot_unref(snapshot *s) {
  if (s == NULL || atomic_fetch_sub(&s->refs, 1) != 1) return;
  if (s->e != NULL && s->own > 0) blobs_unref(s->pool, s->e, s->n);
  slabs_release(s->pool, &s->sl);
  free(s->sl.v);
  arrays_give(s->pool, s);
  layout_unref(s->lay);
  free(s->version);
  free(s);
}

struct wtx_store {
  pthread_mutex_t mu;
  pool pool;
  snapshot *pub[2]; /* main, draft */
  /* What the last commit of each target replaced, held until the target's
   * next begin: revert publishes it again when a trainer undoes that
   * commit (its Finish failed on another replica). Held, not pooled: the
   * same bytes the pool would have kept for the next update, which begin
   * hands over to it. */
  snapshot *replaced[2];
  int revertible[2]; /* a commit since the target's last begin or revert */
  layout *declared; /* NULL: none declared */
  /* staging */
  int staging;
  wtx_target target;
  snapshot *prepared; /* the next published version, built by prepare */
  entry *st;
  size_t n_st, cap_st;
  slabs st_sl; /* where the staged small tensors are */
  size_t st_own; /* staged tensors with a buffer of their own */
  /* While the update stages the published version's tensors in its order
   * (every RL step), staged tensor i is that version's tensor i (base
   * holds a reference), so nothing describes it but base's layout, and no
   * index is built. From the first tensor out of that order (or the first
   * of all, when nothing is published), st_meta[i] describes staged tensor
   * i, named by a copy in st_names (or by base's name, copied in order);
   * st_ix, name -> index into st, borrowing those names, is built only
   * when a lookup by name needs it, at the latest by prepare, then sized
   * for every tensor at once (grown a tensor at a time, it was a quarter
   * of a first sync's CPU at 40k tensors). A first version's prepare makes
   * st_meta, st_names and st_ix its layout, st_lay (staged_take). */
  snapshot *base;
  int in_order;
  wtx__strmap *st_ix;
  wtx__arena st_names;
  wtx_tensor_meta *st_meta; /* cap_meta of them */
  size_t cap_meta;
  layout *st_lay; /* one reference; NULL: not taken */
  /* Where the next check and loaded() look first: an update usually names
   * the tensors in the layout's order, so a compare replaces a hash. */
  size_t check_next, loaded_next;
  /* The caller's metas, so that stage and loaded need not compare again
   * what check compared (at 40k tensors, each compare is a cache miss or
   * two): seen[i], the meta check found at base position i, same as base's
   * there, in this update (cap_seen >= base->n of them, cleared at begin;
   * NULL when out of memory); caller[i], the meta staged tensor i was
   * staged as (cap_st of them). The session checks a chunk's tensors, then
   * stages them, then loads them, in that order and with the same metas,
   * which live unchanged until the chunk ends; a tensor is checked again
   * only by a later chunk that continues it, once it is staged. So while
   * the update stays in base's order, seen[n_st] equal to the meta staged
   * is the tensor check found there; and caller[i] equal to the meta
   * loaded is the same tensor when i was staged in this chunk (chunk_first:
   * n_st at the chunk's first check; an earlier chunk's metas may have been
   * freed and their addresses reused). Any other meta is compared. */
  const wtx_tensor_meta **seen, **caller;
  size_t cap_seen, chunk_first;
  int chunk_staged; /* stage or loaded since the last check */
  /* What check_range found (wtx_model_ops.check_range): positions [0,
   * same_upto) of the session's table same_table are, in name, dtype and
   * shape, positions [0, same_upto) of layout same_lay (a reference held,
   * so that its address is not reused while remembered). Neither a table
   * nor a layout ever changes, so it stays true, and a by-position update
   * (every RL step) compares none of its tensors again: 40k name compares,
   * each a cache miss or two, were a fifth of a steady sync's CPU. */
  layout *same_lay;
  uint64_t same_table;
  size_t same_upto;
};

int wtx_store_create(wtx_store **out) {
  wtx_store *s = calloc(1, sizeof *s);
  if (s == NULL) return WTX_ENOMEM;
  pthread_mutex_init(&s->mu, NULL);
  pthread_mutex_init(&s->pool.mu, NULL);
  *out = s;
  return 0;
}

/* Ends staging; the arrays stay for the next update (megabytes at 40k
 * tensors) until the store goes. */
static void staged_free(wtx_store *s) {
  mine_return(&s->pool);
  if (s->st_own > 0) blobs_unref(&s->pool, s->st, s->n_st);
  slabs_release(&s->pool, &s->st_sl);
  s->n_st = s->st_own = 0;
  wtx__strmap_destroy(s->st_ix);
  s->st_ix = NULL;
  wtx__arena_free(&s->st_names);
  layout_unref(s->st_lay);
  s->st_lay = NULL;
  snapshot_unref(s->base);
  s->base = NULL;
}

void wtx_store_destroy(wtx_store *s) {
  if (s == NULL) return;
  snapshot_unref(s->prepared);
  staged_free(s);
  free(s->st);
  free(s->st_sl.v);
  free(s->st_meta);
  free(s->caller);
  free(s->seen);
  snapshot_unref(s->pub[0]);
  snapshot_unref(s->pub[1]);
  snapshot_unref(s->replaced[0]);
  snapshot_unref(s->replaced[1]);
  layout_unref(s->declared);
  layout_unref(s->same_lay);
  pool_drain(&s->pool);
  pthread_mutex_destroy(&s->pool.mu);
  pthread_mutex_destroy(&s->mu);
  free(s);
}

int wtx_store_declare(wtx_store *s, const wtx_tensor_meta *metas, size_t n) {
  pthread_mutex_lock(&s->mu);
  int rc = 0;
  if (s->pub[0] != NULL || s->staging || s->declared != NULL) {
    rc = WTX_ESTATE;
  } else {
    wtx_tensor_meta *m = malloc((n ? n : 1) * sizeof *m);
    if (m != NULL && n > 0) memcpy(m, metas, n * sizeof *m);
    rc = m != NULL ? layout_build(m, n, &s->declared) : WTX_ENOMEM;
    if (rc == WTX_EEXIST) rc = WTX_EINVAL;
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

/* The position of name among the n metas m indexed by ix, trying *next
 * first; *next becomes the position after. 0 when absent. */
static int find(const wtx_tensor_meta *m, size_t n, const wtx__strmap *ix, const char *name,
                size_t *next, size_t *at) {
  if (*next < n && (m[*next].name == name || strcmp(m[*next].name, name) == 0))
    *at = *next;
  else if (ix == NULL || !wtx__strmap_get(ix, name, at)) return 0;
  *next = *at + 1;
  return 1;
}

/* The layout a chunk tensor of target is checked against: the declared one
 * for the main model, else the published one (NULL: none yet). Caller
 * holds mu. */
static layout *layout_of(const wtx_store *s, wtx_target target, const snapshot *pub) {
  if (target == WTX_TARGET_MAIN && s->declared != NULL) return s->declared;
  return pub != NULL && pub->generation > 0 ? pub->lay : NULL;
}

/* Checks meta against layout l (NULL: none yet, anything goes), looking at
 * position *next first. */
static int check_in(const layout *l, size_t *next, const wtx_tensor_meta *meta, char *err,
                    size_t errlen) {
  size_t i = 0;
  int rc = 0;
  if (l == NULL) {
    rc = 0; /* no layout yet: the first update defines it */
  } else if (!find(l->metas, l->n, l->ix, meta->name, next, &i)) {
    snprintf(err, errlen, "parameter '%s' is not in the model (%zu parameters)",
             meta->name, l->n);
    rc = WTX_ENOENT;
  } else if (!wtx_tensor_meta_same_layout(&l->metas[i], meta)) {
    char a[200], b[200];
    wtx_tensor_meta_str(meta, a, sizeof a);
    wtx_tensor_meta_str(&l->metas[i], b, sizeof b);
    snprintf(err, errlen, "parameter '%s': %s, the model holds %s", meta->name, a, b);
    rc = WTX_EINVAL;
  }
  return rc;
}

int wtx_store_check(wtx_store *s, wtx_target target, const wtx_tensor_meta *meta,
                    char *err, size_t errlen) {
  pthread_mutex_lock(&s->mu);
  size_t next = 0;
  int rc = check_in(layout_of(s, target, PUB(s, target)), &next, meta, err, errlen);
  pthread_mutex_unlock(&s->mu);
  return rc;
}

/* seen[] for the base's positions, all empty. Caller holds mu. */
static void seen_clear(wtx_store *s) {
  size_t n = s->base != NULL ? s->base->n : 0;
  if (n > s->cap_seen) {
    free(s->seen);
    s->seen = malloc(n * sizeof *s->seen);
    s->cap_seen = s->seen != NULL ? n : 0;
  }
  if (s->seen != NULL && n > 0) memset(s->seen, 0, n * sizeof *s->seen);
}

static int store_begin(void *model, wtx_target target) {
  wtx_store *s = model;
  pthread_mutex_lock(&s->mu);
  int rc = 0;
  if (s->staging) {
    rc = WTX_ESTATE;
  } else {
    s->staging = 1;
    snapshot_unref(s->replaced[target == WTX_TARGET_DRAFT]);
    s->replaced[target == WTX_TARGET_DRAFT] = NULL;
    s->revertible[target == WTX_TARGET_DRAFT] = 0;
    s->check_next = s->loaded_next = s->chunk_first = 0;
    s->chunk_staged = 0;
    s->target = target;
    s->base = PUB(s, target);
    if (s->base != NULL) atomic_fetch_add(&s->base->refs, 1);
    s->in_order = 1;
    seen_clear(s);
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

static int staged_grow(wtx_store *s) {
  if (s->n_st < s->cap_st) return 0;
  size_t cap = s->cap_st ? s->cap_st * 2 : 64;
  entry *e = realloc(s->st, cap * sizeof *e);
  if (e != NULL) s->st = e;
  const wtx_tensor_meta **c = e != NULL ? realloc(s->caller, cap * sizeof *c) : NULL;
  if (c == NULL) return WTX_ENOMEM;
  s->caller = c;
  s->cap_st = cap;
  return 0;
}

/* Room in st_meta for staged tensors [0, n): grown only when staging
 * leaves base's order, which an RL step's update never does. */
static int meta_room(wtx_store *s, size_t n) {
  if (n <= s->cap_meta) return 0;
  size_t cap = s->cap_meta ? s->cap_meta : 64;
  while (cap < n) cap *= 2;
  wtx_tensor_meta *m = realloc(s->st_meta, cap * sizeof *m);
  if (m == NULL) return WTX_ENOMEM;
  s->st_meta = m;
  s->cap_meta = cap;
  return 0;
}

/* What the staged tensors are, when out of base's order: st_meta, or the
 * layout a first version's prepare made of it. */
static const wtx_tensor_meta *staged_metas(const wtx_store *s) {
  return s->st_lay != NULL ? s->st_lay->metas : s->st_meta;
}

/* What staged tensor i is. */
static const wtx_tensor_meta *staged_meta(const wtx_store *s, size_t i) {
  return s->in_order ? &s->base->lay->metas[i] : &staged_metas(s)[i];
}

/* From now on st_meta describes every staged tensor: those staged so far
 * in base's order are base's (its layout, which staging holds, names
 * them). */
static int leave_order(wtx_store *s) {
  if (!s->in_order) return 0;
  if (meta_room(s, s->n_st) != 0) return WTX_ENOMEM;
  for (size_t i = 0; i < s->n_st; i++) s->st_meta[i] = s->base->lay->metas[i];
  s->in_order = 0;
  return 0;
}

/* The staged tensors' index (*ix), built now if none is: sized for them
 * all, borrowing their names. WTX_EEXIST: a name staged twice;
 * WTX_ENOMEM. Caller holds mu. */
static int staged_index(wtx_store *s, const wtx__strmap **ix) {
  int rc = 0;
  if (s->st_lay != NULL) {
    *ix = s->st_lay->ix;
    return 0;
  }
  if (s->st_ix == NULL && (rc = leave_order(s)) == 0 &&
      (rc = wtx__strmap_create(&s->st_ix)) == 0) {
    wtx__strmap_reserve(s->st_ix, s->n_st);
    for (size_t i = 0; rc == 0 && i < s->n_st; i++) {
      if (i + 8 < s->n_st) wtx__strmap_prefetch(s->st_ix, s->st_meta[i + 8].name);
      rc = wtx__strmap_add_borrowed(s->st_ix, s->st_meta[i].name, i);
    }
    if (rc != 0) {
      wtx__strmap_destroy(s->st_ix);
      s->st_ix = NULL;
    }
  }
  *ix = s->st_ix;
  return rc;
}

/* The staged metas, names and index become the layout of a first version
 * (nothing published to merge with) instead of being copied into one: at
 * 40k tensors a copy is megabytes, each page of it a fault in a worker's
 * first sync. Staging then reads them there (st_lay) until commit or
 * abort, and stages nothing more. After staged_index. Caller holds mu. */
static int staged_take(wtx_store *s) {
  layout *l = calloc(1, sizeof *l);
  if (l == NULL) return WTX_ENOMEM;
  atomic_init(&l->refs, 1);
  l->metas = s->st_meta;
  l->n = s->n_st;
  l->ix = s->st_ix;
  l->names = s->st_names;
  s->st_meta = NULL;
  s->cap_meta = 0;
  s->st_ix = NULL;
  s->st_names = (wtx__arena)WTX__ARENA_INIT;
  s->st_lay = l;
  return 0;
}

/* Describes staged tensor n_st as meta: while in the base version's order,
 * by base's tensor at that position when it is the same (nothing is
 * copied); else by a copy, its name in st_names. */
static int staged_add(wtx_store *s, const wtx_tensor_meta *meta) {
  const snapshot *base = s->base;
  if (s->in_order && base != NULL && s->n_st < base->n) {
    const wtx_tensor_meta *m = &base->lay->metas[s->n_st];
    if (s->seen != NULL && s->seen[s->n_st] == meta) return 0;
    if (strcmp(m->name, meta->name) == 0 && wtx_tensor_meta_same_layout(m, meta)) return 0;
  }
  if (leave_order(s) != 0 || meta_room(s, s->n_st + 1) != 0) return WTX_ENOMEM;
  size_t len = strlen(meta->name) + 1;
  char *name = wtx__arena_alloc(&s->st_names, len);
  if (name == NULL) return WTX_ENOMEM;
  s->st_meta[s->n_st] = *meta;
  s->st_meta[s->n_st].name = memcpy(name, meta->name, len);
  return s->st_ix != NULL ? wtx__strmap_add_borrowed(s->st_ix, name, s->n_st) : 0;
}

/* Finds the staged tensor named as meta, trying *next first. Caller holds mu. */
static int staged_find(wtx_store *s, const wtx_tensor_meta *meta, size_t *next, size_t *at) {
  /* The same meta as staged there: meta itself is not read (at 40k
   * tensors, each read of one is a cache miss). */
  if (*next < s->n_st && *next >= s->chunk_first && s->caller[*next] == meta) {
    *at = (*next)++;
    return 0;
  }
  const char *name = meta->name;
  if (*next < s->n_st && strcmp(staged_meta(s, *next)->name, name) == 0) {
    *at = (*next)++;
    return 0;
  }
  const wtx__strmap *ix = NULL;
  int rc = staged_index(s, &ix);
  if (rc != 0) return rc;
  return find(staged_metas(s), s->n_st, ix, name, next, at) ? 0 : WTX_ENOENT;
}

static int store_stage(void *model, const wtx_tensor_meta *meta, uint8_t **dst) {
  wtx_store *s = model;
  if (s->st_lay != NULL) return WTX_ESTATE; /* prepared: its tensors are fixed */
  entry e = {0};
  if (meta->nbytes <= SMALL) e.data = slab_alloc(&s->pool, &s->st_sl, meta->nbytes);
  else if ((e.b = blob_new(&s->pool, meta->nbytes)) != NULL) e.data = e.b->data;
  if (e.data == NULL) return WTX_ENOMEM;
  int rc = staged_grow(s);
  if (rc == 0) rc = staged_add(s, meta);
  if (rc == 0) {
    s->chunk_staged = 1;
    s->caller[s->n_st] = meta;
    s->st[s->n_st++] = e;
    s->st_own += e.b != NULL;
    *dst = e.data;
  } else {
    blob_unref(e.b); /* a small one's bytes stay unused in its slab */
  }
  return rc;
}

static int store_stage_chunk(void *model, const wtx_tensor_meta *metas, size_t n,
                             uint8_t **dst) {
  for (size_t i = 0; i < n; i++) {
    if (i + 8 < n) __builtin_prefetch(&metas[i + 8]); /* read long ago, by the session */
    int rc = store_stage(model, &metas[i], &dst[i]);
    if (rc != 0) return rc;
  }
  return 0;
}

static int store_loaded_chunk(void *model, const wtx_tensor_meta *metas, size_t n,
                              const uint64_t *xxh3) {
  wtx_store *s = model;
  s->chunk_staged = 1;
  for (size_t i = 0, at = 0; i < n; i++) {
    int rc = staged_find(s, &metas[i], &s->loaded_next, &at);
    if (rc != 0) return rc;
    s->st[at].xxh3 = xxh3 != NULL ? xxh3[i] : 0;
    s->st[at].has_xxh3 = xxh3 != NULL;
  }
  return 0;
}

static int store_loaded(void *model, const wtx_tensor_meta *meta, const uint64_t *xxh3) {
  return store_loaded_chunk(model, meta, 1, xxh3);
}

/* Appends to snap e's tensor (m says what it is): a share of its own
 * buffer; or, in a slab, the tensor as it is (its slab is snap's), or with
 * copy a copy in snap's own slabs (a carried small tensor). m is read only
 * to copy: in the steady state nothing but the entries is touched. */
static int snapshot_add(snapshot *snap, const entry *e, const wtx_tensor_meta *m, int copy) {
  entry *d = &snap->e[snap->n];
  *d = *e;
  if (e->b != NULL) {
    atomic_fetch_add(&e->b->refs, 1);
    snap->alloc += e->b->len;
    snap->own++;
  } else if (copy) {
    if ((d->data = slab_alloc(snap->pool, &snap->sl, m->nbytes)) == NULL) return WTX_ENOMEM;
    memcpy(d->data, e->data, m->nbytes);
  }
  snap->n++;
  return 0;
}

/* Fills snap (arrays taken) with old's tensors first, in their order,
 * replaced where the staged st has them (st_meta describing them, indexed
 * by name in ix), then the tensors new in st, in update order; m[i]
 * receives what snap's tensor i is. *same: every replacement is the same
 * tensor as old's (so old's layout serves when no tensor is new).
 * *replaced: how many of old's tensors were. */
static int snapshot_merge(snapshot *snap, const snapshot *old, const entry *st,
                          const wtx_tensor_meta *st_meta, size_t n_st, const wtx__strmap *ix,
                          char *used, wtx_tensor_meta *m, int *same, size_t *replaced) {
  size_t n_old = old != NULL ? old->n : 0;
  int rc = 0;
  for (size_t i = 0, j, next = 0; rc == 0 && i < n_old; i++) {
    const wtx_tensor_meta *was = &old->lay->metas[i];
    int fresh = find(st_meta, n_st, ix, was->name, &next, &j);
    if (fresh) {
      used[j] = 1;
      (*replaced)++;
      if (!wtx_tensor_meta_same_layout(&st_meta[j], was)) *same = 0;
    }
    m[snap->n] = fresh ? st_meta[j] : *was;
    snap->total += m[snap->n].nbytes;
    rc = snapshot_add(snap, fresh ? &st[j] : &old->e[i], was, !fresh);
  }
  for (size_t j = 0; rc == 0 && j < n_st; j++)
    if (!used[j]) {
      m[snap->n] = st_meta[j];
      snap->total += st_meta[j].nbytes;
      rc = snapshot_add(snap, &st[j], &st_meta[j], 0);
    }
  return rc;
}

/* What an update staged, as a snapshot is built of it: n entries e (own
 * of them with a buffer of their own), their small tensors in slabs sl
 * (NULL: nothing staged, a relabel); meta NULL: e are the old version's
 * first n, staged in its order; else meta describes them, indexed by name
 * in ix (NULL when n is 0), and are the tensors of lay, in its order, when
 * lay is not NULL (a first version's, staged_take). */
typedef struct staged {
  const entry *e;
  size_t n, own;
  const wtx_tensor_meta *meta;
  const wtx__strmap *ix;
  layout *lay;
  const slabs *sl;
} staged;

/* Fills snap with st's tensors in their order: a version with nothing to
 * carry over. */
static int snapshot_fill(snapshot *snap, const staged *st) {
  int rc = 0;
  for (size_t j = 0; rc == 0 && j < st->n; j++) {
    snap->total += st->meta[j].nbytes;
    rc = snapshot_add(snap, &st->e[j], &st->meta[j], 0);
  }
  return rc;
}

/* Fills snap with old's tensors, its first st->n replaced by st's, in
 * old's order (st->meta NULL). Staged entries without a buffer of their
 * own are copied as a block: a steady-state publish of 40k tiny tensors
 * moves 1.3 MB and touches nothing else. */
static int snapshot_fill_aligned(snapshot *snap, const snapshot *old, const staged *st,
                                 int copy) {
  size_t n_old = old != NULL ? old->n : 0, i = 0;
  int rc = 0;
  if (st->own == 0 && st->n > 0) {
    memcpy(snap->e, st->e, st->n * sizeof *st->e);
    snap->n = i = st->n;
  }
  for (; rc == 0 && i < n_old; i++)
    rc = snapshot_add(snap, i < st->n ? &st->e[i] : &old->e[i], &old->lay->metas[i],
                      copy && i >= st->n);
  snap->total = n_old > 0 ? old->total : 0; /* old's layout, so old's bytes */
  return rc;
}

/* The one place a snapshot is made, labelled version, of old and what st
 * staged, sharing bytes and copying none but carried small tensors. With
 * st->meta NULL old's layout serves; with st->lay and no tensor in old,
 * st->lay. Else snapshot_merge says what goes where, and old's layout
 * serves when st adds no tensor. *out has one reference. */
static int snapshot_build(pool *p, const snapshot *old, const staged *st, const char *version,
                          uint64_t generation, snapshot **out) {
  size_t n_old = old != NULL ? old->n : 0, n_st = st->n;
  size_t replaced = st->meta == NULL ? n_st : 0;
  int copy = st->sl != NULL; /* a publish: carried small tensors are copied */
  int same = 1, whole = st->meta != NULL && st->lay != NULL && n_old == 0;
  char *used = NULL;
  wtx_tensor_meta *m = NULL;
  snapshot *snap = calloc(1, sizeof *snap);
  int rc = snap != NULL ? 0 : WTX_ENOMEM;
  if (rc != 0) goto fail;
  atomic_init(&snap->refs, 1);
  snap->pool = p;
  snap->generation = generation;
  if ((snap->version = strdup(version)) == NULL) rc = WTX_ENOMEM;
  if (rc == 0) rc = arrays_take(p, n_old + n_st + 1, snap);
  if (rc == 0) rc = slabs_share(&snap->sl, copy ? st->sl : old != NULL ? &old->sl : NULL);
  if (rc == 0 && st->meta != NULL && !whole &&
      ((used = calloc(n_st + 1, 1)) == NULL ||
       (m = malloc((n_old + n_st + 1) * sizeof *m)) == NULL))
    rc = WTX_ENOMEM;
  if (rc != 0) goto fail;
  if (st->meta == NULL)
    rc = snapshot_fill_aligned(snap, old, st, copy);
  else if (whole)
    rc = snapshot_fill(snap, st);
  else
    rc = snapshot_merge(snap, old, st->e, st->meta, n_st, st->ix, used, m, &same, &replaced);
  if (rc != 0) goto fail;
  snap->alloc += snap->sl.bytes;
  layout *shared = whole ? st->lay : old != NULL && replaced == n_st && same ? old->lay : NULL;
  if (shared != NULL) {
    snap->lay = shared;
    atomic_fetch_add(&snap->lay->refs, 1);
  } else {
    rc = layout_build(m, snap->n, &snap->lay);
    m = NULL; /* the layout's, or freed */
  }
  if (rc != 0) goto fail;
  free(used);
  free(m);
  *out = snap;
  return 0;
fail:
  free(used);
  free(m);
  snapshot_unref(snap);
  return rc;
}

/* The first version of a model whose layout was declared must hold every
 * declared tensor: none has bytes to carry over. Caller holds mu. */
static int check_complete(wtx_store *s, char *err, size_t errlen) {
  if (s->target != WTX_TARGET_MAIN || s->declared == NULL || PUB(s, WTX_TARGET_MAIN) != NULL)
    return 0;
  const wtx__strmap *ix = NULL;
  int rc = staged_index(s, &ix);
  if (rc != 0) return rc;
  for (size_t i = 0; i < s->declared->n; i++)
    if (!wtx__strmap_get(ix, s->declared->metas[i].name, NULL)) {
      snprintf(err, errlen, "the first version must hold every parameter of the model "
               "spec; '%s' is missing (%zu of %zu sent)", s->declared->metas[i].name,
               s->n_st, s->declared->n);
      return WTX_ENOENT;
    }
  return 0;
}

/* Everything a publish needs that can fail: the completeness check and the
 * snapshot (every allocation), so commit only swaps pointers. */
static int store_prepare(void *model, const char *version, char *err, size_t errlen) {
  wtx_store *s = model;
  pthread_mutex_lock(&s->mu);
  snapshot *old = PUB(s, s->target);
  snapshot *stale = s->prepared; /* prepared before: replaced */
  s->prepared = NULL;
  int rc = s->staging ? check_complete(s, err, errlen) : WTX_ESTATE;
  /* Staged in the order of old's layout: position i of old is position i
   * of the update, so the snapshot needs no index of the update. */
  int aligned = s->in_order && s->base != NULL && old != NULL && old->lay == s->base->lay;
  const wtx__strmap *ix = NULL;
  if (rc == 0 && !aligned) rc = staged_index(s, &ix);
  if (rc == 0 && !aligned && (old == NULL || old->n == 0) && s->st_lay == NULL && s->n_st > 0)
    rc = staged_take(s);
  if (rc == 0) {
    staged st = {.e = s->st, .n = s->n_st, .own = s->st_own, .sl = &s->st_sl,
                 .meta = aligned ? NULL : staged_metas(s), .ix = ix, .lay = s->st_lay};
    rc = snapshot_build(&s->pool, old, &st, version, (old ? old->generation : 0) + 1,
                        &s->prepared);
  }
  snapshot_unref(stale);
  pthread_mutex_unlock(&s->mu);
  return rc;
}

/* Publishes the prepared snapshot (preparing it first when nobody did):
 * after a successful prepare nothing here can fail. */
static int store_commit(void *model, const char *version) {
  wtx_store *s = model;
  if (s->prepared == NULL) {
    char err[512];
    int rc = store_prepare(model, version, err, sizeof err);
    if (rc != 0) return rc;
  }
  pthread_mutex_lock(&s->mu);
  snapshot *old = PUB(s, s->target), *snap = s->prepared;
  s->prepared = NULL;
  PUB(s, s->target) = snap;
  /* Keep up to one spare copy of the largest model published. */
  pthread_mutex_lock(&s->pool.mu);
  if (snap->alloc > s->pool.cap) s->pool.cap = snap->alloc;
  pthread_mutex_unlock(&s->pool.mu);
  /* Staging's unused buffers go back first (staged_free): until then
   * they count against the pool's cap, where old's must find room. */
  staged_free(s);
  snapshot_unref(s->replaced[s->target == WTX_TARGET_DRAFT]);
  s->replaced[s->target == WTX_TARGET_DRAFT] = old;
  s->revertible[s->target == WTX_TARGET_DRAFT] = 1;
  s->staging = 0;
  pthread_mutex_unlock(&s->mu);
  return 0;
}

/* Publishes again what target's last commit replaced (nothing, when that
 * was the first version: the target then holds no weights). */
static int store_revert(void *model, wtx_target target, char *err, size_t errlen) {
  wtx_store *s = model;
  pthread_mutex_lock(&s->mu);
  int t = target == WTX_TARGET_DRAFT, rc = 0;
  if (s->staging || !s->revertible[t]) {
    snprintf(err, errlen, "no commit to undo: an update began since, or none was published");
    rc = WTX_ESTATE;
  } else {
    snapshot *undone = PUB(s, target);
    PUB(s, target) = s->replaced[t];
    s->replaced[t] = NULL;
    s->revertible[t] = 0;
    snapshot_unref(undone);
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

static void store_abort(void *model) {
  wtx_store *s = model;
  pthread_mutex_lock(&s->mu);
  snapshot_unref(s->prepared);
  s->prepared = NULL;
  staged_free(s);
  s->staging = 0;
  pthread_mutex_unlock(&s->mu);
}

/* The model ops come one at a time from the session (wtx_model_ops), and
 * readers never touch the staging fields: staging needs no store lock. */

/* A check during the update: the layout checked against (the declared one,
 * or the base the update holds: a relabel may have replaced the published
 * snapshot, never its layout), and a new chunk begun at the first check
 * after a stage or loaded. */
static layout *staging_check(wtx_store *s) {
  if (s->chunk_staged) s->chunk_first = s->n_st;
  s->chunk_staged = 0;
  return layout_of(s, s->target, s->base);
}

/* meta, found same as l's tensor at position at: stage need not compare
 * them again (seen) where l is the base's. */
static void remember(wtx_store *s, const layout *l, size_t at, const wtx_tensor_meta *meta) {
  if (s->base != NULL && l == s->base->lay && s->seen != NULL) s->seen[at] = meta;
}

/* Checks meta during the update against l (NULL: anything goes), looking
 * at check_next first, and remembers where it found it. */
static int staged_check_in(wtx_store *s, const layout *l, const wtx_tensor_meta *meta,
                           char *err, size_t errlen) {
  int rc = check_in(l, &s->check_next, meta, err, errlen);
  if (rc == 0 && l != NULL) remember(s, l, s->check_next - 1, meta);
  return rc;
}

static int store_check(void *model, wtx_target target, const wtx_tensor_meta *meta,
                       char *err, size_t errlen) {
  wtx_store *s = model;
  if (!s->staging || target != s->target) return wtx_store_check(s, target, meta, err, errlen);
  return staged_check_in(s, staging_check(s), meta, err, errlen);
}

/* From now on, same_* speak of table and l. */
static void same_for(wtx_store *s, layout *l, uint64_t table) {
  if (s->same_lay == l && s->same_table == table) return;
  atomic_fetch_add(&l->refs, 1);
  layout_unref(s->same_lay);
  s->same_lay = l;
  s->same_table = table;
  s->same_upto = 0;
}

static int store_check_range(void *model, wtx_target target, uint64_t table, size_t first,
                             const wtx_tensor_meta *metas, size_t n, size_t *bad, char *err,
                             size_t errlen) {
  wtx_store *s = model;
  int rc = 0;
  if (!s->staging || target != s->target) { /* outside its update: as check does */
    for (size_t i = 0; rc == 0 && i < n; i++)
      if ((rc = wtx_store_check(s, target, &metas[i], err, errlen)) != 0) *bad = i;
    return rc;
  }
  layout *l = staging_check(s);
  if (l == NULL) return 0; /* no layout yet: the first update defines it */
  same_for(s, l, table);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    size_t p = first + i;
    if (p < s->same_upto) { /* found the same before: not read again */
      s->check_next = p + 1;
      remember(s, l, p, &metas[i]);
      continue;
    }
    s->check_next = p;
    if ((rc = staged_check_in(s, l, &metas[i], err, errlen)) != 0) *bad = i;
    else if (p == s->same_upto && s->check_next == p + 1) s->same_upto++;
  }
  return rc;
}

/* A published tensor's bytes, copied outside the lock: the snapshot's
 * reference keeps them while a large tensor is copied, and inspection
 * and the next publish do not wait for the copy. */
static int store_read(void *model, wtx_target target, const wtx_tensor_meta *meta,
                      uint8_t *dst, char *err, size_t errlen) {
  wtx_store *s = model;
  pthread_mutex_lock(&s->mu);
  snapshot *pub = PUB(s, target);
  size_t next = 0, i = 0;
  int found = pub != NULL && pub->lay != NULL &&
              find(pub->lay->metas, pub->lay->n, pub->lay->ix, meta->name, &next, &i) &&
              i < pub->n && pub->lay->metas[i].nbytes == meta->nbytes;
  if (found) atomic_fetch_add(&pub->refs, 1);
  pthread_mutex_unlock(&s->mu);
  if (!found) {
    snprintf(err, errlen, "'%s' is not served here with %llu bytes", meta->name,
             (unsigned long long)meta->nbytes);
    return WTX_ENOENT;
  }
  memcpy(dst, pub->e[i].data, meta->nbytes);
  snapshot_unref(pub);
  return 0;
}

const wtx_model_ops wtx_store_model_ops = {
    .version = WTX_MODEL_OPS_VERSION,
    .check = store_check,
    .begin = store_begin,
    .stage = store_stage,
    .loaded = store_loaded,
    .prepare = store_prepare,
    .commit = store_commit,
    .abort = store_abort,
    .revert = store_revert,
    .stage_chunk = store_stage_chunk,
    .loaded_chunk = store_loaded_chunk,
    .check_range = store_check_range,
    .read = store_read,
};

void wtx__store_version(wtx_store *s, wtx_target target, char *out, size_t len) {
  pthread_mutex_lock(&s->mu);
  const snapshot *snap = PUB(s, target);
  snprintf(out, len, "%s", snap != NULL ? snap->version : "");
  pthread_mutex_unlock(&s->mu);
}

int wtx_store_acquire(wtx_store *s, wtx_target target, wtx_store_view *out) {
  if (target != WTX_TARGET_MAIN && target != WTX_TARGET_DRAFT) return WTX_EINVAL;
  memset(out, 0, sizeof *out);
  out->version = "";
  pthread_mutex_lock(&s->mu);
  snapshot *snap = PUB(s, target);
  if (snap != NULL) {
    snapshot_view(snap);
    atomic_fetch_add(&snap->refs, 1);
    out->version = snap->version;
    out->generation = snap->generation;
    out->params = snap->view;
    out->n_params = snap->n;
    out->total_bytes = snap->total;
    out->internal = snap;
  }
  pthread_mutex_unlock(&s->mu);
  return 0;
}

void wtx_store_release(wtx_store *s, wtx_store_view *v) {
  (void)s;
  snapshot_unref(v->internal);
  memset(v, 0, sizeof *v);
}

int wtx_store_set_version(wtx_store *s, const char *version, char **previous) {
  /* Readers hold the version string through their snapshot: publish a new
   * snapshot that shares every tensor of the current one (if any). */
  pthread_mutex_lock(&s->mu);
  snapshot *old = PUB(s, WTX_TARGET_MAIN), *snap = NULL;
  staged none = {0};
  int rc = snapshot_build(&s->pool, old, &none, version, old != NULL ? old->generation : 0,
                          &snap);
  if (rc == 0 && previous != NULL &&
      (*previous = strdup(old != NULL ? old->version : "")) == NULL)
    rc = WTX_ENOMEM;
  if (rc == 0) {
    PUB(s, WTX_TARGET_MAIN) = snap;
    snapshot_unref(old);
  } else {
    snapshot_unref(snap);
  }
  pthread_mutex_unlock(&s->mu);
  return rc;
}

uint64_t wtx__store_allocated_bytes(wtx_store *s) { return atomic_load(&s->pool.allocated); }

uint64_t wtx__store_pooled_bytes(wtx_store *s) {
  pthread_mutex_lock(&s->pool.mu);
  uint64_t n = s->pool.bytes;
  pthread_mutex_unlock(&s->pool.mu);
  return n;
}
