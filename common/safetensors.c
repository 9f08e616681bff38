/* safetensors read and write (see safetensors.h). */
#include "common/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yajl/yajl_gen.h>
#include <yajl/yajl_parse.h>

#include "common/strmap.h"
#include "wtx/error.h"

struct wtx_st_file {
  uint8_t *map;
  size_t size;
  int borrowed; /* map is the caller's memory (wtx_st_parse), not unmapped */
  char *strings; /* every decoded name, dtype and metadata string */
  const char *(*meta)[2]; /* __metadata__ pairs, into strings */
  size_t n_meta;
  wtx_st_tensor *tensors;
  size_t n, cap;
};

static int fail(char *err, size_t errlen, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int fail(char *err, size_t errlen, int rc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(err, errlen, fmt, ap);
  va_end(ap);
  return rc;
}

static int by_offset(const void *a, const void *b) {
  const wtx_st_tensor *x = a, *y = b;
  return x->data < y->data ? -1 : x->data > y->data;
}

/* The header is read in one pass of yajl's event parser into the tensor
 * table: no JSON tree (building one costs many times the parse). Each
 * value's expected kind follows from where it is. */
enum slot { S_TOP, S_ENTRY, S_META, S_DTYPE, S_SHAPE, S_OFFSETS, S_DIM, S_OFFSET,
            S_META_VALUE, S_SKIP };
enum kind { K_MAP, K_ARRAY, K_STRING, K_INT, K_OTHER };
enum { HAVE_DTYPE = 1, HAVE_SHAPE = 2, HAVE_OFFSETS = 4 };
#define MAX_DEPTH 32

typedef struct parser {
  wtx_st_file *f;
  const char *path;
  char *err;
  size_t errlen;
  int rc;
  size_t used;          /* bytes of f->strings taken */
  int depth;            /* containers open */
  enum slot stack[MAX_DEPTH]; /* the slot of each open container */
  enum slot next;       /* the slot of the next value at this depth */
  const char *entry;    /* the top-level key being read */
  int have;             /* HAVE_* of the tensor being read */
  wtx_st_tensor *t;
  uint64_t off[2];
  size_t n_off;
  const uint8_t *data; /* the data section */
  uint64_t data_len;
  int seen_meta;       /* __metadata__ was read (twice is an error, as for names) */
} parser;

static int bad(parser *p, int rc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int bad(parser *p, int rc, const char *fmt, ...) {
  int n = snprintf(p->err, p->errlen, "%s: ", p->path);
  va_list ap;
  va_start(ap, fmt);
  if (n >= 0 && (size_t)n < p->errlen) vsnprintf(p->err + n, p->errlen - (size_t)n, fmt, ap);
  va_end(ap);
  p->rc = rc;
  return 0; /* yajl: stop */
}

/* A copy of s in f->strings, which holds the whole header: a decoded string
 * is never longer than its JSON text with the quotes, so it always fits. */
static const char *keep(parser *p, const unsigned char *s, size_t len) {
  char *d = p->f->strings + p->used;
  memcpy(d, s, len);
  d[len] = '\0';
  p->used += len + 1;
  return d;
}

static int entry_shape(parser *p) {
  return bad(p, WTX_EINVAL, "tensor '%s': needs dtype (string), shape (array) and "
             "data_offsets ([begin, end])", p->entry);
}

/* Checks that a value of kind k may stand at the current slot. */
static int expect(parser *p, enum kind k) {
  switch (p->next) {
  case S_TOP:
    return k == K_MAP ? 1 : bad(p, WTX_EINVAL, "header is not a JSON object");
  case S_META:
    return k == K_MAP ? 1 : bad(p, WTX_EINVAL, "__metadata__ is not an object");
  case S_META_VALUE:
    return k == K_STRING ? 1 : bad(p, WTX_EINVAL, "__metadata__ values must be strings");
  case S_ENTRY:
    return k == K_MAP ? 1 : entry_shape(p);
  case S_DTYPE:
    return k == K_STRING ? 1 : entry_shape(p);
  case S_SHAPE:
  case S_OFFSETS:
    return k == K_ARRAY ? 1 : entry_shape(p);
  case S_DIM:
    return k == K_INT ? 1 : bad(p, WTX_EINVAL, "tensor '%s': shape[%zu] is not a "
                                "non-negative integer", p->entry, p->t->meta.ndim);
  case S_OFFSET:
    return k == K_INT ? 1 : bad(p, WTX_EINVAL, "tensor '%s': data_offsets must be "
                                "integers 0 <= begin <= end", p->entry);
  case S_SKIP:
    return 1;
  }
  return 1;
}

static int open_container(parser *p, enum kind k) {
  if (!expect(p, k)) return 0;
  if (p->depth == MAX_DEPTH) return bad(p, WTX_EINVAL, "header nested deeper than %d", MAX_DEPTH);
  enum slot s = p->next;
  p->stack[p->depth++] = s;
  if (s == S_ENTRY) {
    if (p->f->n == p->f->cap) {
      size_t cap = p->f->cap ? 2 * p->f->cap : 64;
      wtx_st_tensor *t = realloc(p->f->tensors, cap * sizeof *t);
      if (t == NULL) return bad(p, WTX_ENOMEM, "out of memory");
      p->f->tensors = t;
      p->f->cap = cap;
    }
    p->t = &p->f->tensors[p->f->n];
    memset(p->t, 0, sizeof *p->t);
    p->t->meta.name = p->entry;
    p->have = 0;
  }
  p->n_off = 0;
  p->next = s == S_SHAPE ? S_DIM : s == S_OFFSETS ? S_OFFSET : S_SKIP;
  return 1;
}

/* After a value at the current depth: what comes next there. */
static void value_done(parser *p) {
  enum slot in = p->depth > 0 ? p->stack[p->depth - 1] : S_TOP;
  if (in == S_SHAPE) p->next = S_DIM;
  else if (in == S_OFFSETS) p->next = S_OFFSET;
  else p->next = S_SKIP; /* in a map a key comes first and sets it */
}

static int on_start_map(void *ctx) { return open_container(ctx, K_MAP); }
static int on_start_array(void *ctx) { return open_container(ctx, K_ARRAY); }

static int entry_end(parser *p);

static int on_end(void *ctx) {
  parser *p = ctx;
  enum slot s = p->stack[--p->depth];
  if (s == S_SHAPE && p->t->meta.ndim > WTX_MAX_DIMS)
    return bad(p, WTX_EINVAL, "tensor '%s': %zu dims, at most %d", p->entry,
               p->t->meta.ndim, WTX_MAX_DIMS);
  if (s == S_OFFSETS && p->n_off != 2) return entry_shape(p);
  if (s == S_ENTRY && !entry_end(p)) return 0;
  value_done(p);
  return 1;
}

static int on_key(void *ctx, const unsigned char *s, size_t len) {
  parser *p = ctx;
  enum slot in = p->stack[p->depth - 1];
  if (in == S_TOP) {
    p->entry = keep(p, s, len);
    p->next = strcmp(p->entry, "__metadata__") == 0 ? S_META : S_ENTRY;
    if (strlen(p->entry) != len)
      return bad(p, WTX_EINVAL, "a tensor name holds a NUL character");
    if (p->next == S_META && p->seen_meta++)
      return bad(p, WTX_EINVAL, "'__metadata__' appears twice in the header");
  } else if (in == S_META) {
    const char *(*m)[2] = realloc(p->f->meta, (p->f->n_meta + 1) * sizeof *m);
    if (m == NULL) return bad(p, WTX_ENOMEM, "out of memory");
    p->f->meta = m;
    m[p->f->n_meta][0] = keep(p, s, len);
    m[p->f->n_meta][1] = NULL;
    p->next = S_META_VALUE;
  } else if (in == S_ENTRY) {
    int bit = len == 5 && memcmp(s, "dtype", 5) == 0 ? HAVE_DTYPE
            : len == 5 && memcmp(s, "shape", 5) == 0 ? HAVE_SHAPE
            : len == 12 && memcmp(s, "data_offsets", 12) == 0 ? HAVE_OFFSETS : 0;
    if (bit & p->have) return bad(p, WTX_EINVAL, "tensor '%s': %.*s appears twice",
                                  p->entry, (int)len, s);
    p->have |= bit;
    p->next = bit == HAVE_DTYPE ? S_DTYPE : bit == HAVE_SHAPE ? S_SHAPE
            : bit == HAVE_OFFSETS ? S_OFFSETS : S_SKIP;
  } else {
    p->next = S_SKIP;
  }
  return 1;
}

static int on_string(void *ctx, const unsigned char *s, size_t len) {
  parser *p = ctx;
  if (!expect(p, K_STRING)) return 0;
  if (p->next == S_DTYPE) {
    const char *dt = keep(p, s, len);
    p->t->meta.dtype = wtx_dtype_from_safetensors(dt);
    if (p->t->meta.dtype == 0)
      return bad(p, WTX_EINVAL, "tensor '%s': dtype '%s' unknown", p->entry, dt);
  } else if (p->next == S_META_VALUE) {
    p->f->meta[p->f->n_meta++][1] = keep(p, s, len);
  }
  value_done(p);
  return 1;
}

static int on_integer(void *ctx, long long v) {
  parser *p = ctx;
  if (!expect(p, K_INT)) return 0;
  if (p->next == S_DIM) {
    if (v < 0)
      return bad(p, WTX_EINVAL, "tensor '%s': shape[%zu] is not a non-negative "
                 "integer", p->entry, p->t->meta.ndim);
    if (p->t->meta.ndim < WTX_MAX_DIMS) p->t->meta.shape[p->t->meta.ndim] = (uint64_t)v;
    p->t->meta.ndim++;
  } else if (p->next == S_OFFSET) {
    if (v < 0 || p->n_off == 2) return entry_shape(p);
    p->off[p->n_off++] = (uint64_t)v;
  }
  value_done(p);
  return 1;
}

static int on_other(parser *p) {
  if (!expect(p, K_OTHER)) return 0;
  value_done(p);
  return 1;
}
static int on_null(void *ctx) { return on_other(ctx); }
static int on_bool(void *ctx, int b) { (void)b; return on_other(ctx); }
static int on_double(void *ctx, double d) { (void)d; return on_other(ctx); }

static const yajl_callbacks callbacks = {
    .yajl_null = on_null,
    .yajl_boolean = on_bool,
    .yajl_integer = on_integer,
    .yajl_double = on_double,
    .yajl_string = on_string,
    .yajl_start_map = on_start_map,
    .yajl_map_key = on_key,
    .yajl_end_map = on_end,
    .yajl_start_array = on_start_array,
    .yajl_end_array = on_end,
};

/* A tensor entry read whole: its fields present and consistent. Its data
 * pointer holds its begin offset until parse() has the data section. */
static int entry_end(parser *p) {
  wtx_tensor_meta *t = &p->t->meta;
  if (p->have != (HAVE_DTYPE | HAVE_SHAPE | HAVE_OFFSETS)) return entry_shape(p);
  if (p->off[1] < p->off[0])
    return bad(p, WTX_EINVAL, "tensor '%s': data_offsets must be integers 0 <= begin "
               "<= end", p->entry);
  if (wtx_tensor_nbytes(t->dtype, t->shape, t->ndim, &t->nbytes) != 0)
    return bad(p, WTX_EINVAL, "tensor '%s': shape too large", p->entry);
  if (p->off[1] - p->off[0] != t->nbytes)
    return bad(p, WTX_EINVAL, "tensor '%s': data_offsets span %llu bytes, dtype x "
               "shape is %llu", p->entry, (unsigned long long)(p->off[1] - p->off[0]),
               (unsigned long long)t->nbytes);
  if (p->off[1] > p->data_len)
    return bad(p, WTX_EINVAL, "tensor '%s': data_offsets end %llu beyond the %llu-byte "
               "data section", p->entry, (unsigned long long)p->off[1],
               (unsigned long long)p->data_len);
  p->t->data = p->data + p->off[0];
  p->f->n++;
  return 1;
}

/* Runs yajl over the n header bytes at json. */
static int parse_header(parser *p, const uint8_t *json, size_t n) {
  yajl_handle h = yajl_alloc(&callbacks, NULL, p);
  if (h == NULL) return WTX_ENOMEM;
  yajl_status st = yajl_parse(h, json, n);
  if (st == yajl_status_ok) st = yajl_complete_parse(h);
  if (st == yajl_status_error && p->rc == 0) {
    unsigned char *e = yajl_get_error(h, 0, json, n);
    p->rc = fail(p->err, p->errlen, WTX_EINVAL, "%s: header is not valid JSON: %s",
                 p->path, e != NULL ? (const char *)e : "parse error");
    if (e != NULL) yajl_free_error(h, e);
  }
  yajl_free(h);
  return p->rc;
}

/* The tensors, in offset order, cover the data section exactly. */
static int check_layout(wtx_st_file *f, const char *path, const uint8_t *data,
                        uint64_t data_len, char *err, size_t errlen) {
  size_t sorted = 1; /* writers put tensors in offset order: then no sort */
  while (sorted < f->n && f->tensors[sorted - 1].data <= f->tensors[sorted].data) sorted++;
  if (sorted < f->n) qsort(f->tensors, f->n, sizeof *f->tensors, by_offset);
  const uint8_t *next = data;
  for (size_t i = 0; i < f->n; i++) {
    if (f->tensors[i].data != next)
      return fail(err, errlen, WTX_EINVAL,
                  "%s: tensor '%s' starts at %lld, expected %lld (holes and "
                  "overlaps are not allowed)", path, f->tensors[i].meta.name,
                  (long long)(f->tensors[i].data - data), (long long)(next - data));
    next += f->tensors[i].meta.nbytes;
  }
  if ((uint64_t)(next - data) != data_len)
    return fail(err, errlen, WTX_EINVAL, "%s: tensors cover %lld of %llu data bytes",
                path, (long long)(next - data), (unsigned long long)data_len);
  return 0;
}

static int parse(wtx_st_file *f, const char *path, char *err, size_t errlen) {
  if (f->size < 8)
    return fail(err, errlen, WTX_EINVAL, "%s: %zu bytes, too short for a header",
                path, f->size);
  uint64_t n = 0;
  for (int i = 7; i >= 0; i--) n = (n << 8) | f->map[i];
  if (n > WTX_ST_MAX_HEADER || n > f->size - 8)
    return fail(err, errlen, WTX_EINVAL,
                "%s: header length %llu exceeds the file or the %u-byte limit",
                path, (unsigned long long)n, WTX_ST_MAX_HEADER);
  parser p = {.f = f, .path = path, .err = err, .errlen = errlen, .next = S_TOP,
              .data = f->map + 8 + n, .data_len = f->size - 8 - n};
  f->strings = malloc(n + 1);
  int rc = f->strings != NULL ? parse_header(&p, f->map + 8, n) : WTX_ENOMEM;
  if (rc == 0 && p.depth != 0) rc = fail(err, errlen, WTX_EINVAL, "%s: header is not a "
                                         "JSON object", path);
  /* Names are checked once the header is read, in a table sized for
   * exactly the tensors found, borrowing their names from f->strings. A
   * table filled while parsing could only be sized from the header's
   * length (twice the buckets a header of tiny tensors needs) and would
   * copy every name. */
  const char *dup = rc == 0 ? wtx__strmap_first_duplicate(f->tensors, f->n,
                                                            sizeof *f->tensors, &rc)
                            : NULL;
  if (dup != NULL)
    rc = fail(err, errlen, WTX_EINVAL, "%s: '%s' appears twice in the header", path, dup);
  else if (rc == WTX_ENOMEM)
    rc = fail(err, errlen, rc, "%s: out of memory reading the header", path);
  return rc != 0 ? rc : check_layout(f, path, p.data, p.data_len, err, errlen);
}

/* Hands f out when rc (its parse) is 0, else closes it. */
static int parsed(wtx_st_file *f, int rc, wtx_st_file **out, char *err, size_t errlen) {
  if (rc != 0) {
    if (rc == WTX_ENOMEM && err[0] == '\0') snprintf(err, errlen, "out of memory");
    wtx_st_close(f);
    return rc;
  }
  *out = f;
  return 0;
}

int wtx_st_open(const char *path, wtx_st_file **out, char *err, size_t errlen) {
  *out = NULL;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    return fail(err, errlen, errno == ENOENT ? WTX_ENOENT : WTX_EIO,
                "%s: %s", path, strerror(errno));
  struct stat st;
  wtx_st_file *f = calloc(1, sizeof *f);
  int rc = 0;
  if (f == NULL) {
    rc = WTX_ENOMEM;
  } else if (fstat(fd, &st) != 0) {
    rc = fail(err, errlen, WTX_EIO, "%s: %s", path, strerror(errno));
  } else if ((f->size = (size_t)st.st_size) > 0) {
    f->map = mmap(NULL, f->size, PROT_READ, MAP_SHARED, fd, 0);
    if (f->map == MAP_FAILED) {
      f->map = NULL;
      rc = fail(err, errlen, WTX_EIO, "%s: mmap: %s", path, strerror(errno));
    }
  }
  close(fd);
  return parsed(f, rc == 0 ? parse(f, path, err, errlen) : rc, out, err, errlen);
}

int wtx_st_parse(const uint8_t *data, size_t size, const char *name, wtx_st_file **out,
                 char *err, size_t errlen) {
  *out = NULL;
  wtx_st_file *f = calloc(1, sizeof *f);
  if (f == NULL) return WTX_ENOMEM;
  f->map = (uint8_t *)data;
  f->size = size;
  f->borrowed = 1;
  return parsed(f, parse(f, name, err, errlen), out, err, errlen);
}

void wtx_st_close(wtx_st_file *f) {
  if (f == NULL) return;
  if (f->map != NULL && !f->borrowed) munmap(f->map, f->size);
  free(f->strings);
  free(f->meta);
  free(f->tensors);
  free(f);
}

size_t wtx_st_count(const wtx_st_file *f) { return f->n; }

const wtx_st_tensor *wtx_st_tensor_at(const wtx_st_file *f, size_t i) {
  return i < f->n ? &f->tensors[i] : NULL;
}

const char *wtx_st_metadata(const wtx_st_file *f, const char *key) {
  for (size_t i = 0; i < f->n_meta; i++)
    if (strcmp(f->meta[i][0], key) == 0) return f->meta[i][1];
  return NULL;
}

static int write_all(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n > 0) {
    ssize_t w = write(fd, b, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

/* The header JSON for tensors laid out back to back, padded with spaces to
 * a multiple of 8 bytes (as the reference writer does). malloc'd. */
static int gen_str(yajl_gen g, const char *s) {
  return yajl_gen_string(g, (const unsigned char *)s, strlen(s)) != yajl_gen_status_ok;
}

/* The header's JSON, built with yajl's generator (strings checked as
 * UTF-8): metadata first, then the tensors back to back. */
static int header_gen(yajl_gen g, const wtx_st_tensor *ts, size_t n,
                      const char *const (*meta)[2], size_t n_meta) {
  int bad = yajl_gen_map_open(g) != yajl_gen_status_ok;
  if (n_meta > 0) {
    bad |= gen_str(g, "__metadata__") || yajl_gen_map_open(g);
    for (size_t i = 0; i < n_meta && !bad; i++)
      bad |= gen_str(g, meta[i][0]) || gen_str(g, meta[i][1]);
    bad |= yajl_gen_map_close(g) != yajl_gen_status_ok;
  }
  uint64_t off = 0;
  for (size_t i = 0; i < n && !bad; i++) {
    const wtx_tensor_meta *m = &ts[i].meta;
    bad |= gen_str(g, m->name) || yajl_gen_map_open(g) || gen_str(g, "dtype") ||
           gen_str(g, wtx_dtype_safetensors(m->dtype)) || gen_str(g, "shape") ||
           yajl_gen_array_open(g);
    for (size_t d = 0; d < m->ndim && !bad; d++)
      bad |= yajl_gen_integer(g, (long long)m->shape[d]) != yajl_gen_status_ok;
    bad |= yajl_gen_array_close(g) || gen_str(g, "data_offsets") || yajl_gen_array_open(g) ||
           yajl_gen_integer(g, (long long)off) ||
           yajl_gen_integer(g, (long long)(off + m->nbytes)) || yajl_gen_array_close(g) ||
           yajl_gen_map_close(g);
    off += m->nbytes;
  }
  return bad || yajl_gen_map_close(g) != yajl_gen_status_ok;
}

/* The header JSON for tensors laid out back to back, padded with spaces to
 * a multiple of 8 bytes (as the reference writer does). malloc'd; NULL when
 * a string is not UTF-8 or out of memory. */
static char *header_json(const wtx_st_tensor *ts, size_t n,
                         const char *const (*meta)[2], size_t n_meta,
                         size_t *len) {
  yajl_gen g = yajl_gen_alloc(NULL);
  if (g == NULL) return NULL;
  yajl_gen_config(g, yajl_gen_validate_utf8, 1);
  const unsigned char *buf = NULL;
  size_t l = 0;
  char *out = NULL;
  if (header_gen(g, ts, n, meta, n_meta) == 0 &&
      yajl_gen_get_buf(g, &buf, &l) == yajl_gen_status_ok) {
    size_t padded = (l + 7) & ~(size_t)7;
    out = malloc(padded + 1);
    if (out != NULL) {
      memcpy(out, buf, l);
      memset(out + l, ' ', padded - l);
      out[padded] = '\0';
      *len = padded;
    }
  }
  yajl_gen_free(g);
  return out;
}

int wtx_st_write(const char *path, const wtx_st_tensor *tensors, size_t n,
                 const char *const (*meta)[2], size_t n_meta, char *err,
                 size_t errlen) {
  for (size_t i = 0; i < n; i++)
    if (wtx_dtype_safetensors(tensors[i].meta.dtype) == NULL)
      return fail(err, errlen, WTX_EINVAL, "tensor '%s': dtype %d has no "
                  "safetensors name", tensors[i].meta.name, tensors[i].meta.dtype);
  int rc = 0;
  const char *dup = wtx__strmap_first_duplicate(tensors, n, sizeof *tensors, &rc);
  if (rc != 0) return rc;
  if (dup != NULL) return fail(err, errlen, WTX_EINVAL, "tensor '%s' appears twice", dup);
  size_t hlen = 0;
  char *header = header_json(tensors, n, meta, n_meta, &hlen);
  if (header == NULL)
    return fail(err, errlen, WTX_EINVAL, "%s: cannot build the header (a name or "
                "metadata string is not UTF-8, or out of memory)", path);
  char *tmp = malloc(strlen(path) + 8);
  if (tmp == NULL) {
    free(header);
    return WTX_ENOMEM;
  }
  sprintf(tmp, "%s.XXXXXX", path);
  int fd = mkstemp(tmp);
  if (fd < 0) {
    rc = fail(err, errlen, WTX_EIO, "%s: %s", tmp, strerror(errno));
  } else {
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)hlen >> (8 * i));
    int bad = write_all(fd, len8, 8) || write_all(fd, header, hlen);
    for (size_t i = 0; i < n && !bad; i++)
      bad = write_all(fd, tensors[i].data, tensors[i].meta.nbytes);
    if (bad || fchmod(fd, 0644) != 0 || fsync(fd) != 0)
      rc = fail(err, errlen, WTX_EIO, "%s: write: %s", tmp, strerror(errno));
    if (close(fd) != 0 && rc == 0)
      rc = fail(err, errlen, WTX_EIO, "%s: close: %s", tmp, strerror(errno));
    if (rc == 0 && rename(tmp, path) != 0)
      rc = fail(err, errlen, WTX_EIO, "%s: rename: %s", path, strerror(errno));
    if (rc != 0) {
      unlink(tmp);
    } else {
      /* The rename itself must survive a crash: sync the directory. */
      char *dir = strdup(path);
      int dfd = dir ? open(dirname(dir), O_RDONLY | O_DIRECTORY) : -1;
      if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
      }
      free(dir);
    }
  }
  free(tmp);
  free(header);
  return rc;
}
