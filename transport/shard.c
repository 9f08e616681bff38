/* Boxes, ownership and tensor-parallel slices: the geometry the plan is made
 * of (plan.h). */
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transport/plan.h"

uint64_t wtx_box_elements(const wtx_box *b) {
  uint64_t e = 1;
  for (size_t d = 0; d < b->ndim; d++) e *= b->len[d];
  return e;
}

void wtx_box_whole(const wtx_tensor_meta *m, wtx_box *out) {
  out->ndim = m->ndim;
  for (size_t d = 0; d < m->ndim; d++) {
    out->lo[d] = 0;
    out->len[d] = m->shape[d];
  }
}

int wtx_box_equal(const wtx_box *a, const wtx_box *b) {
  if (a->ndim != b->ndim) return 0;
  for (size_t d = 0; d < a->ndim; d++)
    if (a->lo[d] != b->lo[d] || a->len[d] != b->len[d]) return 0;
  return 1;
}

/* Offset in elements of element idx (absolute coordinates) in a row-major
 * tensor holding box b. */
static uint64_t offset_in(const wtx_box *b, const uint64_t *idx) {
  uint64_t off = 0;
  for (size_t d = 0; d < b->ndim; d++) off = off * b->len[d] + (idx[d] - b->lo[d]);
  return off;
}

int wtx_box_contiguous(const wtx_box *outer, const wtx_box *part, uint64_t *elem) {
  size_t d = 0;
  while (d < part->ndim && part->len[d] == 1) d++; /* leading single rows */
  for (size_t e = d + 1; e < part->ndim; e++)
    if (part->len[e] != outer->len[e]) return 0;
  *elem = offset_in(outer, part->lo);
  return 1;
}

void wtx_chunk_range(uint64_t n, uint32_t k, uint32_t i, uint64_t *start, uint64_t *len) {
  uint64_t size = n / k + (n % k != 0); /* torch.chunk: ceil(n / k) each */
  uint64_t lo = size * i;
  *start = lo < n ? lo : n;
  *len = lo < n ? (n - lo < size ? n - lo : size) : 0;
}

static int fail(char *err, size_t errlen, const char *name, const char *what) {
  snprintf(err, errlen, "'%s': %s", name, what);
  return WTX_EINVAL;
}

static int check_owners(const wtx_tensor_meta *m, const wtx_ownership *o, uint32_t n_ranks,
                        char *err, size_t errlen) {
  char msg[160];
  if (o->n_owners == 0) return fail(err, errlen, m->name, "no trainer rank owns it (owners is empty)");
  if (o->n_owners > n_ranks) {
    snprintf(msg, sizeof msg, "owners: %zu owners but %u ranks", o->n_owners, n_ranks);
    return fail(err, errlen, m->name, msg);
  }
  /* Distinct and in range: a bitmap over the ranks, owners <= ranks. */
  uint8_t *seen = calloc((n_ranks + 7) / 8, 1);
  if (seen == NULL) return WTX_ENOMEM;
  int rc = 0;
  for (size_t i = 0; i < o->n_owners && rc == 0; i++) {
    uint32_t r = o->owners[i];
    if (r >= n_ranks) {
      snprintf(msg, sizeof msg, "owners[%zu]: rank %u of %u ranks", i, r, n_ranks);
      rc = fail(err, errlen, m->name, msg);
    } else if (seen[r / 8] & (1u << (r % 8))) {
      snprintf(msg, sizeof msg, "owners[%zu]: rank %u appears twice", i, r);
      rc = fail(err, errlen, m->name, msg);
    } else {
      seen[r / 8] |= (uint8_t)(1u << (r % 8));
    }
  }
  free(seen);
  return rc;
}

