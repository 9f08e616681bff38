/* safetensors read and write (see safetensors.h). */
#include "common/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <libgen.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "wtx/error.h"

struct wtx_st_file {
  uint8_t *map;
  size_t size;
  int borrowed; /* map is the caller's memory (wtx_st_parse), not unmapped */
  json_t *header;
  json_t *metadata; /* borrowed from header */
  wtx_st_tensor *tensors;
  size_t n;
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

/* Fills t from one header entry; offsets go to *begin, *end. */
static int parse_entry(const char *path, const char *name, json_t *v,
                       wtx_tensor_meta *t, uint64_t *begin, uint64_t *end,
                       char *err, size_t errlen) {
  json_t *dt = json_object_get(v, "dtype");
  json_t *shape = json_object_get(v, "shape");
  json_t *offs = json_object_get(v, "data_offsets");
  if (!json_is_object(v) || !json_is_string(dt) || !json_is_array(shape) ||
      !json_is_array(offs) || json_array_size(offs) != 2)
    return fail(err, errlen, WTX_EINVAL,
                "%s: tensor '%s': needs dtype (string), shape (array) and "
                "data_offsets ([begin, end])", path, name);
  t->name = name;
  t->dtype = wtx_dtype_from_safetensors(json_string_value(dt));
  if (t->dtype == 0)
    return fail(err, errlen, WTX_EINVAL, "%s: tensor '%s': dtype '%s' unknown",
                path, name, json_string_value(dt));
  t->ndim = json_array_size(shape);
  if (t->ndim > WTX_MAX_DIMS)
    return fail(err, errlen, WTX_EINVAL, "%s: tensor '%s': %zu dims, at most %d",
                path, name, t->ndim, WTX_MAX_DIMS);
  for (size_t i = 0; i < t->ndim; i++) {
    json_t *d = json_array_get(shape, i);
    if (!json_is_integer(d) || json_integer_value(d) < 0)
      return fail(err, errlen, WTX_EINVAL,
                  "%s: tensor '%s': shape[%zu] is not a non-negative integer",
                  path, name, i);
    t->shape[i] = (uint64_t)json_integer_value(d);
  }
  json_t *b = json_array_get(offs, 0), *e = json_array_get(offs, 1);
  if (!json_is_integer(b) || !json_is_integer(e) || json_integer_value(b) < 0 ||
      json_integer_value(e) < json_integer_value(b))
    return fail(err, errlen, WTX_EINVAL,
                "%s: tensor '%s': data_offsets must be integers 0 <= begin <= end",
                path, name);
  *begin = (uint64_t)json_integer_value(b);
  *end = (uint64_t)json_integer_value(e);
  int rc = wtx_tensor_nbytes(t->dtype, t->shape, t->ndim, &t->nbytes);
  if (rc != 0)
    return fail(err, errlen, rc, "%s: tensor '%s': shape too large", path, name);
  if (*end - *begin != t->nbytes)
    return fail(err, errlen, WTX_EINVAL,
                "%s: tensor '%s': data_offsets span %llu bytes, dtype x shape "
                "is %llu", path, name, (unsigned long long)(*end - *begin),
                (unsigned long long)t->nbytes);
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
  json_error_t je;
  f->header = json_loadb((const char *)f->map + 8, n, JSON_REJECT_DUPLICATES, &je);
  if (f->header == NULL || !json_is_object(f->header))
    return fail(err, errlen, WTX_EINVAL, "%s: header is not a JSON object: %s",
                path, f->header == NULL ? je.text : "other JSON value");
  const uint8_t *data = f->map + 8 + n;
  uint64_t data_len = f->size - 8 - n;
  f->tensors = calloc(json_object_size(f->header) + 1, sizeof *f->tensors);
  if (f->tensors == NULL) return WTX_ENOMEM;
  const char *key;
  json_t *v;
  json_object_foreach(f->header, key, v) {
    if (strcmp(key, "__metadata__") == 0) {
      if (!json_is_object(v))
        return fail(err, errlen, WTX_EINVAL, "%s: __metadata__ is not an object",
                    path);
      f->metadata = v;
      continue;
    }
    wtx_st_tensor *t = &f->tensors[f->n];
    uint64_t b = 0, e = 0;
    int rc = parse_entry(path, key, v, &t->meta, &b, &e, err, errlen);
    if (rc != 0) return rc;
    if (e > data_len)
      return fail(err, errlen, WTX_EINVAL,
                  "%s: tensor '%s': data_offsets end %llu beyond the %llu-byte "
                  "data section", path, key, (unsigned long long)e,
                  (unsigned long long)data_len);
    t->data = data + b;
    f->n++;
  }
  qsort(f->tensors, f->n, sizeof *f->tensors, by_offset);
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
    return fail(err, errlen, WTX_EINVAL,
                "%s: tensors cover %lld of %llu data bytes", path,
                (long long)(next - data), (unsigned long long)data_len);
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
  if (rc == 0) rc = parse(f, path, err, errlen);
  if (rc != 0) {
    if (rc == WTX_ENOMEM && err[0] == '\0') snprintf(err, errlen, "out of memory");
    wtx_st_close(f);
    return rc;
  }
  *out = f;
  return 0;
}

int wtx_st_parse(const uint8_t *data, size_t size, const char *name, wtx_st_file **out,
                 char *err, size_t errlen) {
  *out = NULL;
  wtx_st_file *f = calloc(1, sizeof *f);
  if (f == NULL) return WTX_ENOMEM;
  f->map = (uint8_t *)data;
  f->size = size;
  f->borrowed = 1;
  int rc = parse(f, name, err, errlen);
  if (rc != 0) {
    if (rc == WTX_ENOMEM && err[0] == '\0') snprintf(err, errlen, "out of memory");
    wtx_st_close(f);
    return rc;
  }
  *out = f;
  return 0;
}

void wtx_st_close(wtx_st_file *f) {
  if (f == NULL) return;
  if (f->map != NULL && !f->borrowed) munmap(f->map, f->size);
  if (f->header != NULL) json_decref(f->header);
  free(f->tensors);
  free(f);
}

size_t wtx_st_count(const wtx_st_file *f) { return f->n; }

const wtx_st_tensor *wtx_st_tensor_at(const wtx_st_file *f, size_t i) {
  return i < f->n ? &f->tensors[i] : NULL;
}

const char *wtx_st_metadata(const wtx_st_file *f, const char *key) {
  return f->metadata ? json_string_value(json_object_get(f->metadata, key)) : NULL;
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
static char *header_json(const wtx_st_tensor *ts, size_t n,
                         const char *const (*meta)[2], size_t n_meta,
                         size_t *len) {
  json_t *h = json_object();
  uint64_t off = 0;
  if (n_meta > 0) {
    json_t *m = json_object();
    for (size_t i = 0; i < n_meta; i++)
      json_object_set_new(m, meta[i][0], json_string(meta[i][1]));
    json_object_set_new(h, "__metadata__", m);
  }
  for (size_t i = 0; i < n; i++) {
    json_t *shape = json_array();
    for (size_t d = 0; d < ts[i].meta.ndim; d++)
      json_array_append_new(shape, json_integer((json_int_t)ts[i].meta.shape[d]));
    json_t *e = json_pack("{s:s, s:o, s:[I, I]}", "dtype",
                          wtx_dtype_safetensors(ts[i].meta.dtype), "shape", shape,
                          "data_offsets", (json_int_t)off,
                          (json_int_t)(off + ts[i].meta.nbytes));
    off += ts[i].meta.nbytes;
    if (e == NULL || json_object_set_new(h, ts[i].meta.name, e) != 0) {
      json_decref(h);
      return NULL;
    }
  }
  char *s = json_dumps(h, JSON_COMPACT);
  json_decref(h);
  if (s == NULL) return NULL;
  size_t l = strlen(s), padded = (l + 7) & ~(size_t)7;
  char *out = realloc(s, padded + 1);
  if (out == NULL) {
    free(s);
    return NULL;
  }
  memset(out + l, ' ', padded - l);
  out[padded] = '\0';
  *len = padded;
  return out;
}

int wtx_st_write(const char *path, const wtx_st_tensor *tensors, size_t n,
                 const char *const (*meta)[2], size_t n_meta, char *err,
                 size_t errlen) {
  for (size_t i = 0; i < n; i++)
    if (wtx_dtype_safetensors(tensors[i].meta.dtype) == NULL)
      return fail(err, errlen, WTX_EINVAL, "tensor '%s': dtype %d has no "
                  "safetensors name", tensors[i].meta.name, tensors[i].meta.dtype);
  size_t hlen = 0;
  char *header = header_json(tensors, n, meta, n_meta, &hlen);
  if (header == NULL)
    return fail(err, errlen, WTX_EINVAL, "%s: cannot build the header "
                "(duplicate names?)", path);
  char *tmp = malloc(strlen(path) + 8);
  if (tmp == NULL) {
    free(header);
    return WTX_ENOMEM;
  }
  sprintf(tmp, "%s.XXXXXX", path);
  int fd = mkstemp(tmp);
  int rc = 0;
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
