/* libFuzzer target: the tcp backend's records as a worker or a rank reads
 * them from a peer (transport/tcp_frame.h): the hello, a frame header
 * against what UpdateWeights announced, the checksum trailer after a chunk
 * (its head against the chunk, then as many sums as the head says, within
 * what arrived), and the many-senders records (who, plan, diff, ring, go).
 * The first 24 bytes say what UpdateWeights announced; the 4 after them,
 * how many tensors the chunk holds; the rest is what the peer sent. */
#include <stdlib.h>
#include <string.h>

#include "transport/tcp_frame.h"

/* The trailer as tcp.c takes it: the head checked against chunk seq with
 * at most max sums, then the sums, read only when that many bytes came. */
static void trailer(const uint8_t *p, size_t n, uint64_t seq, uint32_t max) {
  if (n < WTX__TCP_TRAILER_HEAD_BYTES) return;
  uint32_t count = 0;
  char err[300];
  if (wtx__tcp_trailer_check(p, seq, max, &count, err, sizeof err) != 0) return;
  if (count > max) abort(); /* the check's promise */
  size_t body = n - WTX__TCP_TRAILER_HEAD_BYTES;
  if (body / 8 < count) return; /* a short read: the peer closed */
  uint64_t *sums = malloc((count ? count : 1) * sizeof *sums);
  if (sums == NULL) return;
  wtx__tcp_trailer_get_sums(p + WTX__TCP_TRAILER_HEAD_BYTES, sums, count);
  free(sums);
}

static void records(const uint8_t *p, size_t n) {
  uint64_t u64;
  uint32_t u32;
  if (n >= WTX__TCP_WHO_BYTES) wtx__tcp_who_decode(p, &u32, &u64);
  if (n >= WTX__TCP_PLAN_BYTES) wtx__tcp_plan_decode(p, &u64);
  if (n >= WTX__TCP_DIFF_BYTES) wtx__tcp_diff_decode(p, &u64, &u32);
  int region;
  if (n >= WTX__TCP_RING_BYTES) wtx__tcp_ring_decode(p, &u64, &u32, &region);
  if (n >= WTX__TCP_GO_BYTES) wtx__tcp_go_decode(p, &u64, &u32);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  uint8_t token[WTX__TCP_TOKEN_MAX] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
  if (size >= WTX__TCP_HELLO_BYTES) wtx__tcp_hello_check(data, token, 16);
  records(data, size);
  if (size < 28) return 0;
  wtx__tcp_frame want;
  memcpy(&want.seq, data, 8);
  memcpy(&want.first_offset, data + 8, 8);
  memcpy(&want.bytes, data + 16, 8);
  uint32_t tensors;
  memcpy(&tensors, data + 24, 4);
  tensors %= 16385; /* a chunk names at most WTX_MAX_CHUNK_PARAMS */
  const uint8_t *peer = data + 28;
  size_t n = size - 28;
  trailer(peer, n, want.seq, tensors);
  if (n < WTX__TCP_FRAME_BYTES) return 0;
  char err[300];
  wtx__tcp_frame_check(peer, &want, err, sizeof err);
  trailer(peer + WTX__TCP_FRAME_BYTES, n - WTX__TCP_FRAME_BYTES, want.seq, tensors);
  return 0;
}
