/* The receive assembler, as the session drives it: one wtx_rx per session;
 * per chunk the session names the chunk's tensors and where their bytes go
 * (begin), lends the assembler to the backend's receive (which feeds it with
 * the wtx_rx_* calls of transport.h), then ends the chunk, which checks that
 * every byte arrived and every checksum matched. Bytes are hashed while they
 * are copied, never in a second pass. Backends never include this header. */
#ifndef WTX_TRANSPORT_RX_H
#define WTX_TRANSPORT_RX_H

#include "transport/transport.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Where one tensor of the update goes. The session fills it from the
 * validated ParamMeta; dst is the model's staging memory: host memory, or
 * device memory on the backend's GPU when the chunk begins with
 * WTX__RX_DEVICE. */
typedef struct wtx_rx_tensor {
  const char *name;
  uint64_t nbytes;
  uint8_t *dst;
} wtx_rx_tensor;

/* One assembler per session; *out is the caller's until destroy. */
int wtx__rx_create(wtx_rx **out);
void wtx__rx_destroy(wtx_rx *rx);
/* How a chunk is received (wtx__rx_begin's flags). */
enum {
  WTX__RX_VERIFY = 1, /* checksums are expected and checked */
  WTX__RX_DEVICE = 2, /* every dst is device memory (wtx_rx_on_device) */
  /* A dst may hold only this chunk's bytes of its tensor (the session's
   * host copies of device staging): no whole checksum is read back from
   * it, as from device memory. */
  WTX__RX_UNREAD = 4,
};

/* The stream offset the next chunk begins at (the bytes of this update's
 * chunks so far): where a direct receive puts it, so where its tensors
 * are staged in place. */
uint64_t wtx__rx_next_stream_offset(const wtx_rx *rx);

/* Starts a chunk over tensors (the chunk's, in stream order; their dst must
 * stay valid until the chunk ends), first_offset bytes into tensors[0], of
 * chunk_bytes (0: to the end of the last tensor), which
 * must end inside or at the end of tensors[n-1]. flags: WTX__RX_*. A
 * non-zero first_offset must continue the tensor the previous chunk left
 * incomplete, at the byte it stopped (else WTX_EPROTO); a zero one requires
 * that no tensor was left incomplete. */
int wtx__rx_begin(wtx_rx *rx, const wtx_rx_tensor *tensors, size_t n,
                  uint64_t first_offset, uint64_t chunk_bytes, int flags);
/* The sender's checksums of the tensors that end in this chunk, in order
 * (after begin; borrowed until end). */
int wtx__rx_expect_checksums(wtx_rx *rx, const uint64_t *xxh3, size_t n);
/* Forgets any tensor left incomplete (abort, new update). */
void wtx__rx_reset(wtx_rx *rx);
/* Whether a tensor is left incomplete, and which. */
const char *wtx__rx_incomplete(const wtx_rx *rx, uint64_t *have,
                               uint64_t *want);
/* Whether the completed tensors' checksums (wtx__rx_checksums) are
 * their whole XXH3: the chunk verifies, and its sums are not span sums
 * over device staging, which is not read back. */
int wtx__rx_whole_sums(const wtx_rx *rx);
/* Ends the chunk: checks every expected byte arrived and every checksum
 * matched (WTX_ECHECKSUM names the tensor). */
int wtx__rx_end(wtx_rx *rx);
/* Detail of the last error (empty when none). */
const char *wtx__rx_error(const wtx_rx *rx);
/* Tensors completed (all bytes in) by this chunk so far. */
size_t wtx__rx_completed(const wtx_rx *rx);
/* Checksum of a completed tensor: index into the chunk's tensors. */
uint64_t wtx__rx_checksum(const wtx_rx *rx, size_t i);
/* The checksums of the chunk's completed tensors, in order: valid until
 * the next wtx__rx_begin. */
const uint64_t *wtx__rx_checksums(const wtx_rx *rx);

#ifdef __cplusplus
}
#endif
#endif /* WTX_TRANSPORT_RX_H */
