/* wtx_plan_make: the one place that decides who sends which bytes to whom
 * in a sharded sync (plan.h). */
#include <endian.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/hash.h"
#include "common/layout.h"
#include "transport/plan.h"

struct wtx_plan {
  uint32_t n_ranks, n_workers;
  size_t n;
  wtx_tensor_meta *metas; /* names not kept: every check is done */
  wtx_ownership *own;     /* NULL: every rank owns every parameter */
  uint32_t *own_pool;     /* owners and mesh shapes of own[] */
  int32_t *place_pool;    /* placements of own[] */
  wtx_slice *slices;      /* every worker's, worker after worker */
  size_t *slice_first;    /* worker w's: [slice_first[w], slice_first[w + 1]) */
  wtx_piece *pieces;
  size_t n_pieces;
  size_t *rank_first;     /* rank r's pieces: [rank_first[r], rank_first[r + 1]) */
  uint32_t *worker_idx;   /* piece indices by worker, then rank */
  size_t *worker_first;
  uint64_t *rank_bytes, *worker_bytes;
  uint64_t digest;
};


static const wtx_ownership *own_of(const wtx_plan *p, size_t i) {
  return p->own != NULL ? &p->own[i] : NULL;
}

static int replicated_axis(const wtx_ownership *o, size_t a) {
  return o->placements == NULL || o->placements[a] < 0;
}

/* ---- copying and checking the inputs ---- */

static int copy_ownership(wtx_plan *p, const wtx_plan_input *in, char *err, size_t errlen) {
  if (in->owners == NULL) return 0;
  size_t u32 = 0, i32 = 0;
  for (size_t i = 0; i < in->n; i++) {
    const wtx_ownership *o = &in->owners[i];
    int rc = wtx_ownership_check(&in->metas[i], o, in->n_ranks, err, errlen);
    if (rc != 0) return rc;
    u32 += o->n_owners + o->mesh_ndim;
    i32 += o->placements != NULL ? wtx__mesh_axes(o) : 0;
  }
  p->own = malloc(in->n * sizeof *p->own);
  p->own_pool = malloc((u32 + 1) * sizeof *p->own_pool);
  p->place_pool = malloc((i32 + 1) * sizeof *p->place_pool);
  if (p->own == NULL || p->own_pool == NULL || p->place_pool == NULL) return WTX_ENOMEM;
  uint32_t *u = p->own_pool;
  int32_t *s = p->place_pool;
  for (size_t i = 0; i < in->n; i++) {
    const wtx_ownership *o = &in->owners[i];
    wtx_ownership *c = &p->own[i];
    *c = *o;
    if (o->owners == NULL) continue;
    c->owners = memcpy(u, o->owners, o->n_owners * sizeof *u);
    u += o->n_owners;
    c->mesh_shape = o->mesh_ndim > 0 ? memcpy(u, o->mesh_shape, o->mesh_ndim * sizeof *u) : NULL;
    u += o->mesh_ndim;
    if (o->placements == NULL) continue;
    size_t axes = wtx__mesh_axes(o);
    c->placements = memcpy(s, o->placements, axes * sizeof *s);
    s += axes;
  }
  return 0;
}

static int check_slice(const wtx_plan_input *in, uint32_t w, size_t k, char *err,
                       size_t errlen) {
  const wtx_slice *s = &in->needs[w][k];
  if (s->param >= in->n) {
    snprintf(err, errlen, "worker %u slice %zu: param %u of %zu parameters", w, k, s->param,
             in->n);
    return WTX_EINVAL;
  }
  const wtx_tensor_meta *m = &in->metas[s->param];
  if (s->dim == WTX_SLICE_WHOLE) return 0;
  if (s->dim < 0 || (size_t)s->dim >= m->ndim) {
    snprintf(err, errlen, "'%s': worker %u slices dim %d of a %zu-D tensor", m->name, w,
             s->dim, m->ndim);
    return WTX_EINVAL;
  }
  uint64_t extent = m->shape[s->dim];
  if (s->length == 0 || s->start >= extent || s->length > extent - s->start) {
    snprintf(err, errlen,
             "'%s': worker %u slice [%llu, %llu + %llu) of dim %d is out of range (size %llu)",
             m->name, w, (unsigned long long)s->start, (unsigned long long)s->start,
             (unsigned long long)s->length, s->dim, (unsigned long long)extent);
    return WTX_EINVAL;
  }
  return 0;
}

