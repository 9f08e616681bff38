/* The store's internals that tests observe (its public API is
 * wtx_store_* in wtx/worker.h). */
#ifndef WTX_SERVER_STORE_H
#define WTX_SERVER_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "wtx/worker.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A tensor of at most this many bytes is kept in a slab shared with other
 * small ones of its version, not in a buffer of its own (server/store.c). */
#define WTX__STORE_SMALL 4096

/* Bytes of every buffer and slab the store holds: published, staged,
 * pooled. */
uint64_t wtx__store_allocated_bytes(wtx_store *s);

/* Bytes of free buffers the store keeps for the next update (its pool:
 * the version before last, once no reader holds it), not counting those
 * an update in progress has taken for its staging. */
uint64_t wtx__store_pooled_bytes(wtx_store *s);

/* The label target's weights are published under ("" before the first
 * publish), into out: without a reader's view, which the first
 * wtx_store_acquire of a version builds (a tensor at a time). */
void wtx__store_version(wtx_store *s, wtx_target target, char *out, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* WTX_SERVER_STORE_H */
