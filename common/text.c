#include "common/text.h"

#include <string.h>
#include <unistr.h>

#include "wtx/error.h"

int wtx__utf8_valid(const char *s) {
  return u8_check((const uint8_t *)s, strlen(s)) == NULL;
}

int wtx__split_hostport(const char *addr, char *host, size_t hlen, char *port, size_t plen) {
  const char *colon = strrchr(addr, ':');
  if (colon == NULL || colon == addr || colon[1] == '\0') return WTX_EINVAL;
  const char *h = addr;
  size_t n = (size_t)(colon - addr);
  if (h[0] == '[' && n >= 2 && h[n - 1] == ']') {
    h++;
    n -= 2;
  }
  if (n >= hlen || strlen(colon + 1) >= plen) return WTX_EINVAL;
  memcpy(host, h, n);
  host[n] = '\0';
  strcpy(port, colon + 1);
  return 0;
}
