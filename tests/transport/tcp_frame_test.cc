// The tcp backend's wire records: the hello that admits a peer to the chain,
// the frame header before each chunk and the checksum trailer after it,
// each bad field refused by name.
#include "transport/tcp_frame.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "wtx/error.h"

namespace {

const uint8_t kToken[32] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16,
                            17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32};

TEST(TcpHello, OnlyTheSessionsTokenIsAdmitted) {
  uint8_t h[WTX__TCP_HELLO_BYTES];
  wtx__tcp_hello_encode(h, kToken, sizeof kToken);
  EXPECT_EQ(0, memcmp(h, "WTXH", 4));
  EXPECT_EQ(0, wtx__tcp_hello_check(h, kToken, sizeof kToken));

  uint8_t other[32];
  memcpy(other, kToken, sizeof other);
  other[31] ^= 1;
  EXPECT_EQ(WTX_EAUTH, wtx__tcp_hello_check(h, other, sizeof other));  // one bit off
  EXPECT_EQ(WTX_EAUTH, wtx__tcp_hello_check(h, kToken, 16));           // a prefix
  uint8_t bad[WTX__TCP_HELLO_BYTES];
  memcpy(bad, h, sizeof bad);
  bad[0] = 'G';  // "GET / HTTP..." from a stray client
  EXPECT_EQ(WTX_EAUTH, wtx__tcp_hello_check(bad, kToken, sizeof kToken));
  memcpy(bad, h, sizeof bad);
  bad[4] = 2;  // another version
  EXPECT_EQ(WTX_EAUTH, wtx__tcp_hello_check(bad, kToken, sizeof kToken));
}

TEST(TcpFrame, AHeaderRoundTrips) {
  uint8_t f[WTX__TCP_FRAME_BYTES];
  wtx__tcp_frame fr = {7, 123456789012ull, 64ull << 20};
  wtx__tcp_frame_encode(f, &fr);
  char err[256] = "";
  EXPECT_EQ(0, wtx__tcp_frame_check(f, &fr, err, sizeof err)) << err;
  EXPECT_EQ(0, memcmp(f, "WTXC", 4));
  EXPECT_EQ(7, f[8]);  // little-endian sequence
}

TEST(TcpFrame, EachBadFieldIsNamedWithBothValues) {
  wtx__tcp_frame want = {3, 100, 4096};
  struct Case {
    int byte;       // flipped byte of an otherwise matching header
    const char *msg;
  } cases[] = {
      {0, "frame header: no 'WTXC' magic (the stream is out of step)"},
      {4, "frame header: version 0, this worker speaks 1"},
      {8, "frame header: chunk 2, UpdateWeights announced 3"},
      {16, "frame header: first_param_offset 101, UpdateWeights announced 100"},
      {25, "frame header: chunk_bytes 4352, UpdateWeights announced 4096"},
  };
  for (const Case &c : cases) {
    uint8_t f[WTX__TCP_FRAME_BYTES];
    wtx__tcp_frame_encode(f, &want);
    f[c.byte] ^= 1;
    char err[256] = "";
    EXPECT_EQ(WTX_EPROTO, wtx__tcp_frame_check(f, &want, err, sizeof err)) << c.byte;
    EXPECT_STREQ(c.msg, err) << c.byte;
  }
}

