// common/copy: wtx__copy_stream and wtx__copy_hash.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

extern "C" {
#include "common/copy.h"
#include "wtx/error.h"
}

// wtx__copy_stream: the same bytes as memcpy at every alignment and length
// around the 64-byte lines it stores whole, and nothing outside [dst, +n).

TEST(CopyStream, SameBytesAsMemcpyAtEveryAlignmentAndLength) {
  std::vector<uint8_t> src(4096 + 128), dst(4096 + 256);
  for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 131 + 7);
  const size_t lens[] = {0, 1, 15, 63, 64, 65, 127, 128, 129, 1000, 4096};
  for (size_t n : lens)
    for (size_t so = 0; so < 64; so += 7)
      for (size_t dofs = 0; dofs < 64; dofs += 5) {
        std::fill(dst.begin(), dst.end(), 0xEE);
        uint8_t *d = dst.data() + 64 + dofs;
        wtx__copy_stream(d, src.data() + so, n);
        ASSERT_EQ(0, memcmp(d, src.data() + so, n)) << n << " " << so << " " << dofs;
        for (uint8_t *p = dst.data(); p < d; p++) ASSERT_EQ(0xEE, *p) << "before, n " << n;
        for (uint8_t *p = d + n; p < dst.data() + dst.size(); p++)
          ASSERT_EQ(0xEE, *p) << "after, n " << n;
      }
}

// wtx__copy_hash, with every kernel this CPU has: the same bytes as memcpy
// and nothing outside [dst, +n), and the state ends as XXH3_64bits_update
// of the same bytes leaves it, whatever the pieces the input arrives in
// (across XXH3's 256-byte buffer and 1024-byte blocks), their alignments,
// and whether the stores stream.
namespace {

struct Rng {
  uint64_t s;
  uint64_t next() {
    s ^= s << 13, s ^= s >> 7, s ^= s << 17;
    return s;
  }
  size_t below(size_t n) { return static_cast<size_t>(next() % n); }
};

class CopyHash : public ::testing::TestWithParam<const char *> {
 protected:
  void SetUp() override {
    before_ = wtx__copy_hash_isa();
    int rc = wtx__copy_hash_use(GetParam());
    if (rc == WTX_ENOTSUP) GTEST_SKIP() << GetParam() << ": this CPU (or build) lacks it";
    ASSERT_EQ(0, rc);
  }
  void TearDown() override { ASSERT_EQ(0, wtx__copy_hash_use(before_)); }
  const char *before_ = nullptr;
};

TEST_P(CopyHash, SameBytesAndDigestAsCopyThenHashInAnyPieces) {
  Rng rng{0x9E3779B97F4A7C15ull};
  std::vector<uint8_t> src(300000 + 64), dst(300000 + 256);
  for (auto &b : src) b = static_cast<uint8_t>(rng.next());
  XXH3_state_t *h = XXH3_createState();
  ASSERT_NE(nullptr, h);
  const size_t totals[] = {0, 1, 63, 64, 65, 255, 256, 257, 1023, 1024, 1025, 4096, 70001, 300000};
  for (size_t total : totals)
    for (int trial = 0; trial < 12; trial++) {
      size_t so = rng.below(64), dofs = rng.below(64);
      int stream = trial % 2;
      std::fill(dst.begin(), dst.end(), 0xEE);
      uint8_t *d = dst.data() + 64 + dofs;
      const uint8_t *s = src.data() + so;
      XXH3_64bits_reset(h);
      std::string pieces;
      for (size_t o = 0; o < total;) {
        // small, around the buffer and block sizes, or all that is left
        const size_t sizes[] = {1, 17, 64, 200, 256, 300, 1024, 5000, 65536, total};
        size_t k = std::min(total - o, sizes[rng.below(sizeof sizes / sizeof sizes[0])]);
        wtx__copy_hash(d + o, s + o, k, h, stream);
        pieces += std::to_string(k) + " ";
        o += k;
      }
      SCOPED_TRACE("total " + std::to_string(total) + " src+" + std::to_string(so) + " dst+" +
                   std::to_string(dofs) + " stream " + std::to_string(stream) + " pieces " + pieces);
      ASSERT_EQ(XXH3_64bits(s, total), XXH3_64bits_digest(h));
      ASSERT_EQ(0, memcmp(d, s, total));
      for (uint8_t *p = dst.data(); p < d; p++) ASSERT_EQ(0xEE, *p) << "before dst";
      for (uint8_t *p = d + total; p < dst.data() + dst.size(); p++) ASSERT_EQ(0xEE, *p) << "after";
    }
  XXH3_freeState(h);
}

// The kernels keep the call in progress in a thread-local context: threads
// copying and hashing at once (a trainer's packing thread and its workers'
// receives, in one process under test) each get their own bytes and digest.
TEST_P(CopyHash, ThreadsAtOnceEachGetTheirOwnBytesAndDigest) {
  const size_t n = 1 << 20, kThreads = 4;
  std::vector<std::vector<uint8_t>> src(kThreads), dst(kThreads);
  std::vector<uint64_t> got(kThreads), want(kThreads);
  for (size_t t = 0; t < kThreads; t++) {
    Rng rng{t + 1};
    src[t].resize(n);
    for (auto &b : src[t]) b = static_cast<uint8_t>(rng.next());
    dst[t].assign(n + 64, 0);
    want[t] = XXH3_64bits(src[t].data() + t, n - 64);
  }
  std::vector<std::thread> threads;
  for (size_t t = 0; t < kThreads; t++)
    threads.emplace_back([&, t] {
      XXH3_state_t *h = XXH3_createState();
      for (int round = 0; round < 8; round++) {
        XXH3_64bits_reset(h);
        Rng rng{t * 100 + round};
        for (size_t o = 0; o < n - 64;) {
          size_t k = std::min(n - 64 - o, 1 + rng.below(40000));
          wtx__copy_hash(dst[t].data() + 3 * t + o, src[t].data() + t + o, k, h, round % 2);
          o += k;
        }
        got[t] = XXH3_64bits_digest(h);
        if (got[t] != want[t]) break;
      }
      XXH3_freeState(h);
    });
  for (auto &th : threads) th.join();
  for (size_t t = 0; t < kThreads; t++) {
    EXPECT_EQ(want[t], got[t]) << "thread " << t;
    EXPECT_EQ(0, memcmp(dst[t].data() + 3 * t, src[t].data() + t, n - 64)) << "thread " << t;
  }
}

INSTANTIATE_TEST_SUITE_P(Kernels, CopyHash, ::testing::Values("avx512", "avx2", "portable"));

}  // namespace

// Without a state no kernel runs: it copies, streaming or not.
TEST(CopyHashWithoutState, ItOnlyCopies) {
  std::vector<uint8_t> src(5000), dst(5000, 0);
  for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 7 + 1);
  for (int stream = 0; stream < 2; stream++) {
    std::fill(dst.begin(), dst.end(), 0);
    wtx__copy_hash(dst.data() + 3, src.data() + 1, 4000, nullptr, stream);
    EXPECT_EQ(0, memcmp(dst.data() + 3, src.data() + 1, 4000)) << stream;
    EXPECT_EQ(0, dst[2]);
    EXPECT_EQ(0, dst[4003]);
  }
}

TEST(CopyHashUse, RefusesAnUnknownKernelAndKeepsTheOne) {
  const char *before = wtx__copy_hash_isa();
  EXPECT_EQ(WTX_EINVAL, wtx__copy_hash_use("sse9"));
  EXPECT_STREQ(before, wtx__copy_hash_isa());
}
