#include "common/text.h"

#include <string.h>
#include <unistr.h>

int wtx__utf8_valid(const char *s) {
  return u8_check((const uint8_t *)s, strlen(s)) == NULL;
}