TEST(TcpFrame, ATrailerRoundTripsAndItsBadFieldsAreNamed) {
  const uint64_t sums[3] = {0x0123456789abcdefull, 0, ~0ull};
  std::vector<uint8_t> t(WTX__TCP_TRAILER_HEAD_BYTES + sizeof sums);
  wtx__tcp_trailer_encode(t.data(), 5, 3);
  wtx__tcp_trailer_put_sums(t.data() + WTX__TCP_TRAILER_HEAD_BYTES, sums, 3);
  EXPECT_EQ(0, memcmp(t.data(), "WTXS", 4));
  EXPECT_EQ(0xef, t[WTX__TCP_TRAILER_HEAD_BYTES]);  // little-endian values
  uint32_t count = 0;
  char err[256] = "";
  ASSERT_EQ(0, wtx__tcp_trailer_check(t.data(), 5, 65537, &count, err, sizeof err)) << err;
  ASSERT_EQ(3u, count);
  uint64_t back[3];
  wtx__tcp_trailer_get_sums(t.data() + WTX__TCP_TRAILER_HEAD_BYTES, back, 3);
  EXPECT_EQ(0, memcmp(back, sums, sizeof sums));
  EXPECT_EQ(WTX_EPROTO, wtx__tcp_trailer_check(t.data(), 6, 65537, &count, err, sizeof err));
  EXPECT_STREQ("checksum trailer: chunk 5, expected 6", err);
  EXPECT_EQ(WTX_EPROTO, wtx__tcp_trailer_check(t.data(), 5, 2, &count, err, sizeof err));
  EXPECT_STREQ("checksum trailer: 3 checksums, at most 2", err);
  t[0] = 'X';  // a frame header or bytes where the trailer belongs
  EXPECT_EQ(WTX_EPROTO, wtx__tcp_trailer_check(t.data(), 5, 65537, &count, err, sizeof err));
  EXPECT_STREQ("checksum trailer: no 'WTXS' magic (the stream is out of step)", err);
}

TEST(TcpFrame, ADiffRecordRoundTripsAndItsTextIsBounded) {
  uint8_t d[WTX__TCP_DIFF_BYTES];
  wtx__tcp_diff_encode(d, 70000, 41);
  EXPECT_EQ(0, memcmp(d, "WTXD", 4));
  uint64_t index = 0;
  uint32_t len = 0;
  ASSERT_EQ(0, wtx__tcp_diff_decode(d, &index, &len));
  EXPECT_EQ(70000u, index);
  EXPECT_EQ(41u, len);
  wtx__tcp_diff_encode(d, UINT64_MAX, WTX__TCP_DIFF_TEXT_MAX + 1);  // a peer asking too much
  EXPECT_EQ(WTX_EPROTO, wtx__tcp_diff_decode(d, &index, &len));
  wtx__tcp_plan_encode(d, 7);  // another record where the diff belongs
  EXPECT_EQ(WTX_EPROTO, wtx__tcp_diff_decode(d, &index, &len));
}

// What a worker on the sender's host offers to be written into instead of
// the socket: a ring ("WTXR"), or its receive region ("WTXM"); the sender
// learns which from the record, and its name's length is bounded.
TEST(TcpFrame, ARingOrRegionRecordRoundTripsAndSaysWhichItIs) {
  uint8_t r[WTX__TCP_RING_BYTES];
  uint64_t cap = 0;
  uint32_t len = 0;
  int region = -1;
  wtx__tcp_ring_encode(r, 1 << 20, 40, 0);
  EXPECT_EQ(0, memcmp(r, "WTXR", 4));
  ASSERT_EQ(0, wtx__tcp_ring_decode(r, &cap, &len, &region));
  EXPECT_EQ(0, region);
  EXPECT_EQ(1u << 20, cap);
  EXPECT_EQ(40u, len);
  wtx__tcp_ring_encode(r, 5000000000ull, 41, 1);
  EXPECT_EQ(0, memcmp(r, "WTXM", 4));
  ASSERT_EQ(0, wtx__tcp_ring_decode(r, &cap, &len, &region));
  EXPECT_EQ(1, region);
  EXPECT_EQ(5000000000ull, cap);
  EXPECT_EQ(41u, len);
  for (uint32_t bad : {0u, 256u}) {  // no name, or one longer than a shm name may be
    wtx__tcp_ring_encode(r, 1, bad, 1);
    EXPECT_EQ(WTX_EPROTO, wtx__tcp_ring_decode(r, &cap, &len, &region)) << bad;
  }
  wtx__tcp_plan_encode(r, 7);  // another record where the ring belongs
  EXPECT_EQ(WTX_EPROTO, wtx__tcp_ring_decode(r, &cap, &len, &region));
}

