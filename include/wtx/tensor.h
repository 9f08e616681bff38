/* Tensor metadata shared by the trainer and the worker: wire dtypes (the
 * values of wtx.v1.DType) and the byte size of a (dtype, shape) pair. */
#ifndef WTX_TENSOR_H
#define WTX_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "wtx/limits.h"

#ifdef __cplusplus
extern "C" {
#endif

/* XX(name, wtx.v1.DType value, element bytes, safetensors name) */
#define WTX_DTYPE_MAP(XX)            \
  XX(FLOAT32, 1, 4, "F32")           \
  XX(FLOAT16, 2, 2, "F16")           \
  XX(BFLOAT16, 3, 2, "BF16")         \
  XX(FLOAT8_E4M3FN, 4, 1, "F8_E4M3") \
  XX(FLOAT8_E5M2, 5, 1, "F8_E5M2")   \
  XX(INT8, 6, 1, "I8")               \
  XX(UINT8, 7, 1, "U8")              \
  XX(INT16, 8, 2, "I16")             \
  XX(INT32, 9, 4, "I32")             \
  XX(INT64, 10, 8, "I64")            \
  XX(BOOL, 11, 1, "BOOL")            \
  XX(FLOAT64, 12, 8, "F64")          \
  XX(UINT16, 13, 2, "U16")           \
  XX(UINT32, 14, 4, "U32")           \
  XX(UINT64, 15, 8, "U64")

typedef enum wtx_dtype {
  WTX_DTYPE_UNSPECIFIED = 0,
#define WTX__DT_ENUM(name, value, size, st) WTX_DTYPE_##name = (value),
  WTX_DTYPE_MAP(WTX__DT_ENUM)
#undef WTX__DT_ENUM
} wtx_dtype;

/* Metadata of one tensor: a validated wtx.v1.ParamMeta, a safetensors
 * header entry, a source's parameter. name is owned by whoever filled it. */
typedef struct wtx_tensor_meta {
  const char *name;
  int dtype; /* wtx_dtype */
  uint64_t shape[WTX_MAX_DIMS];
  size_t ndim;
  uint64_t nbytes; /* element size x product(shape) */
} wtx_tensor_meta;

/* Which model of the worker an update writes to. The values are those of
 * wtx.v1.UpdateTarget, the same everywhere: on the wire, in the trainer
 * library, in the store and in wtx_model_ops. */
typedef enum wtx_target {
  WTX_TARGET_MAIN = 1,
  WTX_TARGET_DRAFT = 2,
} wtx_target;

/* Element size in bytes; 0 for an unknown dtype. */
size_t wtx_dtype_size(int dtype);
/* "FLOAT32", ... (static); "UNSPECIFIED" for unknown values. */
const char *wtx_dtype_name(int dtype);
/* safetensors dtype string ("F32", ...) or NULL. */
const char *wtx_dtype_safetensors(int dtype);
/* The dtype for a safetensors dtype string, or 0. */
int wtx_dtype_from_safetensors(const char *s);

/* Bytes of a tensor: product(shape) * elsize. WTX_EINVAL for an unknown dtype
 * or more than WTX_MAX_DIMS dims, WTX_ERANGE when the size does not fit in
 * 63 bits. A scalar (ndim 0) is one element. */
int wtx_tensor_nbytes(int dtype, const uint64_t *shape, size_t ndim,
                      uint64_t *out);

/* Sets *out to a checked tensor: name (borrowed) 1..WTX_MAX_NAME_BYTES
 * bytes, a known dtype, at most WTX_MAX_DIMS dims, a byte size that fits in
 * 63 bits (nbytes computed). WTX_EINVAL otherwise, with err naming the field
 * ("name: ...", "dtype: ...", "shape: ...") and the limit. */
int wtx_tensor_meta_set(wtx_tensor_meta *out, const char *name, int dtype,
                        const uint64_t *shape, size_t ndim, char *err,
                        size_t errlen);
/* 1 when a and b have the same dtype and shape (names not compared). */
int wtx_tensor_meta_same_layout(const wtx_tensor_meta *a,
                                const wtx_tensor_meta *b);
/* "shape [4096, 4096] BFLOAT16" into buf (truncated to len). */
void wtx_tensor_meta_str(const wtx_tensor_meta *m, char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif
