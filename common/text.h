/* Checks of the text a caller sends (parameter names, version labels,
 * reasons): valid UTF-8, over GNU libunistring; and addresses given as
 * text. */
#ifndef WTX_COMMON_TEXT_H
#define WTX_COMMON_TEXT_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when s (a C string) is valid UTF-8. */
int wtx__utf8_valid(const char *s);

/* Splits "host:port" or "[v6]:port" into host (brackets dropped) and port,
 * each NUL-terminated in buffers of hlen and plen bytes: 0, or WTX_EINVAL
 * when addr is not of that form (no host or port) or a part does not fit. */
int wtx__split_hostport(const char *addr, char *host, size_t hlen, char *port, size_t plen);

#ifdef __cplusplus
}
#endif
#endif /* WTX_COMMON_TEXT_H */