TEST(TcpFrame, ADeltaRecordRoundTripsOnlyAsItsKindAndItsPayloadIsBounded) {
  uint8_t d[WTX__TCP_DELTA_BYTES];
  wtx__tcp_delta_encode(d, WTX__TCP_DELTA_ANSWER, 5000);
  EXPECT_EQ(0, memcmp(d, "WTXX", 4));
  uint64_t len = 0;
  ASSERT_EQ(0, wtx__tcp_delta_decode(d, WTX__TCP_DELTA_ANSWER, &len));
  EXPECT_EQ(5000u, len);
  EXPECT_EQ(WTX_EPROTO, wtx__tcp_delta_decode(d, WTX__TCP_DELTA_DECISION, &len));
  wtx__tcp_delta_encode(d, WTX__TCP_DELTA_ASK, WTX__TCP_DELTA_PAYLOAD_MAX + 1);
  EXPECT_EQ(WTX_EPROTO, wtx__tcp_delta_decode(d, WTX__TCP_DELTA_ASK, &len));
  wtx__tcp_diff_encode(d, 1, 1);  // another record where the exchange's belongs
  EXPECT_EQ(WTX_EPROTO, wtx__tcp_delta_decode(d, WTX__TCP_DELTA_ASK, &len));
}

// A patch offered or decided: the piece, its element count and its hash
// once applied, little-endian; a record with its zero bytes set, or of no
// element, is not one.
TEST(TcpFrame, APatchRecordRoundTripsAndNamesAtLeastOneElement) {
  uint8_t r[WTX__TCP_PATCH_BYTES];
  wtx__tcp_patch_encode(r, 70000, (uint64_t)1 << 40, 0x0123456789abcdefull);
  EXPECT_EQ(0x70, r[0]);  // 70000 = 0x11170
  EXPECT_EQ(0x01, r[2]);
  uint32_t piece = 0;
  uint64_t count = 0, sum = 0;
  ASSERT_EQ(0, wtx__tcp_patch_decode(r, &piece, &count, &sum));
  EXPECT_EQ(70000u, piece);
  EXPECT_EQ((uint64_t)1 << 40, count);
  EXPECT_EQ(0x0123456789abcdefull, sum);
  r[5] = 1;
  EXPECT_EQ(WTX_EPROTO, wtx__tcp_patch_decode(r, &piece, &count, &sum));
  wtx__tcp_patch_encode(r, 3, 0, 1);
  EXPECT_EQ(WTX_EPROTO, wtx__tcp_patch_decode(r, &piece, &count, &sum));
}

// Rank 0's ask: its flags, this sync's number and the last that landed,
// little-endian; a sync numbered 0, one that landed no earlier than the
// sync asking, or a zero byte set, is no ask.
TEST(TcpFrame, AnAskRoundTripsAndNamesAnEarlierSyncAsLanded) {
  uint8_t r[WTX__TCP_ASK_BYTES];
  wtx__tcp_ask_encode(r, 2, (uint64_t)1 << 33, 7);
  uint8_t flags = 0;
  uint64_t seq = 0, landed = 0;
  ASSERT_EQ(0, wtx__tcp_ask_decode(r, &flags, &seq, &landed));
  EXPECT_EQ(2, flags);
  EXPECT_EQ((uint64_t)1 << 33, seq);
  EXPECT_EQ(7u, landed);
  EXPECT_EQ(7, r[16]);
  r[3] = 1;
  EXPECT_EQ(WTX_EPROTO, wtx__tcp_ask_decode(r, &flags, &seq, &landed));
  wtx__tcp_ask_encode(r, 0, 7, 7);
  EXPECT_EQ(WTX_EPROTO, wtx__tcp_ask_decode(r, &flags, &seq, &landed));
  wtx__tcp_ask_encode(r, 0, 0, 0);
  EXPECT_EQ(WTX_EPROTO, wtx__tcp_ask_decode(r, &flags, &seq, &landed));
  wtx__tcp_ask_encode(r, 0, 1, 0);
  EXPECT_EQ(0, wtx__tcp_ask_decode(r, &flags, &seq, &landed));
}

}  // namespace
