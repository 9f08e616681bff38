/* Publishing every finished version of the main weights as a safetensors
 * file (wtx-worker --publish-dir), off the gRPC threads. */
#ifndef WTX_SERVER_PUBLISH_H
#define WTX_SERVER_PUBLISH_H

#include "wtx/worker.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wtx__publisher wtx__publisher;

/* Writes every published main version of store to dir as
 * <version>.safetensors plus a LATEST file naming it, keeping the newest
 * keep files it wrote (older ones are deleted). WTX_ENOENT when dir is not
 * a writable directory. store must outlive the publisher; *out is the
 * caller's until wtx__publisher_destroy. */
int wtx__publisher_create(wtx_store *store, const char *dir, int keep,
                          wtx__publisher **out);
/* A new version is published: write it soon (returns at once). */
void wtx__publisher_notify(wtx__publisher *p);
/* Writes a version still queued, then stops and frees p. */
void wtx__publisher_destroy(wtx__publisher *p);

/* Shared with the vLLM bridge (vllm.c), which writes versions too. */

/* version as a file name: [A-Za-z0-9._-] kept, others '_', no leading
 * '.', at most 200 bytes (len permitting). 1 when nothing had to change. */
int wtx__file_name(const char *version, char *out, size_t len);
/* Writes view v as the safetensors file path, with its version and
 * generation in the header's metadata. err says why on failure. */
int wtx__write_view(const wtx_store_view *v, const char *path, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* WTX_SERVER_PUBLISH_H */
