/* What the trainer engine knows of a source beyond the public wtx_source
 * API (include/wtx/source.h). Internal. */
#ifndef WTX_CLIENT_SOURCE_H
#define WTX_CLIENT_SOURCE_H

#include "wtx/source.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where next's tensor is. */
typedef struct wtx__tensor_data {
  const uint8_t *host; /* its bytes in host memory; NULL when not copied */
  const void *device;  /* device memory holding them; NULL: a host tensor */
  int stays;           /* host stays where it is, unchanged, until the pass
                          is closed (the source's next said 2) */
} wtx__tensor_data;

/* wtx_source_next for the engine: where the tensor is. A device tensor
 * (next said 3: the memory source's, or an implementation's) has device
 * set, and host a copy (one buffer per source, reused) when host_copy is
 * 1, else NULL. A host tensor: host set, device NULL. */
int wtx__source_next(wtx_source *s, void *iter, int host_copy, wtx_tensor_meta *meta,
                     wtx__tensor_data *out);

#ifdef __cplusplus
}
#endif
#endif /* WTX_CLIENT_SOURCE_H */
