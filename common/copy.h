/* Copying: into memory nothing reads soon, and copying while hashing. */
#ifndef WTX_COMMON_COPY_H
#define WTX_COMMON_COPY_H

#include <stddef.h>
#include <stdint.h>

#include "common/hash.h"

/* memcpy of n bytes with non-temporal stores (x86-64; plain memcpy
 * elsewhere): the destination's lines are written without being read
 * first (no read for ownership) and are not kept in cache, for a copy into
 * memory nothing reads soon (a model's staging). glibc's memcpy does so
 * only above a threshold set from the cache size (114 MiB on the bench
 * machine), so the pieces a receive copies never get it. Any alignment;
 * dst and src must not overlap. */
void wtx__copy_stream(uint8_t *dst, const uint8_t *src, size_t n);

/* Copies n bytes from src to dst (not overlapping) and, when h is not
 * NULL, adds them to the XXH3 streaming state h, as XXH3_64bits_update(h,
 * src, n) would, in one pass over src: each 64-byte stripe the hash folds
 * in is stored from the register it was loaded into (common/copy_xxh3.c),
 * so hashing costs no second read and its arithmetic overlaps the copy's
 * memory traffic. stream: dst is not read soon (a model's staging), and
 * its whole aligned lines get non-temporal stores, as wtx__copy_stream;
 * else ordinary stores (a buffer another thread reads next). h NULL: a
 * plain copy (wtx__copy_stream or memcpy). Without AVX2 or AVX-512 (or
 * off x86-64) it copies and then hashes, with the same result. */
void wtx__copy_hash(uint8_t *dst, const uint8_t *src, size_t n, XXH3_state_t *h, int stream);

/* The kernel wtx__copy_hash uses: "avx512", "avx2" or "portable" (copy,
 * then hash). */
const char *wtx__copy_hash_isa(void);

/* For tests: makes wtx__copy_hash use the kernel named isa
 * (as above). 0; WTX_ENOTSUP where this CPU or build lacks it; WTX_EINVAL
 * for another name. Call it before copies start, not during them. */
int wtx__copy_hash_use(const char *isa);

#endif
