/* What the trainer engine knows of a source beyond the public wtx_source
 * API (include/wtx/source.h). Internal. */
#ifndef WTX_CLIENT_SOURCE_H
#define WTX_CLIENT_SOURCE_H

#include "wtx/source.h"

#ifdef __cplusplus
extern "C" {
#endif

/* wtx_source_next, and whether the tensor's bytes stay where *data says,
 * unchanged, until the pass is closed (the source's next said 2): the
 * engine may then send them in place (wtx_trainer_transport.post_iov).
 * *stays is 0 otherwise. */
int wtx__source_next(wtx_source *s, void *iter, wtx_tensor_meta *meta,
                     const uint8_t **data, int *stays);

#ifdef __cplusplus
}
#endif
#endif /* WTX_CLIENT_SOURCE_H */
