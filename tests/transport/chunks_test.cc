// wtx_chunks_plan: the one cut of an update's stream that trainer and worker
// both rely on (docs/data-plane.md, "Chunks").
#include <gtest/gtest.h>

#include <cstdlib>
#include <numeric>
#include <vector>

#include "transport/transport.h"

namespace {

std::vector<wtx_chunk> Plan(const std::vector<uint64_t> &sizes, uint64_t buf, bool packed,
                            size_t max_params = WTX_MAX_CHUNK_PARAMS) {
  wtx_chunk *c = nullptr;
  size_t n = 0;
  EXPECT_EQ(0, wtx_chunks_plan(sizes.data(), sizes.size(), buf, max_params, packed, &c, &n));
  std::vector<wtx_chunk> out(c, c + n);
  free(c);
  return out;
}

// Walks the chunks as a receiver would: every byte of every tensor exactly
// once, in order, each chunk at most buf bytes and never empty unless it
// holds only zero-byte tensors, each starting where the ones before it end
// in the stream, and touching at most max_params tensors.
void ExpectCovers(const std::vector<uint64_t> &sizes, uint64_t buf,
                  const std::vector<wtx_chunk> &chunks,
                  size_t max_params = WTX_MAX_CHUNK_PARAMS) {
  size_t i = 0;
  uint64_t off = 0, stream = 0;
  for (const wtx_chunk &c : chunks) {
    ASSERT_EQ(i, c.first);
    ASSERT_EQ(off, c.first_offset);
    ASSERT_EQ(stream, c.stream_offset);
    stream += c.bytes;
    ASSERT_LE(c.bytes, buf);
    ASSERT_LE(c.last - c.first + 1, max_params);
    uint64_t left = c.bytes;
    for (size_t t = c.first; t <= c.last; t++) {
      uint64_t take = std::min(sizes[t] - off, left);
      left -= take;
      off += take;
      if (off == sizes[t]) {
        i = t + 1;
        off = 0;
      } else {
        ASSERT_EQ(t, c.last) << "only the last tensor of a chunk may be cut";
      }
    }
    ASSERT_EQ(0u, left);
  }
  EXPECT_EQ(sizes.size(), i);
  EXPECT_EQ(0u, off);
}

TEST(Chunks, PackedFillsBuffersAndSplitsTensorsAcrossThem) {
  std::vector<uint64_t> sizes = {100, 300, 50, 1000, 7};
  auto c = Plan(sizes, 256, true);
  ExpectCovers(sizes, 256, c);
  uint64_t total = std::accumulate(sizes.begin(), sizes.end(), uint64_t{0});
  ASSERT_EQ((total + 255) / 256, c.size());  // every buffer full but the last
  for (size_t k = 0; k + 1 < c.size(); k++) EXPECT_EQ(256u, c[k].bytes);
  EXPECT_EQ(0u, c[0].first);
  EXPECT_EQ(1u, c[0].last);           // 100 + 156 of the 300
  EXPECT_EQ(156u, c[1].first_offset);  // the 300 continues
}

TEST(Chunks, UnpackedStartsEveryTensorInAChunkOfItsOwn) {
  std::vector<uint64_t> sizes = {100, 300, 50};
  auto c = Plan(sizes, 256, false);
  ExpectCovers(sizes, 256, c);
  ASSERT_EQ(4u, c.size());
  EXPECT_EQ(100u, c[0].bytes);
  EXPECT_EQ(256u, c[1].bytes);
  EXPECT_EQ(44u, c[2].bytes);
  EXPECT_EQ(256u, c[2].first_offset);
  EXPECT_EQ(50u, c[3].bytes);
}

TEST(Chunks, ZeroByteTensorsRideAlongOrStandAlone) {
  std::vector<uint64_t> sizes = {0, 256, 0, 0, 10, 0};
  auto c = Plan(sizes, 256, true);
  ExpectCovers(sizes, 256, c);
  EXPECT_EQ(2u, c.size());
  auto u = Plan({0, 0}, 256, false);
  ASSERT_EQ(2u, u.size());
  EXPECT_EQ(0u, u[0].bytes);
}

TEST(Chunks, ManyShapesAndBufferSizesCoverEveryByte) {
  srand(7);
  for (int round = 0; round < 200; round++) {
    std::vector<uint64_t> sizes(1 + rand() % 40);
    for (auto &s : sizes) s = rand() % 5 == 0 ? 0 : (uint64_t)(rand() % 5000);
    uint64_t buf = 1 + rand() % 3000;
    size_t max_params = 1 + rand() % 8;
    for (bool packed : {true, false}) {
      ExpectCovers(sizes, buf, Plan(sizes, buf, packed));
      ExpectCovers(sizes, buf, Plan(sizes, buf, packed, max_params), max_params);
    }
  }
}

// A delta's patches are kept whole: each lies within one chunk, the rest
// of the plan as before (every byte once, in order, within the limits).
TEST(Chunks, TensorsKeptWholeLieWithinOneChunk) {
  srand(11);
  for (int round = 0; round < 300; round++) {
    uint64_t buf = 16 + rand() % 3000;
    std::vector<uint64_t> sizes(1 + rand() % 40);
    std::vector<uint8_t> whole(sizes.size());
    for (size_t i = 0; i < sizes.size(); i++) {
      whole[i] = rand() % 2;
      sizes[i] = whole[i] ? (uint64_t)(rand() % (buf + 1)) : (uint64_t)(rand() % 5000);
    }
    size_t max_params = 1 + rand() % 8;
    wtx_chunk *c = nullptr;
    size_t n = 0;
    ASSERT_EQ(0, wtx_chunks_plan_whole(sizes.data(), whole.data(), sizes.size(), buf,
                                       max_params, 1, &c, &n));
    std::vector<wtx_chunk> chunks(c, c + n);
    free(c);
    ExpectCovers(sizes, buf, chunks, max_params);
    for (const wtx_chunk &k : chunks) {
      EXPECT_FALSE(whole[k.first] && k.first_offset > 0) << "round " << round;
      uint64_t end = 0;  // where tensor last ends, from the chunk's start
      for (size_t t = k.first; t <= k.last; t++) end += sizes[t] - (t == k.first ? k.first_offset : 0);
      EXPECT_FALSE(whole[k.last] && end > k.bytes) << "round " << round << ": cut";
    }
  }
  // One kept whole but larger than a buffer cannot be planned.
  std::vector<uint64_t> big = {10, 300};
  std::vector<uint8_t> w = {0, 1};
  wtx_chunk *c = nullptr;
  size_t n = 0;
  EXPECT_EQ(WTX_EINVAL, wtx_chunks_plan_whole(big.data(), w.data(), 2, 256, 8, 1, &c, &n));
}

// 100k tiny tensors fit one buffer; the protocol takes at most
// WTX_MAX_CHUNK_PARAMS per chunk, and a cap cuts them by count.
TEST(Chunks, TinyTensorsAreCutByCountWhereBytesWouldNot) {
  std::vector<uint64_t> sizes(100000, 16);
  auto c = Plan(sizes, UINT64_C(64) << 20, true, 8192);
  ExpectCovers(sizes, UINT64_C(64) << 20, c, 8192);
  ASSERT_EQ(13u, c.size());  // 12 x 8192 + 1696
  for (size_t k = 0; k + 1 < c.size(); k++) EXPECT_EQ(8192u * 16, c[k].bytes);
  EXPECT_EQ(1696u * 16, c.back().bytes);
  // A tensor cut across chunks by bytes counts in both.
  auto d = Plan({10, 10, 10}, 15, true, 2);
  ExpectCovers({10, 10, 10}, 15, d, 2);
  ASSERT_EQ(2u, d.size());
  EXPECT_EQ(1u, d[1].first);
  EXPECT_EQ(5u, d[1].first_offset);
}

TEST(Chunks, AZeroBufferOrCountIsRefused) {
  uint64_t s = 1;
  wtx_chunk *c = nullptr;
  size_t n = 0;
  EXPECT_EQ(WTX_EINVAL, wtx_chunks_plan(&s, 1, 0, 1, 1, &c, &n));
  EXPECT_EQ(WTX_EINVAL, wtx_chunks_plan(&s, 1, 1, 0, 1, &c, &n));
}

}  // namespace
