/* Where a worker may connect: a list of networks ("10.0.0.0/8",
 * "fd00::/8"), addresses ("10.1.2.3") and host names (resolved once, when
 * the list is made, to every address they have), as wtx-worker
 * --allow-upstream takes it. Internal to transport/ and server/. */
#ifndef WTX_TRANSPORT_NETALLOW_H
#define WTX_TRANSPORT_NETALLOW_H

#include <stddef.h>
#include <sys/socket.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wtx__netallow wtx__netallow;

/* Parses a comma-separated list; NULL or "" allows everything (*out stays
 * NULL). On error err names the entry. *out is the caller's until
 * wtx__netallow_destroy. */
int wtx__netallow_parse(const char *list, wtx__netallow **out, char *err, size_t errlen);
void wtx__netallow_destroy(wtx__netallow *a);
/* 1 when a (NULL: everything allowed) admits addr. */
int wtx__netallow_admits(const wtx__netallow *a, const struct sockaddr *addr);

#ifdef __cplusplus
}
#endif
#endif /* WTX_TRANSPORT_NETALLOW_H */
