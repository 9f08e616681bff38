/* What the trainer engine knows of a source beyond the public wtx_source
 * API (include/wtx/source.h). Internal. */
#ifndef WTX_CLIENT_SOURCE_H
#define WTX_CLIENT_SOURCE_H

#include "wtx/source.h"

#ifdef __cplusplus
extern "C" {
#endif

/* 1 when every tensor a pass yields stays at the address it was yielded at,
 * unchanged, until the pass is closed (not only until the next call of
 * next): the built-in host sources (memory without device tensors,
 * safetensors, synthetic). The engine may then send a chunk straight from
 * them (wtx_trainer_transport.post_iov). 0 for any other source. */
int wtx__source_stays_put(const wtx_source *s);

#ifdef __cplusplus
}
#endif
#endif /* WTX_CLIENT_SOURCE_H */