static int check_mesh(const wtx_tensor_meta *m, const wtx_ownership *o, char *err,
                      size_t errlen) {
  char msg[160];
  if (o->mesh_ndim > WTX_MAX_MESH_DIMS) {
    snprintf(msg, sizeof msg, "mesh_shape: %zu axes, at most %d", o->mesh_ndim,
             WTX_MAX_MESH_DIMS);
    return fail(err, errlen, m->name, msg);
  }
  uint64_t prod = 1;
  for (size_t a = 0; a < o->mesh_ndim; a++) {
    if (o->mesh_shape[a] == 0) return fail(err, errlen, m->name, "mesh_shape: an axis of 0");
    prod *= o->mesh_shape[a]; /* each axis <= n_owners, so no overflow first */
    if (prod > o->n_owners) break;
  }
  if (o->mesh_ndim > 0 && prod != o->n_owners) {
    snprintf(msg, sizeof msg, "mesh_shape: does not cover its %zu owners", o->n_owners);
    return fail(err, errlen, m->name, msg);
  }
  size_t axes = wtx__mesh_axes(o);
  for (size_t a = 0; o->placements != NULL && a < axes; a++) {
    int32_t p = o->placements[a];
    if (p < WTX_PLACEMENT_REPLICATE || (p >= 0 && (size_t)p >= m->ndim)) {
      snprintf(msg, sizeof msg, "placements[%zu]: shards dim %d of a %zu-D tensor", a, p,
               m->ndim);
      return fail(err, errlen, m->name, msg);
    }
  }
  return 0;
}

int wtx_ownership_check(const wtx_tensor_meta *m, const wtx_ownership *o, uint32_t n_ranks,
                        char *err, size_t errlen) {
  if (o->owners == NULL) {
    if (o->mesh_ndim > 0 || o->placements != NULL)
      return fail(err, errlen, m->name, "a mesh or placements without owners");
    return 0;
  }
  int rc = check_owners(m, o, n_ranks, err, errlen);
  return rc != 0 ? rc : check_mesh(m, o, err, errlen);
}

void wtx_ownership_box(const wtx_tensor_meta *m, const wtx_ownership *o, size_t pos,
                       wtx_box *out) {
  wtx_box_whole(m, out);
  if (o == NULL || o->owners == NULL || o->placements == NULL) return;
  size_t axes = wtx__mesh_axes(o);
  uint32_t coord[WTX_MAX_MESH_DIMS];
  for (size_t a = axes; a-- > 0;) { /* row-major: the last axis varies fastest */
    coord[a] = (uint32_t)(pos % wtx__mesh_axis(o, a));
    pos /= wtx__mesh_axis(o, a);
  }
  for (size_t a = 0; a < axes; a++) { /* outer axis first */
    int32_t d = o->placements[a];
    if (d < 0) continue;
    uint64_t start, len;
    wtx_chunk_range(out->len[d], wtx__mesh_axis(o, a), coord[a], &start, &len);
    out->lo[d] += start;
    out->len[d] = len;
  }
}

int wtx_ownership_rank_box(const wtx_tensor_meta *m, const wtx_ownership *o, uint32_t rank,
                           wtx_box *out) {
  size_t pos = rank;
  if (o != NULL && o->owners != NULL) {
    for (pos = 0; pos < o->n_owners && o->owners[pos] != rank; pos++) {
    }
    if (pos == o->n_owners) return 0;
  }
  wtx_ownership_box(m, o, pos, out);
  return 1;
}

void wtx_slice_box(const wtx_tensor_meta *m, const wtx_slice *s, wtx_box *out) {
  wtx_box_whole(m, out);
  if (s->dim >= 0) {
    out->lo[s->dim] = s->start;
    out->len[s->dim] = s->length;
  }
}

int wtx_box_runs(const wtx_box *a, const wtx_box *b, const wtx_box *part,
                 int (*fn)(void *arg, uint64_t in_a, uint64_t in_b, uint64_t n), void *arg) {
  if (a == NULL) a = part;
  if (b == NULL) b = part;
  size_t nd = part->ndim;
  if (wtx_box_elements(part) == 0) return 0;
  size_t k = nd > 0 ? nd - 1 : 0;
  uint64_t run = nd > 0 ? part->len[k] : 1;
  while (k > 0 && part->len[k] == a->len[k] && part->len[k] == b->len[k]) {
    k--;
    run *= part->len[k];
  }
  uint64_t idx[WTX_MAX_DIMS];
  memcpy(idx, part->lo, sizeof(uint64_t) * nd);
  for (;;) {
    int rc = fn(arg, offset_in(a, idx), offset_in(b, idx), run);
    if (rc != 0) return rc;
    size_t d = k; /* odometer over dims [0, k) */
    for (;;) {
      if (d == 0) return 0;
      d--;
      if (++idx[d] < part->lo[d] + part->len[d]) break;
      idx[d] = part->lo[d];
    }
  }
}

