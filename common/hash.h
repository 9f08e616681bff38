/* XXH3, the project's checksum and hash, through the entry points that
 * pick the widest SIMD the CPU has at run time. Debian's libxxhash exports
 * them on x86-64 (xxh_x86dispatch.h renames XXH3_64bits* to them); the
 * plain symbols are built for the SSE2 baseline and hash large inputs at a
 * third of the AVX2/AVX-512 speed. The digests are the same either way. Include this, never <xxhash.h>. */
#ifndef WTX_COMMON_HASH_H
#define WTX_COMMON_HASH_H

#include <xxhash.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xxh_x86dispatch.h>
#endif

#endif
