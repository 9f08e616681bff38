#include "common/copy.h"

#include <string.h>

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
