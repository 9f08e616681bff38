/* The fused copy-and-hash kernels behind wtx__copy_hash (common/copy.c).
 *
 * XXH3's streaming update (XXH3_update in xxhash.h) takes the function that
 * folds one 64-byte stripe into the accumulators as a parameter; that is how
 * xxhash's own xxh_x86dispatch.c builds its AVX2 and AVX-512 variants. Here
 * the same update runs with a stripe function that also stores the stripe,
 * still in a register, to its place in the destination: the copy costs no
 * second read of the source, and the hash's arithmetic runs in the shadow of
 * the copy's memory traffic instead of after it. The digests are XXH3's own
 * (the update, the block scrambling and the final digest are the library's
 * code, compiled inline here, and every SIMD width gives the same digest).
 *
 * The update also folds stripes out of the state's own 256-byte buffer (the
 * input that straddles two calls); those are not the caller's bytes and are
 * not stored. A stripe is stored when it lies in [src, src + n); the ones
 * XXH3 consumes from the caller's input form one contiguous run, and the
 * bytes before and after it (what the update moved through its buffer) are
 * copied with memcpy afterwards. The run's bounds and the destination's
 * offset live in a thread-local context: the stripe function's signature is
 * the library's.
 *
 * This file includes xxhash.h inline (XXH_INLINE_ALL), so its XXH3 names
 * and types differ from the rest of the tree's (common/hash.h); the state
 * crosses the boundary as void *, and copy.c checks the two layouts' sizes
 * agree before it uses a kernel. */
#include "common/copy_xxh3.h"

#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define XXH_STATIC_LINKING_ONLY
#define XXH_X86DISPATCH /* the 64-byte accumulator alignment AVX-512 needs */
#define XXH_DISPATCH_AVX2 1
#define XXH_DISPATCH_AVX512 1
#define XXH_TARGET_AVX2 __attribute__((__target__("avx2")))
#define XXH_TARGET_AVX512 __attribute__((__target__("avx512f")))
#define XXH_INLINE_ALL
#include <xxhash.h>

/* The call in progress on this thread: stripes in [lo, lo + span] (their
 * first byte) are the caller's, stored at their address + delta; first and
 * end bound the run stored. */
typedef struct fuse_ctx {
  uintptr_t lo, span;
  ptrdiff_t delta;
  uintptr_t first, end;
} fuse_ctx;

static _Thread_local fuse_ctx fuse;

/* Notes a stripe at p stored; 1 when p is the caller's. */
static inline int caller_stripe(const void *p) {
  uintptr_t a = (uintptr_t)p;
  if (a - fuse.lo > fuse.span) return 0;
  if (fuse.first == 0) fuse.first = a;
  fuse.end = a + 64;
  return 1;
}

/* The stripe functions: the stripe is loaded once, stored (non-temporal
 * where its line is whole and aligned and the caller asked to stream),
 * and folded in by XXH3's own function from the copy in registers: where
 * the source is not 64-byte aligned each load splits across two lines,
 * and XXH3's fold, given the source, would load it twice more. */
typedef struct stripe {
  uint8_t b[64];
} stripe;

#define STRIPE_FN(name, target, acc512, put, stream)                                \
  XXH_FORCE_INLINE target void name(void *XXH_RESTRICT acc, const void *XXH_RESTRICT in, \
                                    const void *XXH_RESTRICT secret) {             \
    if (!caller_stripe(in)) {                                                     \
      acc512(acc, in, secret);                                                    \
      return;                                                                     \
    }                                                                             \
    stripe v;                                                                     \
    put((uint8_t *)in + fuse.delta, v.b, (const uint8_t *)in, stream);            \
    acc512(acc, v.b, secret);                                                     \
  }

/* Each loads the stripe at s into v and stores it at d: non-temporal when
 * stream (a constant where it is inlined) and d starts a line. */