static int by_param_dim_start(const void *a, const void *b, void *arg) {
  const wtx_slice *base = arg;
  const wtx_slice *x = &base[*(const size_t *)a], *y = &base[*(const size_t *)b];
  if (x->param != y->param) return x->param < y->param ? -1 : 1;
  if (x->dim != y->dim) return x->dim < y->dim ? -1 : 1;
  return x->start < y->start ? -1 : x->start > y->start;
}

/* Two slices of one parameter overlap unless they cut the same dim into
 * disjoint ranges (a whole tensor overlaps anything; slices of two dims
 * meet in a corner). Sorted by param, dim and start, neighbours tell. */
static int check_overlaps(const wtx_plan_input *in, uint32_t w, size_t *order, char *err,
                          size_t errlen) {
  size_t k = in->n_needs[w];
  for (size_t i = 0; i < k; i++) order[i] = i;
  if (k > 1) qsort_r(order, k, sizeof *order, by_param_dim_start, (void *)in->needs[w]);
  for (size_t i = 1; i < k; i++) {
    const wtx_slice *a = &in->needs[w][order[i - 1]], *b = &in->needs[w][order[i]];
    if (a->param != b->param) continue;
    int disjoint = a->dim == b->dim && a->dim >= 0 && a->start + a->length <= b->start;
    if (!disjoint) {
      snprintf(err, errlen, "'%s': worker %u holds overlapping slices (%zu and %zu)",
               in->metas[a->param].name, w, order[i - 1], order[i]);
      return WTX_EINVAL;
    }
  }
  return 0;
}

static int copy_needs(wtx_plan *p, const wtx_plan_input *in, char *err, size_t errlen) {
  size_t total = 0, most = 0;
  for (uint32_t w = 0; w < in->n_workers; w++) {
    total += in->n_needs[w];
    if (in->n_needs[w] > most) most = in->n_needs[w];
  }
  p->slices = malloc((total + 1) * sizeof *p->slices);
  p->slice_first = malloc((in->n_workers + 1) * sizeof *p->slice_first);
  size_t *order = malloc((most + 1) * sizeof *order);
  int rc = p->slices == NULL || p->slice_first == NULL || order == NULL ? WTX_ENOMEM : 0;
  size_t at = 0;
  for (uint32_t w = 0; w < in->n_workers && rc == 0; w++) {
    p->slice_first[w] = at;
    for (size_t k = 0; k < in->n_needs[w] && rc == 0; k++) rc = check_slice(in, w, k, err, errlen);
    if (rc == 0) rc = check_overlaps(in, w, order, err, errlen);
    if (rc != 0) break;
    if (in->n_needs[w] > 0) memcpy(&p->slices[at], in->needs[w], in->n_needs[w] * sizeof *p->slices);
    at += in->n_needs[w];
  }
  p->slice_first[in->n_workers] = at;
  free(order);
  return rc;
}

/* ---- pieces ---- */

static int box_meet(const wtx_box *a, const wtx_box *b, wtx_box *out) {
  out->ndim = a->ndim;
  for (size_t d = 0; d < a->ndim; d++) {
    uint64_t lo = a->lo[d] > b->lo[d] ? a->lo[d] : b->lo[d];
    uint64_t ha = a->lo[d] + a->len[d], hb = b->lo[d] + b->len[d], hi = ha < hb ? ha : hb;
    if (hi <= lo) return 0;
    out->lo[d] = lo;
    out->len[d] = hi - lo;
  }
  return 1;
}

