/* wtx_chunks_plan: the one place that cuts an update's stream into chunks
 * (docs/data-plane.md, "Chunks"). */
#include <stdlib.h>

#include "transport/transport.h"

int wtx_chunks_plan(const uint64_t *nbytes, size_t n, uint64_t buffer_size,
                    size_t max_params, int packed, wtx_chunk **out, size_t *n_out) {
  return wtx_chunks_plan_whole(nbytes, NULL, n, buffer_size, max_params, packed, out, n_out);
}

int wtx_chunks_plan_whole(const uint64_t *nbytes, const uint8_t *whole, size_t n,
                          uint64_t buffer_size, size_t max_params, int packed, wtx_chunk **out,
                          size_t *n_out) {
  *out = NULL;
  *n_out = 0;
  if (buffer_size == 0 || max_params == 0) return WTX_EINVAL;
  for (size_t i = 0; whole != NULL && i < n; i++)
    if (whole[i] && nbytes[i] > buffer_size) return WTX_EINVAL;
  size_t cap = 16, k = 0;
  wtx_chunk *c = malloc(cap * sizeof *c);
  if (c == NULL) return WTX_ENOMEM;
  size_t i = 0;
  uint64_t off = 0;    /* bytes of tensor i already planned */
  uint64_t stream = 0; /* bytes of the chunks already planned */
  while (i < n) {
    if (k == cap) {
      wtx_chunk *m = realloc(c, (cap *= 2) * sizeof *c);
      if (m == NULL) {
        free(c);
        return WTX_ENOMEM;
      }
      c = m;
    }
    wtx_chunk *ch = &c[k++];
    ch->first = i;
    ch->first_offset = off;
    ch->stream_offset = stream;
    ch->bytes = 0;
    for (;;) {
      uint64_t take = nbytes[i] - off;
      if (take > buffer_size - ch->bytes) take = buffer_size - ch->bytes;
      ch->bytes += take;
      off += take;
      ch->last = i;
      if (off < nbytes[i]) break; /* the buffer is full inside tensor i */
      i++;
      off = 0;
      /* Unpacked: each tensor ends its chunk. Packed: go on while there is
       * room (a zero-byte tensor fits in a full buffer). */
      if (i == n || !packed || i - ch->first == max_params) break;
      if (ch->bytes == buffer_size && nbytes[i] > 0) break;
      /* A tensor kept whole that the room left cannot hold starts the next. */
      if (whole != NULL && whole[i] && nbytes[i] > buffer_size - ch->bytes) break;
    }
    stream += ch->bytes;
  }
  *out = c;
  *n_out = k;
  return 0;
}
