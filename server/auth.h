/* Who may call a worker: the authorize hook of its gRPC server.
 *
 * With a token file every call needs "authorization: Bearer <token>"
 * (UNAUTHENTICATED otherwise), except gRPC health (probes carry no
 * credentials) and, unless closed, server reflection. The token is the
 * file's first line, compared in constant time, and re-read whenever the
 * path's file changes (inode, size or mtime, through symlinks) and on
 * every call while its mtime is under 2 s old (a rewrite in place within
 * one tick of the filesystem's clock moves none of those), so an operator
 * rotates it by replacing the file, rewriting it, or as Kubernetes swaps a
 * Secret volume's ..data symlink; a file no token can be read from later
 * keeps the last good token. Without a token file every call is admitted:
 * TLS client certificates (mTLS) are then the only gate, checked by gRPC
 * itself. */
#ifndef WTX_SERVER_AUTH_H
#define WTX_SERVER_AUTH_H

#include "rpc/rpc.h"
#include "wtx/worker.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wtx__auth wtx__auth;

/* token_file may be NULL (no token). A token file that cannot be read, or
 * whose first line is empty or longer than 4096 bytes, is an error naming
 * it. *out is the caller's until wtx__auth_destroy. */
int wtx__auth_create(const char *token_file, wtx_reflection reflection,
                     wtx__auth **out, char *err, size_t errlen);
void wtx__auth_destroy(wtx__auth *a);
/* The server's authorize hook (auth_data: the wtx__auth). */
grpc_status_code wtx__auth_check(void *auth, wtx__rpc_ctx *ctx);
/* 1 when a and b are equal; time depends on the lengths only. */
int wtx__auth_equal(const char *a, size_t alen, const char *b, size_t blen);

#ifdef __cplusplus
}
#endif
#endif /* WTX_SERVER_AUTH_H */
