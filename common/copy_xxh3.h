/* The fused copy-and-hash kernels (copy_xxh3.c), for common/copy.c only.
 * Each copies n bytes from src to dst (not overlapping) and adds them to
 * state, an XXH3_state_t of common/hash.h (void *: the kernels' file
 * compiles xxhash.h inline, under other names), as XXH3_64bits_update
 * would. _stream: the destination's whole aligned lines are written with
 * non-temporal stores. Callable only where wtx__copy_xxh3_state_size is
 * not 0 and the CPU has the instruction set (avx512f, avx2) in the name. */
#ifndef WTX_COMMON_COPY_XXH3_H
#define WTX_COMMON_COPY_XXH3_H

#include <stddef.h>
#include <stdint.h>

typedef void wtx__copy_xxh3_fn(uint8_t *dst, const uint8_t *src, size_t n, void *state);

wtx__copy_xxh3_fn wtx__copy_xxh3_avx512, wtx__copy_xxh3_avx512_stream, wtx__copy_xxh3_avx2,
    wtx__copy_xxh3_avx2_stream;

/* sizeof the kernels' XXH3_state_t, 0 where none are built (the names
 * above are then empty stand-ins): copy.c uses a kernel only when it
 * equals common/hash.h's. */
extern const size_t wtx__copy_xxh3_state_size;

#endif
