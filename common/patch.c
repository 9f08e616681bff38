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

/* Flat index i of a tensor of shape[0..ndim), in the row-major order of
 * the box lo + [0, len) of it; 0 when it lies outside the box. */
static int in_box(uint64_t i, const uint64_t *shape, size_t ndim, const uint64_t *lo,
                  const uint64_t *len, uint64_t *out) {
  uint64_t at = 0, stride = 1;
  for (size_t d = ndim; d-- > 0;) {
    uint64_t c = i % shape[d];
    i /= shape[d];
    if (c < lo[d] || c - lo[d] >= len[d]) return 0;
    at += (c - lo[d]) * stride;
    stride *= len[d];
  }
  *out = at;
  return 1;
}

uint64_t wtx__patch_cut(const uint64_t *shape, size_t ndim, const uint64_t *lo,
                        const uint64_t *len, int index_dtype, uint64_t count,
                        const void *indices, const void *values, size_t elsize, int64_t *idx,
                        uint8_t *val) {
  size_t isz = wtx__patch_index_size(index_dtype);
  uint64_t m = 0, at;
  for (uint64_t k = 0; k < count; k++) {
    if (!in_box(index_at(indices, isz, k), shape, ndim, lo, len, &at)) continue;
    idx[m] = (int64_t)at;
    memcpy(val + m * elsize, (const uint8_t *)values + k * elsize, elsize);
    m++;
  }
  return m;
}

/* Index i of the box lo + [0, len) (row-major in it) as a flat index of
 * the tensor of shape[0..ndim) it lies in. */
static uint64_t from_box(uint64_t i, const uint64_t *shape, size_t ndim, const uint64_t *lo,
                         const uint64_t *len) {
  uint64_t at = 0, stride = 1;
  for (size_t d = ndim; d-- > 0;) {
    at += (lo[d] + i % len[d]) * stride;
    i /= len[d];
    stride *= shape[d];
  }
  return at;
}

void wtx__patch_apply_box(const uint64_t *shape, size_t ndim, const uint64_t *lo,
                          const uint64_t *len, int index_dtype, uint64_t count,
                          const uint8_t *bytes, size_t elsize, uint8_t *dst) {
  size_t isz = wtx__patch_index_size(index_dtype);
  const uint8_t *values = bytes + count * isz;
  for (uint64_t k = 0; k < count; k++) {
    uint64_t at = from_box(index_at(bytes, isz, k), shape, ndim, lo, len);
    memcpy(dst + at * elsize, values + k * elsize, elsize);
  }
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

/* Adds the elements of es bytes that differ within the 8-byte word at
 * byte o, d being the XOR of its two versions; 0, or 1 once past max. */
static int word_diff(uint64_t d, uint64_t o, size_t es, size_t isz, uint64_t max,
                     uint64_t *count, uint8_t *out) {
  uint64_t mask = es == 8 ? ~UINT64_C(0) : (UINT64_C(1) << (8 * es)) - 1;
  for (size_t b = 0; b < 8; b += es) {
    if (((d >> (8 * b)) & mask) == 0) continue;
    if (*count == max) return 1;
    put_index(out, isz, (*count)++, (o + b) / es);
  }
  return 0;
}

static uint64_t load8(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, 8);
  return v;
}

uint64_t wtx__patch_diff(const uint8_t *cur, const uint8_t *prev, uint64_t nbytes, size_t elsize,
                         int index_dtype, uint64_t max, uint8_t *out) {
  size_t isz = wtx__patch_index_size(index_dtype);
  uint64_t count = 0, o = 0;
  /* Whole 8-byte words (element sizes divide 8, so no element straddles
   * two), four at a time: most of a tensor is unchanged, and one test of
   * their XORs skips 32 bytes. */
  for (; o + 32 <= nbytes; o += 32) {
    uint64_t d0 = load8(cur + o) ^ load8(prev + o), d1 = load8(cur + o + 8) ^ load8(prev + o + 8);
    uint64_t d2 = load8(cur + o + 16) ^ load8(prev + o + 16);
    uint64_t d3 = load8(cur + o + 24) ^ load8(prev + o + 24);
    if ((d0 | d1 | d2 | d3) == 0) continue;
    if (word_diff(d0, o, elsize, isz, max, &count, out) ||
        word_diff(d1, o + 8, elsize, isz, max, &count, out) ||
        word_diff(d2, o + 16, elsize, isz, max, &count, out) ||
        word_diff(d3, o + 24, elsize, isz, max, &count, out))
      return max + 1;
  }
  for (; o < nbytes; o += elsize) { /* the tail, element by element */
    uint64_t x = 0, y = 0;
    memcpy(&x, cur + o, elsize);
    memcpy(&y, prev + o, elsize);
    if (x == y) continue;
    if (count == max) return max + 1;
    put_index(out, isz, count++, o / elsize);
  }
  /* The values go after all the indices, whose number is known only now. */
  uint8_t *values = out + count * isz;
  for (uint64_t k = 0; k < count; k++)
    memcpy(values + k * elsize, cur + index_at(out, isz, k) * elsize, elsize);
  return count;
}
