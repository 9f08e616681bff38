#include "wtx/tensor.h"

#include <stdio.h>
#include <string.h>

#include "wtx/error.h"

size_t wtx_dtype_size(int dtype) {
  switch (dtype) {
#define XX(name, value, size, st) \
  case value:                     \
    return size;
    WTX_DTYPE_MAP(XX)
#undef XX
  }
  return 0;
}

const char *wtx_dtype_name(int dtype) {
  switch (dtype) {
#define XX(name, value, size, st) \
  case value:                     \
    return #name;
    WTX_DTYPE_MAP(XX)
#undef XX
  }
  return "UNSPECIFIED";
}

const char *wtx_dtype_safetensors(int dtype) {
  switch (dtype) {
#define XX(name, value, size, st) \
  case value:                     \
    return st;
    WTX_DTYPE_MAP(XX)
#undef XX
  }
  return NULL;
}

int wtx_dtype_from_safetensors(const char *s) {
#define XX(name, value, size, st) \
  if (strcmp(s, st) == 0) return value;
  WTX_DTYPE_MAP(XX)
#undef XX
  return 0;
}

int wtx_tensor_nbytes(int dtype, const uint64_t *shape, size_t ndim,
                      uint64_t *out) {
  size_t es = wtx_dtype_size(dtype);
  if (es == 0 || ndim > WTX_MAX_DIMS) return WTX_EINVAL;
  const uint64_t limit = UINT64_C(1) << 63;
  uint64_t n = es;
  for (size_t i = 0; i < ndim; i++) {
    if (shape[i] == 0) {
      n = 0;
      continue;
    }
    if (n != 0 && shape[i] > (limit - 1) / n) {
      /* Still an error even if a later dim is 0: the shape is malformed. */
      return WTX_ERANGE;
    }
    n *= shape[i];
  }
  *out = n;
  return 0;
}

int wtx_tensor_meta_set(wtx_tensor_meta *out, const char *name, int dtype,
                        const uint64_t *shape, size_t ndim, char *err,
                        size_t errlen) {
  size_t nlen = name != NULL ? strlen(name) : 0;
  memset(out, 0, sizeof *out);
  if (nlen == 0 || nlen > WTX_MAX_NAME_BYTES) {
    snprintf(err, errlen, "name: %zu bytes, must be 1..%d", nlen, WTX_MAX_NAME_BYTES);
    return WTX_EINVAL;
  }
  if (wtx_dtype_size(dtype) == 0) {
    snprintf(err, errlen, "dtype: %d is not a wire dtype ('%s')", dtype, name);
    return WTX_EINVAL;
  }
  if (ndim > WTX_MAX_DIMS || (ndim > 0 && shape == NULL)) {
    snprintf(err, errlen, "shape: %zu dims, at most %d ('%s')", ndim, WTX_MAX_DIMS, name);
    return WTX_EINVAL;
  }
  out->name = name;
  out->dtype = dtype;
  out->ndim = ndim;
  if (ndim > 0) memcpy(out->shape, shape, ndim * sizeof *shape);
  if (wtx_tensor_nbytes(dtype, out->shape, ndim, &out->nbytes) != 0) {
    snprintf(err, errlen, "shape: byte size overflows 63 bits ('%s')", name);
    return WTX_EINVAL;
  }
  return 0;
}

int wtx_tensor_meta_same_layout(const wtx_tensor_meta *a,
                                const wtx_tensor_meta *b) {
  if (a->dtype != b->dtype || a->ndim != b->ndim) return 0;
  for (size_t i = 0; i < a->ndim; i++)
    if (a->shape[i] != b->shape[i]) return 0;
  return 1;
}

void wtx_tensor_meta_str(const wtx_tensor_meta *m, char *buf, size_t len) {
  size_t o = (size_t)snprintf(buf, len, "shape [");
  for (size_t d = 0; d < m->ndim && o < len; d++)
    o += (size_t)snprintf(buf + o, len - o, "%s%llu", d ? ", " : "",
                          (unsigned long long)m->shape[d]);
  if (o < len) snprintf(buf + o, len - o, "] %s", wtx_dtype_name(m->dtype));
}
