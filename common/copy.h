/* Copying that leaves the destination out of the cache. */
#ifndef WTX_COMMON_COPY_H
#define WTX_COMMON_COPY_H

#include <stddef.h>
#include <stdint.h>

/* memcpy of n bytes with non-temporal stores (x86-64; plain memcpy
 * elsewhere): the destination's lines are written without being read
 * first (no read for ownership) and are not kept in cache, for a copy into
 * memory nothing reads soon (a model's staging). glibc's memcpy does so
 * only above a threshold set from the cache size (114 MiB on the bench
 * machine), so the pieces a receive copies never get it. Any alignment;
 * dst and src must not overlap. */
void wtx__copy_stream(uint8_t *dst, const uint8_t *src, size_t n);

#endif