typedef struct copy_arg {
  uint8_t *dst;
  const uint8_t *src;
  size_t elsize;
} copy_arg;

static int copy_run(void *arg, uint64_t in_dst, uint64_t in_src, uint64_t n) {
  const copy_arg *c = arg;
  memcpy(c->dst + in_dst * c->elsize, c->src + in_src * c->elsize, n * c->elsize);
  return 0;
}

void wtx_box_copy(void *dst, const wtx_box *dst_box, const void *src, const wtx_box *src_box,
                  const wtx_box *part, size_t elsize) {
  copy_arg c = {dst, src, elsize};
  wtx_box_runs(dst_box, src_box, part, copy_run, &c);
}

/* Bits [lo, lo + n) of b: whether any is set (test), or set them. */
static int bits_run(uint64_t *b, uint64_t lo, uint64_t n, int test) {
  while (n > 0) {
    uint64_t w = lo / 64, at = lo % 64, k = 64 - at < n ? 64 - at : n;
    uint64_t mask = (k == 64 ? ~(uint64_t)0 : (((uint64_t)1 << k) - 1)) << at;
    if (test && (b[w] & mask) != 0) return 1;
    if (!test) b[w] |= mask;
    lo += k;
    n -= k;
  }
  return 0;
}

static int test_run(void *bits, uint64_t in_outer, uint64_t unused, uint64_t n) {
  (void)unused;
  return bits_run(bits, in_outer, n, 1) ? WTX_EEXIST : 0;
}

static int set_run(void *bits, uint64_t in_outer, uint64_t unused, uint64_t n) {
  (void)unused;
  return bits_run(bits, in_outer, n, 0);
}

int wtx_box_mark(uint64_t *bits, const wtx_box *outer, const wtx_box *part) {
  int rc = wtx_box_runs(outer, outer, part, test_run, bits);
  return rc != 0 ? rc : wtx_box_runs(outer, outer, part, set_run, bits);
}

int wtx_box_cut(const wtx_box *b, size_t elsize, uint64_t max,
                int (*fn)(void *arg, const wtx_box *part), void *arg) {
  size_t d = 0;
  while (d < b->ndim && b->len[d] == 1) d++;
  uint64_t slab = elsize;
  for (size_t e = d + 1; e < b->ndim; e++) slab *= b->len[e];
  if (d + 1 < b->ndim && slab > max) { /* a slab at a time, cut further */
    for (uint64_t i = 0; i < b->len[d]; i++) {
      wtx_box one = *b;
      one.lo[d] += i;
      one.len[d] = 1;
      int rc = wtx_box_cut(&one, elsize, max, fn, arg);
      if (rc != 0) return rc;
    }
    return 0;
  }
  uint64_t units = d < b->ndim ? b->len[d] : 1, per = slab < max ? max / slab : 1;
  for (uint64_t i = 0; i < units; i += per) {
    wtx_box part = *b;
    if (d < b->ndim) {
      part.lo[d] += i;
      part.len[d] = units - i < per ? units - i : per;
    }
    int rc = fn(arg, &part);
    if (rc != 0) return rc;
  }
  return 0;
}

/* ---- tensor-parallel slices from rules ---- */

static const wtx_shard_rule *match(const wtx_shard_rule *rules, size_t n, const char *name) {
  for (size_t r = 0; r < n; r++)
    if (fnmatch(rules[r].pattern, name, 0) == 0) return &rules[r];
  return NULL;
}

/* The expert index in "...experts.N...": 1 with *e, 0 when none. */
static int expert_of(const char *name, uint64_t *e) {
  const char *p = strstr(name, "experts.");
  if (p == NULL || p[8] < '0' || p[8] > '9') return 0;
  *e = strtoull(p + 8, NULL, 10);
  return 1;
}

