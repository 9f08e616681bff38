#include "common/tensor.h"

#include <string.h>

#include "common/error.h"

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
