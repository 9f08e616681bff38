/* Element patches (see patch.h). */
#include <stdio.h>
#include <string.h>

#include "common/patch.h"
#include "wtx/error.h"

size_t wtx__patch_index_size(int index_dtype) {
  return index_dtype == WTX_DTYPE_INT32 ? 4 : index_dtype == WTX_DTYPE_INT64 ? 8 : 0;
}

int wtx__patch_index_dtype(uint64_t elements) {
  return elements <= (UINT64_C(1) << 31) ? WTX_DTYPE_INT32 : WTX_DTYPE_INT64;
}

uint64_t wtx__patch_bytes(int index_dtype, uint64_t count, size_t elsize) {
  return count * (wtx__patch_index_size(index_dtype) + elsize);
}

/* Index k of a patch (little-endian, as x86 and ARM hold it). */
static uint64_t index_at(const uint8_t *bytes, size_t isz, uint64_t k) {
  if (isz == 4) {
    uint32_t v;
    memcpy(&v, bytes + k * 4, 4);
    return v;
  }
  uint64_t v;
  memcpy(&v, bytes + k * 8, 8);
  return v;
}

int wtx__patch_check(const wtx_tensor_meta *meta, int index_dtype, uint64_t count,
                     const uint8_t *bytes, uint64_t len, char *err, size_t errlen) {
  size_t es = wtx_dtype_size(meta->dtype), isz = wtx__patch_index_size(index_dtype);
  uint64_t elements = es ? meta->nbytes / es : 0;
  int need64 = elements > (UINT64_C(1) << 31);
  if (isz == 0 || (isz == 4 && need64)) {
    snprintf(err, errlen, "patch.index_dtype: must be %s for '%s' (%llu elements)",
             need64 ? "INT64" : "INT32 or INT64", meta->name, (unsigned long long)elements);
    return WTX_EINVAL;
  }
  if (count == 0 || count > elements) {
    snprintf(err, errlen, "patch.count: %llu for '%s', must be 1..%llu (its elements)",
             (unsigned long long)count, meta->name, (unsigned long long)elements);
    return WTX_EINVAL;
  }
  if (len != wtx__patch_bytes(index_dtype, count, es)) {
    snprintf(err, errlen, "patch of '%s': %llu bytes, %llu indices and values of %s take %llu",
             meta->name, (unsigned long long)len, (unsigned long long)count,
             wtx_dtype_name(meta->dtype),
             (unsigned long long)wtx__patch_bytes(index_dtype, count, es));
    return WTX_EINVAL;
  }
  for (uint64_t k = 0, prev = 0; bytes != NULL && k < count; k++) {
    uint64_t at = index_at(bytes, isz, k);
    if (at >= elements || (k > 0 && at <= prev)) {
      snprintf(err, errlen, "patch of '%s': index %llu of %llu is %s", meta->name,
               (unsigned long long)k, (unsigned long long)count,
               at >= elements ? "past the tensor's elements"
                              : "not above the one before (indices strictly increase, "
                                "so none repeats)");
      return WTX_EINVAL;
    }
    prev = at;
  }
  return 0;
}

void wtx__patch_apply(const wtx_tensor_meta *meta, int index_dtype, uint64_t count,
                      const uint8_t *bytes, uint8_t *dst) {
  size_t es = wtx_dtype_size(meta->dtype), isz = wtx__patch_index_size(index_dtype);
  const uint8_t *values = bytes + count * isz;
  for (uint64_t k = 0; k < count; k++)
    memcpy(dst + index_at(bytes, isz, k) * es, values + k * es, es);
}

/* Appends index i (and later its value) to a patch being made. */
static void put_index(uint8_t *out, size_t isz, uint64_t k, uint64_t i) {
  if (isz == 4) {
    uint32_t v = (uint32_t)i;
    memcpy(out + k * 4, &v, 4);
  } else {
    memcpy(out + k * 8, &i, 8);
  }
}

/* Whether the elements of es bytes at a and b hold the same bits. */
static int same_element(const uint8_t *a, const uint8_t *b, size_t es) {
  uint64_t x = 0, y = 0;
  memcpy(&x, a, es);
  memcpy(&y, b, es);
  return x == y;
}

/* Bytes compared at once before element by element: most of a tensor is
 * unchanged, and one compare of a block costs less than its elements'. */
#define BLOCK 64

uint64_t wtx__patch_diff(const uint8_t *cur, const uint8_t *prev, uint64_t nbytes, size_t elsize,
                         int index_dtype, uint64_t max, uint8_t *out) {
  size_t isz = wtx__patch_index_size(index_dtype);
  uint64_t count = 0;
  for (uint64_t o = 0; o < nbytes; o += BLOCK) {
    uint64_t end = nbytes - o < BLOCK ? nbytes : o + BLOCK;
    if (memcmp(cur + o, prev + o, end - o) == 0) continue;
    for (uint64_t b = o; b < end; b += elsize) {
      if (same_element(cur + b, prev + b, elsize)) continue;
      if (count == max) return max + 1;
      put_index(out, isz, count++, b / elsize);
    }
  }
  /* The values go after all the indices, whose number is known only now. */
  uint8_t *values = out + count * isz;
  for (uint64_t k = 0; k < count; k++)
    memcpy(values + k * elsize, cur + index_at(out, isz, k) * elsize, elsize);
  return count;
}