static int dim_slice(const wtx_tensor_meta *m, const wtx_shard_rule *r, uint32_t tp_rank,
                     uint32_t tp_size, wtx_slice *s, char *err, size_t errlen) {
  char msg[160];
  if (r->dim >= m->ndim) {
    snprintf(msg, sizeof msg, "rule '%s' slices dim %u of a %zu-D tensor", r->pattern,
             r->dim, m->ndim);
    return fail(err, errlen, m->name, msg);
  }
  uint64_t unit = r->unit > 1 ? r->unit : 1, extent = m->shape[r->dim];
  if (extent % unit != 0) {
    snprintf(msg, sizeof msg, "rule '%s': dim %u (%llu) is not a multiple of unit %llu",
             r->pattern, r->dim, (unsigned long long)extent, (unsigned long long)unit);
    return fail(err, errlen, m->name, msg);
  }
  uint64_t units = extent / unit, start, len;
  if (units >= tp_size) {
    wtx_chunk_range(units, tp_size, tp_rank, &start, &len);
  } else {
    start = (uint64_t)tp_rank * units / tp_size;
    len = units > 0;
  }
  s->dim = (int32_t)r->dim;
  s->start = start * unit;
  s->length = len * unit;
  return 0;
}

static int check_tp(uint32_t tp_rank, uint32_t tp_size, char *err, size_t errlen) {
  if (tp_size > 0 && tp_rank < tp_size) return 0;
  snprintf(err, errlen, "tp_rank %u is not below tp_size %u", tp_rank, tp_size);
  return WTX_EINVAL;
}

static int expert_slice(const wtx_tensor_meta *m, const wtx_shard_rule *r, uint32_t tp_rank,
                        uint32_t tp_size, uint64_t experts, char *err, size_t errlen) {
  uint64_t e, start, len, count = r->unit > 0 ? r->unit : experts;
  if (!expert_of(m->name, &e))
    return fail(err, errlen, m->name, "an expert rule matches a name without experts.N");
  if (e >= count) {
    char msg[160];
    snprintf(msg, sizeof msg, "rule '%s': expert %llu of %llu experts", r->pattern,
             (unsigned long long)e, (unsigned long long)count);
    return fail(err, errlen, m->name, msg);
  }
  wtx_chunk_range(count, tp_size, tp_rank, &start, &len);
  return e >= start && e < start + len;
}

int wtx_shard_slice_of(const wtx_tensor_meta *m, const wtx_shard_rule *rules, size_t n_rules,
                       uint32_t tp_rank, uint32_t tp_size, uint64_t experts, wtx_slice *out,
                       char *err, size_t errlen) {
  int rc = check_tp(tp_rank, tp_size, err, errlen);
  if (rc != 0) return rc;
  const wtx_shard_rule *r = match(rules, n_rules, m->name);
  *out = (wtx_slice){.param = 0, .dim = WTX_SLICE_WHOLE};
  if (r == NULL || r->kind == WTX_SHARD_WHOLE) return 1;
  if (r->kind == WTX_SHARD_EXPERT) return expert_slice(m, r, tp_rank, tp_size, experts, err, errlen);
  if (r->kind == WTX_SHARD_SKIP) return 0;
  if (r->kind != WTX_SHARD_DIM) {
    char msg[160];
    snprintf(msg, sizeof msg, "rule '%s' has kind %d, not one of wtx_shard_kind", r->pattern,
             (int)r->kind);
    return fail(err, errlen, m->name, msg);
  }
  rc = dim_slice(m, r, tp_rank, tp_size, out, err, errlen);
  return rc != 0 ? rc : out->length > 0;
}

int wtx_shard_rules_check(const wtx_shard_rule *rules, size_t n_rules, uint32_t tp_rank,
                          uint32_t tp_size, char *err, size_t errlen) {
  int rc = check_tp(tp_rank, tp_size, err, errlen);
  for (size_t k = 0; rc == 0 && k < n_rules; k++) {
    if (rules[k].kind != WTX_SHARD_EXPERT || rules[k].unit > 0) continue;
    snprintf(err, errlen, "the expert rule '%s' needs the model's expert count ('expert E'), "
             "so the worker can check which experts it hosts", rules[k].pattern);
    rc = WTX_EINVAL;
  }
  return rc;
}