XXH_FORCE_INLINE XXH_TARGET_AVX512 void put512(uint8_t *d, uint8_t *v, const uint8_t *s,
                                               int stream) {
  __m512i x = _mm512_loadu_si512(s);
  _mm512_storeu_si512(v, x);
  if (stream && ((uintptr_t)d & 63) == 0) _mm512_stream_si512((void *)d, x);
  else _mm512_storeu_si512(d, x);
}
XXH_FORCE_INLINE XXH_TARGET_AVX2 void put256(uint8_t *d, uint8_t *v, const uint8_t *s,
                                             int stream) {
  __m256i a = _mm256_loadu_si256((const __m256i *)s);
  __m256i b = _mm256_loadu_si256((const __m256i *)(s + 32));
  _mm256_storeu_si256((__m256i *)v, a);
  _mm256_storeu_si256((__m256i *)(v + 32), b);
  if (stream && ((uintptr_t)d & 63) == 0) {
    _mm256_stream_si256((__m256i *)d, a);
    _mm256_stream_si256((__m256i *)(d + 32), b);
  } else {
    _mm256_storeu_si256((__m256i *)d, a);
    _mm256_storeu_si256((__m256i *)(d + 32), b);
  }
}

STRIPE_FN(acc_store512, XXH_TARGET_AVX512, XXH3_accumulate_512_avx512, put512, 0)
STRIPE_FN(acc_stream512, XXH_TARGET_AVX512, XXH3_accumulate_512_avx512, put512, 1)
STRIPE_FN(acc_store256, XXH_TARGET_AVX2, XXH3_accumulate_512_avx2, put256, 0)
STRIPE_FN(acc_stream256, XXH_TARGET_AVX2, XXH3_accumulate_512_avx2, put256, 1)

/* Runs before and after a kernel's update: sets the context up, then
 * copies what the update did not store (all of it when it stored none). */
static void begin(uint8_t *dst, const uint8_t *src, size_t n) {
  fuse = (fuse_ctx){.lo = (uintptr_t)src, .span = n >= 64 ? n - 64 : 0,
                    .delta = dst - src};
  if (n < 64) fuse.lo = UINTPTR_MAX; /* nothing the update reads is the caller's */
}

static void finish(uint8_t *dst, const uint8_t *src, size_t n) {
  if (fuse.first == 0) {
    memcpy(dst, src, n);
    return;
  }
  size_t head = fuse.first - (uintptr_t)src, tail = fuse.end - (uintptr_t)src;
  memcpy(dst, src, head);
  memcpy(dst + tail, src + tail, n - tail);
}

/* One kernel per width and store kind: the stripe function must be a
 * constant for XXH3_update to inline it, as in xxh_x86dispatch.c. */
#define KERNEL(name, target, acc, scramble, stream)                                 \
  target void name(uint8_t *dst, const uint8_t *src, size_t n, void *state) {     \
    begin(dst, src, n);                                                          \
    XXH3_update((XXH3_state_t *)state, src, n, acc, scramble);                   \
    if (stream) _mm_sfence(); /* the stores are visible before anyone is told */ \
    finish(dst, src, n);                                                         \
  }

KERNEL(wtx__copy_xxh3_avx512, XXH_TARGET_AVX512, acc_store512, XXH3_scrambleAcc_avx512, 0)
KERNEL(wtx__copy_xxh3_avx512_stream, XXH_TARGET_AVX512, acc_stream512, XXH3_scrambleAcc_avx512, 1)
KERNEL(wtx__copy_xxh3_avx2, XXH_TARGET_AVX2, acc_store256, XXH3_scrambleAcc_avx2, 0)
KERNEL(wtx__copy_xxh3_avx2_stream, XXH_TARGET_AVX2, acc_stream256, XXH3_scrambleAcc_avx2, 1)

const size_t wtx__copy_xxh3_state_size = sizeof(XXH3_state_t);

#else /* no kernels: copy.c copies, then hashes */

const size_t wtx__copy_xxh3_state_size = 0;

#define NONE(name) \
  void name(uint8_t *dst, const uint8_t *src, size_t n, void *state) { \
    (void)dst, (void)src, (void)n, (void)state;                        \
  }
NONE(wtx__copy_xxh3_avx512)
NONE(wtx__copy_xxh3_avx512_stream)
NONE(wtx__copy_xxh3_avx2)
NONE(wtx__copy_xxh3_avx2_stream)

#endif
