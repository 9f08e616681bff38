/* safetensors files: read (mmap, header validated) and write (atomically).
 *
 * Format (https://huggingface.co/docs/safetensors): 8 bytes little-endian
 * header length N, N bytes of JSON {"name": {"dtype": "F32", "shape": [..],
 * "data_offsets": [begin, end]}, ..., "__metadata__": {"k": "v"}}, then the
 * data section; offsets are relative to it, tensors cover it without holes
 * or overlaps. JSON is read and written with yajl (its event parser: no
 * tree, so a header of 100k tensors costs one pass). */
#ifndef WTX_COMMON_SAFETENSORS_H
#define WTX_COMMON_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "wtx/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest header accepted, as the reference implementation (100 MB). */
#define WTX_ST_MAX_HEADER (100u * 1000u * 1000u)

/* A tensor of a file: its header entry and its bytes (into the mapping when
 * read; the caller's when written). */
typedef struct wtx_st_tensor {
  wtx_tensor_meta meta;
  const uint8_t *data;
} wtx_st_tensor;

typedef struct wtx_st_file wtx_st_file;

/* Maps path read-only and validates its header: dtypes known, shapes within
 * WTX_MAX_DIMS, byte sizes equal to dtype x shape, offsets covering the
 * data section exactly, file size equal to 8 + N + data. On failure err
 * names the file, the tensor and the field. *out is owned by the caller
 * until wtx_st_close; tensors are in data-offset order. */
int wtx_st_open(const char *path, wtx_st_file **out, char *err, size_t errlen);
void wtx_st_close(wtx_st_file *f);
size_t wtx_st_count(const wtx_st_file *f);
/* Tensor i (i < count), valid until wtx_st_close. */
const wtx_st_tensor *wtx_st_tensor_at(const wtx_st_file *f, size_t i);
/* The value of __metadata__ key, or NULL; valid until wtx_st_close. */
const char *wtx_st_metadata(const wtx_st_file *f, const char *key);

/* The same over size bytes at data (a file's whole content), which the
 * caller keeps valid and unchanged until wtx_st_close; name stands for the
 * path in messages. */
int wtx_st_parse(const uint8_t *data, size_t size, const char *name, wtx_st_file **out,
                 char *err, size_t errlen);

/* Writes tensors (data set) to path atomically: a temporary file in the
 * same directory, fsync, rename over path, fsync of the directory, so a
 * reader sees the old file or the new one, never a part. meta holds n_meta
 * key/value string pairs for __metadata__ (may be NULL). */
int wtx_st_write(const char *path, const wtx_st_tensor *tensors, size_t n,
                 const char *const (*meta)[2], size_t n_meta, char *err,
                 size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* WTX_COMMON_SAFETENSORS_H */