typedef struct builder {
  wtx_piece *pieces;
  uint64_t *bytes; /* per piece */
  size_t n, cap, cap_bytes;
  size_t *pend;    /* pieces to give one of several owners (a Replicate axis) */
  size_t n_pend, cap_pend;
  wtx_box *boxes;  /* the slice boxes of the parameter being planned */
  size_t cap_boxes;
} builder;

static int grow(void **v, size_t *cap, size_t need, size_t size) {
  if (need <= *cap) return 0;
  size_t c = *cap ? *cap * 2 : 1024;
  while (c < need) c *= 2;
  void *m = realloc(*v, c * size);
  if (m == NULL) return WTX_ENOMEM;
  *v = m;
  *cap = c;
  return 0;
}

/* Whether the owner at pos is the first of its replicas: 0 on every
 * Replicate axis. The owners it stands for differ from it only there. */
static int representative(const wtx_ownership *o, size_t pos) {
  size_t axes = wtx__mesh_axes(o);
  for (size_t a = axes; a-- > 0;) {
    uint32_t size = wtx__mesh_axis(o, a);
    if (replicated_axis(o, a) && pos % size != 0) return 0;
    pos /= size;
  }
  return 1;
}

static size_t replicas(const wtx_ownership *o) {
  size_t axes = wtx__mesh_axes(o), k = 1;
  for (size_t a = 0; a < axes; a++)
    if (replicated_axis(o, a)) k *= wtx__mesh_axis(o, a);
  return k;
}

/* The worker slice k (an index into p->slices) belongs to. */
static uint32_t worker_of(const wtx_plan *p, size_t k) {
  uint32_t lo = 0, hi = p->n_workers - 1;
  while (lo < hi) { /* the last w with slice_first[w] <= k */
    uint32_t mid = lo + (hi - lo + 1) / 2;
    if (p->slice_first[mid] <= k) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/* The pieces of parameter i: each part an owner holds met with each slice
 * that wants it (wants: slice indices into p->slices, by worker). */
static int plan_param(const wtx_plan *p, size_t i, const size_t *wants, size_t n_wants,
                      builder *b) {
  const wtx_ownership every = {.owners = NULL, .n_owners = p->n_ranks};
  const wtx_ownership *o = own_of(p, i);
  if (o == NULL || o->owners == NULL) o = &every;
  size_t k = replicas(o), elsize = wtx_dtype_size(p->metas[i].dtype);
  /* Each wanting slice's box, once for every owner. */
  if (grow((void **)&b->boxes, &b->cap_boxes, n_wants, sizeof *b->boxes) != 0)
    return WTX_ENOMEM;
  for (size_t j = 0; j < n_wants; j++)
    wtx_slice_box(&p->metas[i], &p->slices[wants[j]], &b->boxes[j]);
  for (size_t pos = 0; pos < o->n_owners; pos++) {
    if (!representative(o, pos)) continue;
    wtx_box own, part;
    wtx_ownership_box(&p->metas[i], o, pos, &own);
    for (size_t j = 0; j < n_wants; j++) {
      if (!box_meet(&own, &b->boxes[j], &part) || wtx_box_elements(&part) == 0) continue;
      if (grow((void **)&b->pieces, &b->cap, b->n + 1, sizeof *b->pieces) != 0 ||
          grow((void **)&b->bytes, &b->cap_bytes, b->n + 1, sizeof *b->bytes) != 0)
        return WTX_ENOMEM;
      uint32_t w = worker_of(p, wants[j]);
      b->pieces[b->n] = (wtx_piece){.param = (uint32_t)i, .owner = (uint32_t)pos,
                                    .rank = o->owners ? o->owners[pos] : (uint32_t)pos,
                                    .worker = w,
                                    .slice = (uint32_t)(wants[j] - p->slice_first[w])};
      b->bytes[b->n] = wtx_box_elements(&part) * elsize;
      if (k > 1) {
        if (grow((void **)&b->pend, &b->cap_pend, b->n_pend + 1, sizeof *b->pend) != 0)
          return WTX_ENOMEM;
        b->pend[b->n_pend++] = b->n;
      }
      b->n++;
    }
  }
  return 0;
}

static int by_bytes_desc(const void *a, const void *b, void *arg) {
  const uint64_t *bytes = arg;
  size_t x = *(const size_t *)a, y = *(const size_t *)b;
  if (bytes[x] != bytes[y]) return bytes[x] > bytes[y] ? -1 : 1;
  return x < y ? -1 : x > y; /* metadata order */
}

/* The owner positions that hold the same part as the representative pos:
 * pos moved along every Replicate axis. *n_out of them into out. */
static void candidates(const wtx_ownership *o, size_t pos, uint32_t *out, size_t *n_out) {
  size_t axes = wtx__mesh_axes(o), stride[WTX_MAX_MESH_DIMS], s = 1;
  for (size_t a = axes; a-- > 0;) {
    stride[a] = s;
    s *= wtx__mesh_axis(o, a);
  }
  size_t n = 1;
  out[0] = (uint32_t)pos;
  for (size_t a = 0; a < axes; a++) {
    if (!replicated_axis(o, a)) continue;
    size_t have = n;
    for (uint32_t c = 1; c < wtx__mesh_axis(o, a); c++)
      for (size_t j = 0; j < have; j++) out[n++] = (uint32_t)(out[j] + c * stride[a]);
  }
  *n_out = n;
}

/* Each replicated piece goes to the candidate furthest below its fair
 * share, largest first (plan.h). Shares are binary64 sums in one fixed
 * order, so every side that runs this code picks the same ranks. */
static int balance(wtx_plan *p, builder *b) {
  if (b->n_pend > 1) qsort_r(b->pend, b->n_pend, sizeof *b->pend, by_bytes_desc, b->bytes);
  uint64_t *load = calloc(p->n_ranks, sizeof *load);
  double *fair = calloc(p->n_ranks, sizeof *fair);
  uint32_t *cand = malloc(p->n_ranks * sizeof *cand);
  int rc = load == NULL || fair == NULL || cand == NULL ? WTX_ENOMEM : 0;
  const wtx_ownership every = {.owners = NULL, .n_owners = p->n_ranks};
  for (size_t i = 0; i < b->n_pend && rc == 0; i++) {
    wtx_piece *pc = &b->pieces[b->pend[i]];
    uint64_t bytes = b->bytes[b->pend[i]];
    const wtx_ownership *o = own_of(p, pc->param);
    if (o == NULL || o->owners == NULL) o = &every;
    size_t k, best = 0;
    candidates(o, pc->owner, cand, &k);
    double share = (double)bytes / (double)k, lowest = 0;
    for (size_t j = 0; j < k; j++) {
      uint32_t r = o->owners ? o->owners[cand[j]] : cand[j];
      fair[r] += share;
      double deficit = (double)load[r] - fair[r];
      if (j == 0 || deficit < lowest) {
        lowest = deficit;
        best = j;
      }
    }
    pc->owner = cand[best];
    pc->rank = o->owners ? o->owners[cand[best]] : cand[best];
    load[pc->rank] += bytes;
  }
  free(load);
  free(fair);
  free(cand);
  return rc;
}

/* One stable counting-sort pass of n pieces from `from` into `to` by the
 * key KEY(pc), in [0, buckets); at has buckets + 1 entries. */
#define SCATTER(to, from, n, at, buckets, KEY)                                   \
  do {                                                                           \
    memset(at, 0, ((buckets) + 1) * sizeof *(at));                               \
    for (size_t i_ = 0; i_ < (n); i_++) (at)[KEY(&(from)[i_]) + 1]++;            \
    for (size_t k_ = 0; k_ < (buckets); k_++) (at)[k_ + 1] += (at)[k_];          \
    for (size_t i_ = 0; i_ < (n); i_++) (to)[(at)[KEY(&(from)[i_])]++] = (from)[i_]; \
  } while (0)
#define BY_WORKER(pc) ((pc)->worker)
#define BY_RANK(pc) ((pc)->rank)
#define BY_BOTH(pc) ((size_t)(pc)->rank * workers + (pc)->worker)

/* Stable counting sort of src into dst by (rank, worker): one pass when the
 * keys fit a table, else by worker into a copy, then by rank. */
#define ONE_PASS_KEYS ((size_t)1 << 22)
static int sort_pieces(const wtx_plan *p, wtx_piece *dst, const wtx_piece *src, size_t n) {
  size_t workers = p->n_workers, keys = (size_t)p->n_ranks * workers;
  int one = keys <= ONE_PASS_KEYS;
  size_t buckets = one ? keys : (p->n_ranks > workers ? p->n_ranks : workers);
  size_t *at = malloc((buckets + 1) * sizeof *at);
  wtx_piece *tmp = one ? NULL : malloc((n + 1) * sizeof *tmp);
  int rc = at == NULL || (!one && tmp == NULL) ? WTX_ENOMEM : 0;
  if (rc == 0 && one) SCATTER(dst, src, n, at, keys, BY_BOTH);
  if (rc == 0 && !one) {
    SCATTER(tmp, src, n, at, workers, BY_WORKER);
    SCATTER(dst, tmp, n, at, (size_t)p->n_ranks, BY_RANK);
  }
  free(at);
  free(tmp);
  return rc;
}

/* pieces by rank, then worker (each run in param and slice order, as made),
 * and the per-worker index by worker, then rank. */
static int index_pieces(wtx_plan *p, builder *b) {
  p->pieces = malloc((b->n + 1) * sizeof *p->pieces);
  p->rank_first = calloc((size_t)p->n_ranks + 1, sizeof *p->rank_first);
  p->worker_first = calloc((size_t)p->n_workers + 1, sizeof *p->worker_first);
  p->worker_idx = malloc((b->n + 1) * sizeof *p->worker_idx);
  p->rank_bytes = calloc(p->n_ranks, sizeof *p->rank_bytes);
  p->worker_bytes = calloc(p->n_workers, sizeof *p->worker_bytes);
  int rc = p->pieces && p->rank_first && p->worker_first && p->worker_idx &&
                   p->rank_bytes && p->worker_bytes
               ? 0 : WTX_ENOMEM;
  if (rc == 0) rc = sort_pieces(p, p->pieces, b->pieces, b->n);
  if (rc != 0) return rc;
  p->n_pieces = b->n;
  size_t *at = p->worker_first;
  for (size_t i = 0; i < b->n; i++) { /* totals need no order: the builder's */
    const wtx_piece *pc = &b->pieces[i];
    p->rank_first[pc->rank + 1]++;
    at[pc->worker + 1]++;
    p->rank_bytes[pc->rank] += b->bytes[i];
    p->worker_bytes[pc->worker] += b->bytes[i];
  }
  for (uint32_t r = 0; r < p->n_ranks; r++) p->rank_first[r + 1] += p->rank_first[r];
  for (uint32_t w = 0; w < p->n_workers; w++) at[w + 1] += at[w];
  size_t *fill = malloc(((size_t)p->n_workers + 1) * sizeof *fill);
  if (fill == NULL) return WTX_ENOMEM;
  memcpy(fill, at, p->n_workers * sizeof *fill);
  for (size_t i = 0; i < b->n; i++) p->worker_idx[fill[p->pieces[i].worker]++] = (uint32_t)i;
  free(fill);
  return 0;
}

/* ---- the digest ---- */

typedef struct hasher {
  XXH3_state_t *h;
  uint8_t buf[4096];
  size_t used;
} hasher;

static void put(hasher *h, uint64_t v, size_t bytes) {
  if (h->used + 8 > sizeof h->buf) {
    XXH3_64bits_update(h->h, h->buf, h->used);
    h->used = 0;
  }
  uint64_t le = htole64(v);
  memcpy(h->buf + h->used, &le, 8); /* the low bytes, little-endian */
  h->used += bytes;
}

static void put_ownership(hasher *h, const wtx_ownership *o) {
  if (o == NULL || o->owners == NULL) { /* every rank, however it was said */
    put(h, UINT32_MAX, 4);
    return;
  }
  size_t axes = wtx__mesh_axes(o);
  put(h, o->n_owners, 4);
  for (size_t j = 0; j < o->n_owners; j++) put(h, o->owners[j], 4);
  put(h, o->mesh_ndim, 4);
  for (size_t a = 0; a < o->mesh_ndim; a++) put(h, o->mesh_shape[a], 4);
  for (size_t a = 0; o->placements && a < axes; a++) put(h, (uint32_t)o->placements[a], 4);
}

static int digest(wtx_plan *p, uint64_t table) {
  hasher h = {.h = XXH3_createState()};
  if (h.h == NULL) return WTX_ENOMEM;
  XXH3_64bits_reset(h.h);
  put(&h, 0x316e616c702d7874ULL, 8); /* "txp-lan1": the encoding's version */
  put(&h, table, 8);
  put(&h, p->n_ranks, 4);
  put(&h, p->n_workers, 4);
  for (size_t i = 0; i < p->n; i++) put_ownership(&h, own_of(p, i));
  for (uint32_t w = 0; w < p->n_workers; w++) {
    put(&h, p->slice_first[w + 1] - p->slice_first[w], 8);
    for (size_t k = p->slice_first[w]; k < p->slice_first[w + 1]; k++) {
      const wtx_slice *s = &p->slices[k];
      put(&h, s->param, 4);
      put(&h, (uint32_t)s->dim, 4);
      put(&h, s->start, 8);
      put(&h, s->length, 8);
    }
  }
  for (size_t i = 0; i < p->n_pieces; i++) {
    const wtx_piece *pc = &p->pieces[i];
    put(&h, pc->param, 4);
    put(&h, pc->owner, 4);
    put(&h, pc->rank, 4);
    put(&h, pc->worker, 4);
    put(&h, pc->slice, 4);
  }
  XXH3_64bits_update(h.h, h.buf, h.used);
  p->digest = XXH3_64bits_digest(h.h);
  XXH3_freeState(h.h);
  return 0;
}

int wtx_plan_param_digests(const wtx_tensor_meta *metas, const wtx_ownership *own, size_t n,
                           uint64_t *out) {
  hasher h = {.h = XXH3_createState()};
  if (h.h == NULL) return WTX_ENOMEM;
  for (size_t i = 0; i < n; i++) {
    const wtx_tensor_meta *m = &metas[i];
    XXH3_64bits_reset(h.h);
    XXH3_64bits_update(h.h, m->name, strlen(m->name) + 1);
    h.used = 0;
    put(&h, (uint32_t)m->dtype, 4);
    put(&h, m->ndim, 4);
    for (size_t d = 0; d < m->ndim; d++) put(&h, m->shape[d], 8);
    put_ownership(&h, own != NULL ? &own[i] : NULL);
    XXH3_64bits_update(h.h, h.buf, h.used);
    out[i] = XXH3_64bits_digest(h.h);
  }
  XXH3_freeState(h.h);
  return 0;
}

/* "[a, b, c]" of n values into buf at *at (cut at len). */
static void list_into(char *buf, size_t len, size_t *at, const char *label,
                      const uint64_t *u64, const uint32_t *u32, size_t n) {
  int k = snprintf(buf + *at, len - *at, "%s[", label);
  for (size_t j = 0; k >= 0 && *at + (size_t)k < len && j < n; j++) {
    *at += (size_t)k;
    k = snprintf(buf + *at, len - *at, "%s%llu", j ? ", " : "",
                 (unsigned long long)(u64 != NULL ? u64[j] : u32[j]));
  }
  if (k >= 0 && *at + (size_t)k < len) *at += (size_t)k;
  k = snprintf(buf + *at, len - *at, "]");
  if (k >= 0 && *at + (size_t)k < len) *at += (size_t)k;
}

void wtx_plan_param_describe(const wtx_tensor_meta *m, const wtx_ownership *o, char *buf,
                             size_t len) {
  if (len == 0) return;
  size_t at = 0;
  int k = snprintf(buf, len, "'%s' %s ", m->name, wtx_dtype_name(m->dtype));
  at = k >= 0 && (size_t)k < len ? (size_t)k : len - 1;
  list_into(buf, len, &at, "", m->shape, NULL, m->ndim);
  if (o == NULL || o->owners == NULL) {
    snprintf(buf + at, len - at, ", owned by every rank");
    return;
  }
  list_into(buf, len, &at, ", owners ", NULL, o->owners, o->n_owners);
  if (o->mesh_ndim > 0) list_into(buf, len, &at, " mesh ", NULL, o->mesh_shape, o->mesh_ndim);
  for (size_t a = 0; o->placements != NULL && a < wtx__mesh_axes(o); a++) {
    k = o->placements[a] == WTX_PLACEMENT_REPLICATE
            ? snprintf(buf + at, len - at, "%s%s", a ? ", " : " placements [", "R")
            : snprintf(buf + at, len - at, "%s%d", a ? ", " : " placements [", o->placements[a]);
    if (k >= 0 && at + (size_t)k < len) at += (size_t)k;
  }
  if (o->placements != NULL && wtx__mesh_axes(o) > 0) snprintf(buf + at, len - at, "]");
}

/* ---- making the plan ---- */

/* For each parameter, the slices that want it: want[param_first[i] ..
 * param_first[i + 1]) index p->slices, by worker. */
static int invert_needs(const wtx_plan *p, size_t **want, size_t **param_first) {
  size_t total = p->slice_first[p->n_workers];
  *want = malloc((total + 1) * sizeof **want);
  *param_first = calloc(p->n + 1, sizeof **param_first);
  if (*want == NULL || *param_first == NULL) return WTX_ENOMEM;
  size_t *f = *param_first;
  for (size_t k = 0; k < total; k++) f[p->slices[k].param + 1]++;
  for (size_t i = 0; i < p->n; i++) f[i + 1] += f[i];
  size_t *fill = malloc((p->n + 1) * sizeof *fill);
  if (fill == NULL) return WTX_ENOMEM;
  memcpy(fill, f, (p->n + 1) * sizeof *fill);
  for (size_t k = 0; k < total; k++) (*want)[fill[p->slices[k].param]++] = k;
  free(fill);
  return 0;
}

static int check_input(const wtx_plan_input *in, char *err, size_t errlen) {
  if (in->n_ranks == 0 || in->n_ranks > WTX_MAX_PLAN_RANKS) {
    snprintf(err, errlen, "n_ranks: %u, expected 1..%d", in->n_ranks, WTX_MAX_PLAN_RANKS);
    return WTX_EINVAL;
  }
  if (in->n_workers == 0 || in->n_workers > WTX_MAX_PLAN_WORKERS) {
    snprintf(err, errlen, "n_workers: %u, expected 1..%d", in->n_workers, WTX_MAX_PLAN_WORKERS);
    return WTX_EINVAL;
  }
  if (in->n > UINT32_MAX) {
    snprintf(err, errlen, "n: %zu parameters, at most %u", in->n, UINT32_MAX);
    return WTX_EINVAL;
  }
  for (size_t i = 0; i < in->n; i++) {
    if (in->metas[i].ndim > WTX_MAX_DIMS || wtx_dtype_size(in->metas[i].dtype) == 0) {
      snprintf(err, errlen, "'%s': dtype or shape not checked (wtx_tensor_meta_set)",
               in->metas[i].name);
      return WTX_EINVAL;
    }
  }
  return 0;
}

static int build(wtx_plan *p, const wtx_plan_input *in, char *err, size_t errlen) {
  int rc = check_input(in, err, errlen);
  if (rc != 0) return rc;
  p->n_ranks = in->n_ranks;
  p->n_workers = in->n_workers;
  p->n = in->n;
  p->metas = malloc((in->n + 1) * sizeof *p->metas);
  if (p->metas == NULL) return WTX_ENOMEM;
  memcpy(p->metas, in->metas, in->n * sizeof *p->metas);
  for (size_t i = 0; i < in->n; i++) p->metas[i].name = NULL;
  if ((rc = copy_ownership(p, in, err, errlen)) != 0) return rc;
  if ((rc = copy_needs(p, in, err, errlen)) != 0) return rc;
  size_t *want = NULL, *first = NULL;
  builder b = {0};
  rc = invert_needs(p, &want, &first);
  for (size_t i = 0; i < p->n && rc == 0; i++)
    if (first[i + 1] > first[i]) rc = plan_param(p, i, want + first[i], first[i + 1] - first[i], &b);
  if (rc == 0) rc = balance(p, &b);
  if (rc == 0) rc = index_pieces(p, &b);
  free(want);
  free(first);
  free(b.pieces);
  free(b.bytes);
  free(b.pend);
  free(b.boxes);
  if (rc == 0) rc = digest(p, wtx__layout_xxh3(in->metas, in->n));
  return rc;
}

int wtx_plan_make(const wtx_plan_input *in, wtx_plan **out, char *err, size_t errlen) {
  *out = NULL;
  wtx_plan *p = calloc(1, sizeof *p);
  if (p == NULL) return WTX_ENOMEM;
  int rc = build(p, in, err, errlen);
  if (rc == WTX_ENOMEM) snprintf(err, errlen, "out of memory making the transfer plan");
  if (rc != 0) {
    wtx_plan_destroy(p);
    return rc;
  }
  *out = p;
  return 0;
}

void wtx_plan_destroy(wtx_plan *p) {
  if (p == NULL) return;
  free(p->metas);
  free(p->own);
  free(p->own_pool);
  free(p->place_pool);
  free(p->slices);
  free(p->slice_first);
  free(p->pieces);
  free(p->rank_first);
  free(p->worker_idx);
  free(p->worker_first);
  free(p->rank_bytes);
  free(p->worker_bytes);
  free(p);
}

/* ---- reading it ---- */

size_t wtx_plan_pieces(const wtx_plan *p, const wtx_piece **pieces) {
  *pieces = p->pieces;
  return p->n_pieces;
}

void wtx_plan_rank_pieces(const wtx_plan *p, uint32_t rank, size_t *first, size_t *n) {
  *first = rank < p->n_ranks ? p->rank_first[rank] : 0;
  *n = rank < p->n_ranks ? p->rank_first[rank + 1] - p->rank_first[rank] : 0;
}

void wtx_plan_worker_pieces(const wtx_plan *p, uint32_t worker, const uint32_t **idx,
                            size_t *n) {
  *idx = worker < p->n_workers ? p->worker_idx + p->worker_first[worker] : p->worker_idx;
  *n = worker < p->n_workers ? p->worker_first[worker + 1] - p->worker_first[worker] : 0;
}

void wtx_plan_piece_box(const wtx_plan *p, const wtx_piece *pc, wtx_box *out) {
  wtx_box own, sl;
  wtx_ownership_box(&p->metas[pc->param], own_of(p, pc->param), pc->owner, &own);
  wtx_slice_box(&p->metas[pc->param], &p->slices[p->slice_first[pc->worker] + pc->slice], &sl);
  if (!box_meet(&own, &sl, out)) out->len[0] = 0; /* not a piece of p */
}

uint64_t wtx_plan_piece_bytes(const wtx_plan *p, const wtx_piece *pc) {
  wtx_box b;
  wtx_plan_piece_box(p, pc, &b);
  return wtx_box_elements(&b) * wtx_dtype_size(p->metas[pc->param].dtype);
}

uint64_t wtx_plan_rank_bytes(const wtx_plan *p, uint32_t rank) {
  return rank < p->n_ranks ? p->rank_bytes[rank] : 0;
}

uint64_t wtx_plan_worker_bytes(const wtx_plan *p, uint32_t worker) {
  return worker < p->n_workers ? p->worker_bytes[worker] : 0;
}

uint64_t wtx_plan_digest(const wtx_plan *p) { return p->digest; }
