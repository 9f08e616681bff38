#define XXH_STATIC_LINKING_ONLY /* sizeof(XXH3_state_t) */
#include "common/copy.h"

#include <stdatomic.h>
#include <string.h>

#include "common/copy_xxh3.h"
#include "wtx/error.h"

#if defined(__x86_64__)
#include <emmintrin.h>
#endif

void wtx__copy_stream(uint8_t *dst, const uint8_t *src, size_t n) {
#if defined(__x86_64__)
  size_t head = (64 - ((uintptr_t)dst & 63)) & 63; /* to a whole line */
  if (head > n) head = n;
  memcpy(dst, src, head);
  dst += head, src += head, n -= head;
  for (; n >= 64; n -= 64, dst += 64, src += 64) {
    __m128i a = _mm_loadu_si128((const __m128i *)src);
    __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
    __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
    _mm_stream_si128((__m128i *)dst, a);
    _mm_stream_si128((__m128i *)(dst + 16), b);
    _mm_stream_si128((__m128i *)(dst + 32), c);
    _mm_stream_si128((__m128i *)(dst + 48), d);
  }
  _mm_sfence(); /* the stores are visible before anyone is told */
#endif
  memcpy(dst, src, n);
}

/* The kernels, best first; "portable" has none. */
typedef struct kernel {
  const char *isa;
  wtx__copy_xxh3_fn *store, *stream;
} kernel;

static const kernel kernels[] = {
    {"avx512", wtx__copy_xxh3_avx512, wtx__copy_xxh3_avx512_stream},
    {"avx2", wtx__copy_xxh3_avx2, wtx__copy_xxh3_avx2_stream},
    {"portable", NULL, NULL},
};
#define N_KERNELS (sizeof kernels / sizeof kernels[0])

static int usable(const kernel *k) {
  if (k->store == NULL) return 1;
  if (wtx__copy_xxh3_state_size != sizeof(XXH3_state_t)) return 0; /* 0: none built */
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (strcmp(k->isa, "avx512") == 0) return __builtin_cpu_supports("avx512f");
  if (strcmp(k->isa, "avx2") == 0) return __builtin_cpu_supports("avx2");
#endif
  return 0;
}

/* Index into kernels + 1 of the one in use; 0 until chosen. */
static atomic_int chosen;

static const kernel *current(void) {
  int c = atomic_load_explicit(&chosen, memory_order_relaxed);
  if (c == 0) { /* the same choice on every thread: a race is harmless */
    while (!usable(&kernels[c])) c++;
    atomic_store_explicit(&chosen, ++c, memory_order_relaxed);
  }
  return &kernels[c - 1];
}

/* Copied, then hashed, at a time without a kernel: the hash reads what the
 * copy just read or wrote from L2. */
#define PIECE ((size_t)256 << 10)

void wtx__copy_hash(uint8_t *dst, const uint8_t *src, size_t n, XXH3_state_t *h, int stream) {
  const kernel *k = h != NULL ? current() : NULL;
  if (k != NULL && k->store != NULL) {
    (stream ? k->stream : k->store)(dst, src, n, h);
    return;
  }
  for (size_t o = 0; o < n;) { /* in pieces the hash reads from cache */
    size_t m = n - o < PIECE ? n - o : PIECE;
    if (stream) wtx__copy_stream(dst + o, src + o, m);
    else memcpy(dst + o, src + o, m);
    if (h != NULL) XXH3_64bits_update(h, src + o, m);
    o += m;
  }
}

const char *wtx__copy_hash_isa(void) { return current()->isa; }

int wtx__copy_hash_use(const char *isa) {
  for (size_t i = 0; i < N_KERNELS; i++) {
    if (strcmp(kernels[i].isa, isa) != 0) continue;
    if (!usable(&kernels[i])) return WTX_ENOTSUP;
    atomic_store(&chosen, (int)i + 1);
    return 0;
  }
  return WTX_EINVAL;
}
