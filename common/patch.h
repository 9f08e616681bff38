/* Element patches of a tensor (wtx.v1.Patch, docs/data-plane.md "Delta
 * updates"): count flat element indices, strictly increasing, then count
 * values of the tensor's element size, little-endian. The trainer makes
 * one from the bytes a worker serves and the new ones (wtx__patch_diff);
 * the worker checks it whole (wtx__patch_check) before it applies it to a
 * copy of the served tensor (wtx__patch_apply); a tensor-parallel worker
 * gets the part of a caller's patch that falls in its slice
 * (wtx__patch_cut). diff then apply gives back
 * the new bytes exactly, whatever they hold (NaN is just bits). Pure
 * functions: no allocation, no state. */
#ifndef WTX_COMMON_PATCH_H
#define WTX_COMMON_PATCH_H

#include <stddef.h>
#include <stdint.h>

#include "wtx/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bytes of one index: 4 for WTX_DTYPE_INT32, 8 for WTX_DTYPE_INT64, 0 for
 * any other dtype. */
size_t wtx__patch_index_size(int index_dtype);
/* The index dtype a patch of a tensor of `elements` elements uses: int32
 * below 2^31 elements, else int64. */
int wtx__patch_index_dtype(uint64_t elements);
/* Bytes on the wire of a patch of count elements of size elsize. */
uint64_t wtx__patch_bytes(int index_dtype, uint64_t count, size_t elsize);
/* Checks a patch of meta's tensor: index dtype, count (1..elements; int32
 * only below 2^31 elements), len equal to its wire bytes, and, when bytes
 * is not NULL, every index below the element count and above the one
 * before. 0, or WTX_EINVAL with err saying which (never echoing values). */
int wtx__patch_check(const wtx_tensor_meta *meta, int index_dtype, uint64_t count,
                     const uint8_t *bytes, uint64_t len, char *err, size_t errlen);
/* Writes the checked patch's values into dst, meta->nbytes holding the
 * base tensor. */
void wtx__patch_apply(const wtx_tensor_meta *meta, int index_dtype, uint64_t count,
                      const uint8_t *bytes, uint8_t *dst);
/* The elements of a checked patch of a tensor of shape[0..ndim) that fall
 * in the box of it at lo, len[d] long along each dim d: as a patch of the
 * box read as a tensor of its own (row-major), their indices, increasing,
 * into idx as int64 and their values (elsize bytes each) into val, room
 * for count of each. Returns how many (0: none falls in the box). */
uint64_t wtx__patch_cut(const uint64_t *shape, size_t ndim, const uint64_t *lo,
                        const uint64_t *len, int index_dtype, uint64_t count,
                        const void *indices, const void *values, size_t elsize, int64_t *idx,
                        uint8_t *val);
/* Writes the values of a checked patch of the box lo + [0, len) of a
 * tensor of shape[0..ndim) (its indices in the box's row-major order, as
 * wtx__patch_cut makes them) into dst, that whole tensor, row-major: where
 * each element lies in the tensor, with no copy of the box. */
void wtx__patch_apply_box(const uint64_t *shape, size_t ndim, const uint64_t *lo,
                          const uint64_t *len, int index_dtype, uint64_t count,
                          const uint8_t *bytes, size_t elsize, uint8_t *dst);
/* The elements (of elsize bytes) where cur differs from prev, nbytes each,
 * as a patch into out (room for max elements' indices and values: at
 * least wtx__patch_bytes(index_dtype, max, elsize)): the count, or max + 1
 * once more than max differ (out then holds nothing usable). Values are
 * compared as bytes. */
uint64_t wtx__patch_diff(const uint8_t *cur, const uint8_t *prev, uint64_t nbytes, size_t elsize,
                         int index_dtype, uint64_t max, uint8_t *out);

#ifdef __cplusplus
}
#endif
#endif /* WTX_COMMON_PATCH_H */
