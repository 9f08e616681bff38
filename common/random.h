/* Secrets: the kernel's random bytes, for session ids and data tokens. */
#ifndef WTX_COMMON_RANDOM_H
#define WTX_COMMON_RANDOM_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Fills out with n random bytes from the kernel's generator (getrandom,
 * retried while interrupted): 0, or WTX_EIO when the kernel gives none. */
int wtx__random_bytes(void *out, size_t n);

#ifdef __cplusplus
}
#endif
#endif /* WTX_COMMON_RANDOM_H */
