/* libFuzzer target: the tcp backend's hello and frame header, as a worker
 * reads them from a peer (transport/tcp_frame.h). The first 24 bytes say
 * what UpdateWeights announced; the rest is what the peer sent. */
#include <string.h>

#include "transport/tcp_frame.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  uint8_t token[WTX__TCP_TOKEN_MAX] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  if (size >= WTX__TCP_HELLO_BYTES) wtx__tcp_hello_check(data, token, 16);
  if (size < 24 + WTX__TCP_FRAME_BYTES) return 0;
  wtx__tcp_frame want;
  memcpy(&want.seq, data, 8);
  memcpy(&want.first_offset, data + 8, 8);
  memcpy(&want.bytes, data + 16, 8);
  char err[300];
  wtx__tcp_frame_check(data + 24, &want, err, sizeof err);
  return 0;
}