int wtx_shard_slices(const wtx_tensor_meta *metas, size_t n, const wtx_shard_rule *rules,
                     size_t n_rules, uint32_t tp_rank, uint32_t tp_size, wtx_slice **out,
                     size_t *n_out, char *err, size_t errlen) {
  *out = NULL;
  *n_out = 0;
  int rc = check_tp(tp_rank, tp_size, err, errlen);
  if (rc != 0) return rc;
  uint64_t experts = 0, e;
  for (size_t i = 0; i < n; i++) {
    const wtx_shard_rule *r = match(rules, n_rules, metas[i].name);
    if (r != NULL && r->kind == WTX_SHARD_EXPERT && r->unit == 0 &&
        expert_of(metas[i].name, &e) && e + 1 > experts)
      experts = e + 1;
  }
  wtx_slice *s = malloc((n > 0 ? n : 1) * sizeof *s);
  if (s == NULL) return WTX_ENOMEM;
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    rc = wtx_shard_slice_of(&metas[i], rules, n_rules, tp_rank, tp_size, experts, &s[k], err,
                            errlen);
    if (rc < 0) {
      free(s);
      return rc;
    }
    s[k].param = (uint32_t)i;
    k += rc;
  }
  *out = s;
  *n_out = k;
  return 0;
}

/* One line "PATTERN KIND..." into *r (pattern pointing into line). */
static int parse_rule(char *line, wtx_shard_rule *r) {
  char *save = NULL, *pat = strtok_r(line, " \t", &save), *kind = strtok_r(NULL, " \t", &save);
  if (pat == NULL || kind == NULL) return -1;
  *r = (wtx_shard_rule){.pattern = pat};
  char *rest = strtok_r(NULL, "", &save), *end;
  if (strcmp(kind, "whole") == 0) r->kind = WTX_SHARD_WHOLE;
  else if (strcmp(kind, "skip") == 0) r->kind = WTX_SHARD_SKIP;
  else if (strcmp(kind, "expert") == 0) {
    r->kind = WTX_SHARD_EXPERT;
    if (rest != NULL && rest[strspn(rest, " \t")] != '\0') {
      r->unit = strtoull(rest, &end, 10);
      if (end == rest || r->unit == 0) return -1;
      rest = end;
    }
  } else if (strcmp(kind, "dim") == 0 && rest != NULL) {
    r->kind = WTX_SHARD_DIM;
    unsigned long d = strtoul(rest, &end, 10);
    if (end == rest || d >= WTX_MAX_DIMS) return -1;
    r->dim = (uint32_t)d;
    rest = end + strspn(end, " \t");
    if (strncmp(rest, "unit", 4) == 0) {
      r->unit = strtoull(rest + 4, &end, 10);
      if (end == rest + 4 || r->unit == 0) return -1;
      rest = end;
    }
  } else {
    return -1;
  }
  return rest == NULL || rest[strspn(rest, " \t")] == '\0' ? 0 : -1;
}

int wtx_shard_rules_parse(const char *text, wtx_shard_rule **rules, size_t *n_rules, char *err,
                          size_t errlen) {
  *rules = NULL;
  *n_rules = 0;
  size_t len = strlen(text), lines = 1;
  for (size_t i = 0; i < len; i++) lines += text[i] == '\n';
  /* The rules, then a copy of the text their patterns point into: one
   * block, one free(). */
  wtx_shard_rule *r = malloc(lines * sizeof *r + len + 1);
  if (r == NULL) return WTX_ENOMEM;
  char *copy = (char *)(r + lines);
  memcpy(copy, text, len + 1);
  size_t k = 0, lineno = 0;
  for (char *line = copy, *next; line != NULL; line = next) {
    next = strchr(line, '\n');
    if (next != NULL) *next++ = '\0';
    lineno++;
    line += strspn(line, " \t\r");
    line[strcspn(line, "\r")] = '\0';
    if (*line == '\0' || *line == '#') continue;
    if (parse_rule(line, &r[k]) != 0) {
      snprintf(err, errlen,
               "shard rules line %zu: expected 'PATTERN whole|skip|expert [E]|dim D [unit U]'",
               lineno);
      free(r);
      return WTX_EINVAL;
    }
    k++;
  }
  *rules = r;
  *n_rules = k;
  return 0;
}
