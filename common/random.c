/* Secrets from the kernel (see random.h). */
#include <errno.h>
#include <stdint.h>
#include <sys/random.h>

#include "common/random.h"
#include "wtx/error.h"

int wtx__random_bytes(void *out, size_t n) {
  uint8_t *p = out;
  while (n > 0) {
    ssize_t got = getrandom(p, n, 0);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return WTX_EIO;
    p += got;
    n -= (size_t)got;
  }
  return 0;
}
