// The receive assembler: a chunk's bytes cut into tensors in stream order,
// tensors split across chunks, the XXH3 of each tensor computed as its bytes
// are copied, and every way a chunk can disagree with its UpdateInfo.
#include "transport/rx.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

class RxTest : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(0, wtx__rx_create(&rx_)); }
  void TearDown() override { wtx__rx_destroy(rx_); }

  // Bytes 0, 1, 2, ... of a stream.
  static std::vector<uint8_t> Stream(size_t n) {
    std::vector<uint8_t> s(n);
    for (size_t i = 0; i < n; i++) s[i] = static_cast<uint8_t>(i * 7 + 3);
    return s;
  }
  wtx_rx *rx_ = nullptr;
};

TEST_F(RxTest, ATensorSplitAcrossChunksArrivesWholeWithTheSendersChecksum) {
  // Tensors a (10 bytes), b (25), c (5) in chunks of 16, 16 and 8 bytes:
  // a + 6 bytes of b | 16 more of b | the last 3 of b + c.
  std::vector<uint8_t> a(10), b(25), c(5);
  std::vector<uint8_t> s = Stream(40);
  wtx_rx_tensor t[3] = {{"a", 10, a.data()}, {"b", 25, b.data()}, {"c", 5, c.data()}};
  uint64_t sum_a = XXH3_64bits(s.data(), 10), sum_b = XXH3_64bits(s.data() + 10, 25),
           sum_c = XXH3_64bits(s.data() + 35, 5);

  ASSERT_EQ(0, wtx__rx_begin(rx_, t, 2, 0, 16, 1)) << wtx__rx_error(rx_);
  wtx__rx_expect_checksums(rx_, &sum_a, 1);
  EXPECT_EQ(16u, wtx_rx_remaining(rx_));
  ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data(), 16));
  ASSERT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_);
  EXPECT_EQ(1u, wtx__rx_completed(rx_));
  EXPECT_EQ(sum_a, wtx__rx_checksum(rx_, 0));
  uint64_t have = 0, want = 0;
  EXPECT_STREQ("b", wtx__rx_incomplete(rx_, &have, &want));
  EXPECT_EQ(6u, have);
  EXPECT_EQ(25u, want);

  // The middle chunk only continues b: no tensor completes.
  ASSERT_EQ(0, wtx__rx_begin(rx_, &t[1], 1, 6, 16, 1)) << wtx__rx_error(rx_);
  wtx__rx_expect_checksums(rx_, nullptr, 0);
  // Received in place, in two pieces, as a socket backend does.
  uint8_t *dst = nullptr;
  size_t room = wtx_rx_next(rx_, &dst);
  ASSERT_EQ(16u, room);
  EXPECT_EQ(b.data() + 6, dst);
  memcpy(dst, s.data() + 16, 9);
  ASSERT_EQ(0, wtx_rx_commit(rx_, 9));
  ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data() + 25, 7));
  ASSERT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_);
  EXPECT_EQ(0u, wtx__rx_completed(rx_));

  ASSERT_EQ(0, wtx__rx_begin(rx_, &t[1], 2, 22, 0, 1)) << wtx__rx_error(rx_);
  uint64_t sums[2] = {sum_b, sum_c};
  wtx__rx_expect_checksums(rx_, sums, 2);
  EXPECT_EQ(8u, wtx_rx_remaining(rx_));  // 0: to the end of the last tensor
  ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data() + 32, 8));
  ASSERT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_);
  EXPECT_EQ(sum_b, wtx__rx_checksum(rx_, 0));
  EXPECT_EQ(sum_c, wtx__rx_checksum(rx_, 1));
  EXPECT_EQ(nullptr, wtx__rx_incomplete(rx_, &have, &want));
  EXPECT_EQ(0, memcmp(a.data(), s.data(), 10));
  EXPECT_EQ(0, memcmp(b.data(), s.data() + 10, 25));
  EXPECT_EQ(0, memcmp(c.data(), s.data() + 35, 5));
}

// Property: however a stream of tensors of any sizes (zero, tiny, large)
// is cut into chunks and each chunk into pieces, given to wtx_rx_bytes or
// received in place (wtx_rx_next + wtx_rx_commit), every tensor ends up
// whole, with the XXH3 of its bytes, completed by the chunk it ends in.
TEST_F(RxTest, AnyCutOfTheStreamAssemblesEveryTensorWithItsChecksum) {
  unsigned seed = 12345;
  auto rnd = [&](size_t n) { return (seed = seed * 1103515245u + 12345u) / 65536u % n; };
  for (int round = 0; round < 200; round++) {
    size_t n = 1 + rnd(40);
    std::vector<size_t> sizes(n);
    for (auto &z : sizes) z = rnd(4) == 0 ? 0 : rnd(3) == 0 ? 1 + rnd(3000) : 1 + rnd(24);
    size_t total = 0;
    for (size_t z : sizes) total += z;
    std::vector<uint8_t> s = Stream(total);
    std::vector<std::vector<uint8_t>> got(n);
    std::vector<wtx_rx_tensor> t(n);
    std::vector<uint64_t> want(n), ends(n);
    for (size_t i = 0, at = 0; i < n; at += sizes[i++]) {
      got[i].assign(sizes[i] + 1, 0xEE);  // never empty: a valid dst
      t[i] = {"t", sizes[i], got[i].data()};
      want[i] = XXH3_64bits(s.data() + at, sizes[i]);
      ends[i] = at + sizes[i];
    }
    // Chunks: [first tensor, offset into it, bytes), as the trainer cuts.
    size_t first = 0, off = 0, sent = 0, done = 0;
    while (done < n) {
      size_t bytes = std::min(total - sent, 1 + rnd(rnd(2) ? 200 : 5000));
      size_t last = first;
      while (last + 1 < n && ends[last] < sent + bytes) last++;
      if (ends[last] < sent + bytes) bytes = ends[last] - sent;  // not past the end
      while (last + 1 < n && ends[last] == sent + bytes && sizes[last + 1] == 0) last++;
      ASSERT_EQ(0, wtx__rx_begin(rx_, &t[first], last - first + 1, off, bytes, WTX__RX_VERIFY))
          << wtx__rx_error(rx_);
      size_t ending = 0;
      for (size_t i = first; i <= last; i++) ending += ends[i] <= sent + bytes;
      wtx__rx_expect_checksums(rx_, &want[first], ending);
      for (size_t got_bytes = 0; got_bytes < bytes;) {
        size_t k = std::min(bytes - got_bytes, 1 + rnd(300));
        if (rnd(3) == 0) {
          uint8_t *dst = nullptr;
          k = std::min(k, wtx_rx_next(rx_, &dst));
          memcpy(dst, s.data() + sent + got_bytes, k);
          ASSERT_EQ(0, wtx_rx_commit(rx_, k)) << wtx__rx_error(rx_);
        } else {
          ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data() + sent + got_bytes, k)) << wtx__rx_error(rx_);
        }
        got_bytes += k;
      }
      ASSERT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_) << " round " << round;
      ASSERT_EQ(ending, wtx__rx_completed(rx_));
      for (size_t i = 0; i < ending; i++) EXPECT_EQ(want[first + i], wtx__rx_checksum(rx_, i));
      sent += bytes;
      done = first + ending;
      off = done < n && done == last ? sent - (ends[last] - sizes[last]) : 0;  // continued
      first = done;
    }
    for (size_t i = 0, at = 0; i < n; at += sizes[i++]) {
      if (sizes[i] > 0) {  // s.data() is NULL when every tensor is empty
        EXPECT_EQ(0, memcmp(got[i].data(), s.data() + at, sizes[i])) << i;
      }
      EXPECT_EQ(0xEE, got[i][sizes[i]]) << i << ": written past its end";
    }
  }
}

// Pieces of 64 KiB and more (copied with non-temporal stores, hashed from
// the source) into staging at every alignment, cut anywhere, mixed with
// small tensors: every byte lands, nothing is written past a tensor's end,
// and each checksum is the sender's; a byte changed on the way is caught.
TEST_F(RxTest, LargePiecesLandAtAnyAlignmentWithTheSendersChecksums) {
  std::mt19937_64 gen(777);
  auto rnd = [&](size_t n) { return static_cast<size_t>(gen() % n); };
  for (int round = 0; round < 16; round++) {
    int verify = round % 4 != 3, flip = round % 4 == 2;
    size_t n = 1 + rnd(5), total = 0;
    std::vector<size_t> sizes(n), skew(n);
    for (size_t i = 0; i < n; i++) {
      sizes[i] = rnd(3) == 0 ? 1 + rnd(100) : 1 + rnd(200) * 2011 + rnd(64);
      skew[i] = rnd(64);
      total += sizes[i];
    }
    size_t src_skew = rnd(64);
    std::vector<uint8_t> raw = Stream(src_skew + total);
    const uint8_t *s = raw.data() + src_skew;
    std::vector<std::vector<uint8_t>> got(n);
    std::vector<wtx_rx_tensor> t(n);
    std::vector<uint64_t> want(n);
    for (size_t i = 0, at = 0; i < n; at += sizes[i++]) {
      got[i].assign(skew[i] + sizes[i] + 1, 0xEE);
      t[i] = {"t", sizes[i], got[i].data() + skew[i]};
      want[i] = XXH3_64bits(s + at, sizes[i]);
    }
    size_t bad = flip ? rnd(total) : total;
    if (flip) raw[src_skew + bad] ^= 0x40;  // after the sender hashed it
    ASSERT_EQ(0, wtx__rx_begin(rx_, t.data(), n, 0, total, verify ? WTX__RX_VERIFY : 0));
    if (verify) wtx__rx_expect_checksums(rx_, want.data(), n);
    for (size_t sent = 0; sent < total;) {
      size_t k = std::min(total - sent, (size_t)1 + rnd(300000));
      ASSERT_EQ(0, wtx_rx_bytes(rx_, s + sent, k)) << wtx__rx_error(rx_);
      sent += k;
    }
    if (flip) {
      EXPECT_EQ(WTX_ECHECKSUM, wtx__rx_end(rx_)) << "round " << round;
      continue;
    }
    ASSERT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_) << " round " << round;
    ASSERT_EQ(n, wtx__rx_completed(rx_));
    for (size_t i = 0, at = 0; i < n; at += sizes[i++]) {
      if (verify) {
        EXPECT_EQ(want[i], wtx__rx_checksum(rx_, i)) << i;
      }
      EXPECT_EQ(0, memcmp(t[i].dst, s + at, sizes[i])) << "round " << round << " tensor " << i;
      EXPECT_EQ(0xEE, got[i][skew[i] + sizes[i]]) << i << ": written past its end";
      for (size_t b = 0; b < skew[i]; b++) ASSERT_EQ(0xEE, got[i][b]) << i << ": before its start";
    }
  }
}

// Staging never written before (a worker's first syncs: fresh pages, which
// the assembler populates a megabyte ahead of the copy), tensors of a few
// megabytes cut across chunks and pieces, through both ways in (a copy
// from the backend's bytes, a receive in place): every byte lands where it
// belongs, nothing outside, with the sender's checksums.
TEST_F(RxTest, FreshStagingReceivesWholeTensorsAcrossChunks) {
  const size_t sizes[] = {(3u << 20) + 4099, 1u << 20, 777, (2u << 20) - 5};
  const size_t n = sizeof sizes / sizeof *sizes;
  size_t total = 0;
  for (size_t z : sizes) total += z;
  std::vector<uint8_t> s = Stream(total);
  size_t map_len = total + n * 8192 + 4096;
  uint8_t *map = static_cast<uint8_t *>(
      mmap(nullptr, map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(MAP_FAILED, map);
  std::vector<wtx_rx_tensor> t(n);
  std::vector<uint64_t> want(n);
  for (size_t i = 0, at = 0, off = 100; i < n; at += sizes[i], off += sizes[i] + 8192, i++) {
    t[i] = {"t", sizes[i], map + off};  // each one a few pages from the last, never touched
    want[i] = XXH3_64bits(s.data() + at, sizes[i]);
  }
  // Two chunks: the first ends 1 MiB + 3 into the first tensor's rest.
  size_t cut = (1u << 20) + 3;
  ASSERT_EQ(0, wtx__rx_begin(rx_, &t[0], 1, 0, cut, WTX__RX_VERIFY)) << wtx__rx_error(rx_);
  wtx__rx_expect_checksums(rx_, nullptr, 0);
  ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data(), cut)) << wtx__rx_error(rx_);
  ASSERT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_);
  ASSERT_EQ(0, wtx__rx_begin(rx_, t.data(), n, cut, total - cut, WTX__RX_VERIFY))
      << wtx__rx_error(rx_);
  wtx__rx_expect_checksums(rx_, want.data(), n);
  size_t sent = cut, piece = 0;
  while (sent < total) {
    piece = piece * 5 + 70001;  // 70001, 420006, ... then wraps by the modulo
    size_t k = std::min(total - sent, piece % (600u << 10) + 1);
    if (piece % 2) {
      ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data() + sent, k)) << wtx__rx_error(rx_);
    } else {
      uint8_t *dst = nullptr;
      k = std::min(k, wtx_rx_next(rx_, &dst));
      memcpy(dst, s.data() + sent, k);
      ASSERT_EQ(0, wtx_rx_commit(rx_, k)) << wtx__rx_error(rx_);
    }
    sent += k;
  }
  ASSERT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_);
  ASSERT_EQ(n, wtx__rx_completed(rx_));
  std::vector<uint8_t> zero(8192, 0);
  for (size_t i = 0, at = 0, off = 100; i < n; at += sizes[i], off += sizes[i] + 8192, i++) {
    EXPECT_EQ(want[i], wtx__rx_checksum(rx_, i)) << i;
    EXPECT_EQ(0, memcmp(map + off, s.data() + at, sizes[i])) << i;
    EXPECT_EQ(0, memcmp(map + off + sizes[i], zero.data(), 8192)) << i << ": written past its end";
  }
  EXPECT_EQ(0, memcmp(map, zero.data(), 100));
  munmap(map, map_len);
}

// The pages ahead of the copy in fresh staging are made present before it
// gets there, a megabyte at a time, within a chunk and on in the next one
// that continues the tensor (whose first page the last chunk's look-ahead
// already made present).
TEST_F(RxTest, FreshStagingIsPopulatedAheadOfTheCopyAcrossChunks) {
  const size_t mb = 1u << 20, page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
#if defined(MADV_POPULATE_WRITE)
  void *probe = mmap(nullptr, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(MAP_FAILED, probe);
  int populates = madvise(probe, page, MADV_POPULATE_WRITE) == 0;  // Linux 5.14 on
  munmap(probe, page);
  if (!populates) GTEST_SKIP() << "this kernel has no MADV_POPULATE_WRITE (Linux 5.14)";
#else
  GTEST_SKIP() << "these headers have no MADV_POPULATE_WRITE (glibc 2.35)";
#endif
  const size_t size = 8 * mb, piece = mb / 4;  // shm's pieces
  std::vector<uint8_t> s = Stream(size);
  uint8_t *map = static_cast<uint8_t *>(
      mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  ASSERT_NE(MAP_FAILED, map);
  // Base pages only: where THP is "always", a first touch would make a
  // whole 2 MiB page present, and residency would say nothing of the
  // look-ahead.
  ASSERT_EQ(0, madvise(map, size, MADV_NOHUGEPAGE));
  auto present = [&](size_t at) {
    unsigned char in = 0;
    EXPECT_EQ(0, mincore(map + at / page * page, page, &in));
    return (in & 1) != 0;
  };
  auto feed = [&](size_t from, size_t to) {
    for (size_t at = from; at < to; at += piece)
      ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data() + at, std::min(piece, to - at)))
          << wtx__rx_error(rx_);
  };
  wtx_rx_tensor t = {"w", size, map};
  size_t cut = mb + mb / 2;  // the first chunk ends inside what it populated
  ASSERT_EQ(0, wtx__rx_begin(rx_, &t, 1, 0, cut, 0)) << wtx__rx_error(rx_);
  feed(0, piece);
  EXPECT_TRUE(present(mb - page));  // a megabyte ahead of the first byte
  EXPECT_FALSE(present(mb));
  feed(piece, cut);
  ASSERT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_);
  EXPECT_TRUE(present(2 * mb - page));  // past the chunk's end
  ASSERT_EQ(0, wtx__rx_begin(rx_, &t, 1, cut, size - cut, 0)) << wtx__rx_error(rx_);
  feed(cut, 2 * mb + piece);
  EXPECT_TRUE(present(3 * mb - page));  // the next megabyte, before the copy reaches it
  EXPECT_FALSE(present(3 * mb));
  feed(2 * mb + piece, size);
  ASSERT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_);
  EXPECT_EQ(0, memcmp(map, s.data(), size));
  munmap(map, size);
}

TEST_F(RxTest, AFlippedByteIsAChecksumMismatchNamingTheTensor) {
  std::vector<uint8_t> a(64), s = Stream(64);
  wtx_rx_tensor t = {"layer.0.w", 64, a.data()};
  uint64_t sent = XXH3_64bits(s.data(), s.size());
  s[17] ^= 1;  // on the way
  ASSERT_EQ(0, wtx__rx_begin(rx_, &t, 1, 0, 0, 1));
  wtx__rx_expect_checksums(rx_, &sent, 1);
  ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data(), s.size()));
  EXPECT_EQ(WTX_ECHECKSUM, wtx__rx_end(rx_));
  EXPECT_NE(nullptr, strstr(wtx__rx_error(rx_), "checksum mismatch for 'layer.0.w'"))
      << wtx__rx_error(rx_);
}

// A backend that carries the checksums after the bytes (tcp's trailer)
// hands them over once the bytes are in; they are copied and checked at the
// end in place of the UpdateInfo's, and none at all is a refusal.
TEST_F(RxTest, ChecksumsGivenAfterTheBytesAreCopiedAndChecked) {
  std::vector<uint8_t> a(32), b(32), s = Stream(64);
  wtx_rx_tensor t[2] = {{"a", 32, a.data()}, {"b", 32, b.data()}};
  for (int flip : {0, 1}) {
    ASSERT_EQ(0, wtx__rx_begin(rx_, t, 2, 0, 0, 1));
    wtx__rx_expect_checksums(rx_, nullptr, 0);  // UpdateInfo.xxh3_64 is empty
    ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data(), s.size()));
    std::vector<uint64_t> sums = {XXH3_64bits(s.data(), 32), XXH3_64bits(s.data() + 32, 32)};
    sums[1] ^= static_cast<uint64_t>(flip);
    ASSERT_EQ(0, wtx_rx_checksums(rx_, sums.data(), sums.size()));
    sums.assign(2, 0);  // the backend's buffer is reused at once
    if (flip == 0) {
      EXPECT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_);
    } else {
      EXPECT_EQ(WTX_ECHECKSUM, wtx__rx_end(rx_));
      EXPECT_NE(nullptr, strstr(wtx__rx_error(rx_), "checksum mismatch for 'b'"));
    }
  }
  ASSERT_EQ(0, wtx__rx_begin(rx_, t, 2, 0, 0, 1));
  ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data(), s.size()));
  EXPECT_EQ(WTX_EPROTO, wtx__rx_end(rx_));  // no checksums came
  EXPECT_STREQ("chunk completes 2 tensors but carries 0 checksums", wtx__rx_error(rx_));
}

TEST_F(RxTest, WithoutVerificationNoChecksumIsExpected) {
  std::vector<uint8_t> a(8), s = Stream(8);
  wtx_rx_tensor t = {"a", 8, a.data()};
  ASSERT_EQ(0, wtx__rx_begin(rx_, &t, 1, 0, 0, 0));
  ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data(), 8));
  EXPECT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_);
}

TEST_F(RxTest, ChunksThatDisagreeWithTheirTensorsAreRefused) {
  std::vector<uint8_t> a(10), b(10), s = Stream(30);
  wtx_rx_tensor t[2] = {{"a", 10, a.data()}, {"b", 10, b.data()}};
  // More bytes than the tensors hold; a chunk that ends before the last one.
  EXPECT_EQ(WTX_EINVAL, wtx__rx_begin(rx_, t, 2, 0, 21, 0));
  EXPECT_NE(nullptr, strstr(wtx__rx_error(rx_), "update_info.chunk_bytes: 21"));
  EXPECT_EQ(WTX_EINVAL, wtx__rx_begin(rx_, t, 2, 0, 10, 0));
  // An offset past the tensor; a continuation of nothing.
  EXPECT_EQ(WTX_EINVAL, wtx__rx_begin(rx_, t, 1, 10, 0, 0));
  EXPECT_EQ(WTX_EPROTO, wtx__rx_begin(rx_, t, 1, 4, 0, 0));
  EXPECT_NE(nullptr, strstr(wtx__rx_error(rx_), "no tensor incomplete")) << wtx__rx_error(rx_);
  // A backend delivering too much, or too little.
  ASSERT_EQ(0, wtx__rx_begin(rx_, t, 2, 0, 20, 0));
  EXPECT_EQ(WTX_EPROTO, wtx_rx_bytes(rx_, s.data(), 21));
  ASSERT_EQ(0, wtx__rx_begin(rx_, t, 2, 0, 20, 0));
  ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data(), 15));
  EXPECT_EQ(WTX_EPROTO, wtx__rx_end(rx_));
  EXPECT_NE(nullptr, strstr(wtx__rx_error(rx_), "chunk ended early: 15 of 20 bytes"));
  // A tensor left incomplete must be continued, at the byte it stopped.
  wtx__rx_reset(rx_);
  ASSERT_EQ(0, wtx__rx_begin(rx_, t, 1, 0, 4, 0));
  ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data(), 4));
  ASSERT_EQ(0, wtx__rx_end(rx_));
  EXPECT_EQ(WTX_EPROTO, wtx__rx_begin(rx_, &t[1], 1, 0, 0, 0));  // starts b instead
  EXPECT_EQ(WTX_EPROTO, wtx__rx_begin(rx_, t, 1, 5, 0, 0));      // skips a byte
  EXPECT_EQ(0, wtx__rx_begin(rx_, t, 1, 4, 0, 0)) << wtx__rx_error(rx_);
}

TEST_F(RxTest, ZeroByteTensorsCompleteWhereTheyFall) {
  std::vector<uint8_t> a(4), s = Stream(4);
  wtx_rx_tensor t[3] = {{"empty0", 0, nullptr}, {"a", 4, a.data()}, {"empty1", 0, nullptr}};
  uint64_t sums[3] = {XXH3_64bits(nullptr, 0), XXH3_64bits(s.data(), 4),
                      XXH3_64bits(nullptr, 0)};
  ASSERT_EQ(0, wtx__rx_begin(rx_, t, 3, 0, 0, 1));
  wtx__rx_expect_checksums(rx_, sums, 3);
  EXPECT_EQ(1u, wtx__rx_completed(rx_));  // at once
  ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data(), 4));
  ASSERT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_);
  EXPECT_EQ(3u, wtx__rx_completed(rx_));
}

// Device staging: the assembler hands out the model's device addresses and
// hashes the host copy the backend gives it, never the staging itself (here
// memory no one may touch, as device memory is to the CPU); a backend that
// would write it from the CPU is refused.
TEST_F(RxTest, DeviceStagingIsHashedFromTheBackendsHostCopyAndNeverTouched) {
  void *dev = mmap(nullptr, 4096, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(MAP_FAILED, dev);
  uint8_t *d = static_cast<uint8_t *>(dev);
  std::vector<uint8_t> s = Stream(40);
  wtx_rx_tensor t[2] = {{"a", 10, d}, {"b", 30, d + 1024}};
  uint64_t sums[2] = {XXH3_64bits(s.data(), 10), XXH3_64bits(s.data() + 10, 30)};
  int flags = WTX__RX_VERIFY | WTX__RX_DEVICE;
  ASSERT_EQ(0, wtx__rx_begin(rx_, t, 2, 0, 0, flags));
  wtx__rx_expect_checksums(rx_, sums, 2);
  EXPECT_EQ(1, wtx_rx_on_device(rx_));
  EXPECT_EQ(1, wtx_rx_verifying(rx_));
  uint8_t *dst = nullptr;
  ASSERT_EQ(10u, wtx_rx_next(rx_, &dst));
  EXPECT_EQ(d, dst);
  // The CPU paths are refused before they touch anything.
  EXPECT_EQ(WTX_EPROTO, wtx_rx_bytes(rx_, s.data(), 4));
  EXPECT_EQ(WTX_EPROTO, wtx_rx_commit(rx_, 4));
  EXPECT_NE(nullptr, strstr(wtx__rx_error(rx_), "device staging")) << wtx__rx_error(rx_);
  // Verifying needs the host copy.
  EXPECT_EQ(WTX_EPROTO, wtx_rx_commit_device(rx_, 4, nullptr));
  // One commit may span tensors: a, then 6 bytes of b.
  ASSERT_EQ(0, wtx_rx_commit_device(rx_, 16, s.data()));
  ASSERT_EQ(24u, wtx_rx_next(rx_, &dst));
  EXPECT_EQ(d + 1024 + 6, dst);
  ASSERT_EQ(0, wtx_rx_commit_device(rx_, 24, s.data() + 16));
  ASSERT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_);
  EXPECT_EQ(sums[1], wtx__rx_checksum(rx_, 1));
  // A host copy that differs from what was sent is a checksum mismatch.
  std::vector<uint8_t> bad = s;
  bad[20] ^= 1;
  ASSERT_EQ(0, wtx__rx_begin(rx_, t, 2, 0, 0, flags));
  wtx__rx_expect_checksums(rx_, sums, 2);
  ASSERT_EQ(0, wtx_rx_commit_device(rx_, 40, bad.data()));
  EXPECT_EQ(WTX_ECHECKSUM, wtx__rx_end(rx_));
  // Without checksums no host copy is needed; into host staging, the
  // device commit is refused.
  ASSERT_EQ(0, wtx__rx_begin(rx_, t, 2, 0, 0, WTX__RX_DEVICE));
  EXPECT_EQ(0, wtx_rx_verifying(rx_));
  ASSERT_EQ(0, wtx_rx_commit_device(rx_, 40, nullptr));
  EXPECT_EQ(0, wtx__rx_end(rx_));
  std::vector<uint8_t> a(10), b(30);
  wtx_rx_tensor h[2] = {{"a", 10, a.data()}, {"b", 30, b.data()}};
  ASSERT_EQ(0, wtx__rx_begin(rx_, h, 2, 0, 0, 0));
  EXPECT_EQ(0, wtx_rx_on_device(rx_));
  EXPECT_EQ(WTX_EPROTO, wtx_rx_commit_device(rx_, 4, s.data()));
  munmap(dev, 4096);
}

// With the senders' span checksums (many senders), a tensor's whole
// checksum is read back from its staging once complete; a chunk received
// WTX__RX_UNREAD (the session's host copy of device staging, holding only
// this chunk's bytes of a tensor another chunk began) gives none, as a
// chunk into device memory does, instead of the hash of bytes it never
// held.
TEST_F(RxTest, AnUnreadChunkGivesNoWholeChecksumReadBackFromItsStaging) {
  std::vector<uint8_t> s = Stream(20);
  for (int unread : {0, 1}) {
    std::vector<uint8_t> a(20), b(20);  // chunk 1 into a, chunk 2 into b
    wtx_rx_tensor first[1] = {{"a", 20, a.data()}}, second[1] = {{"a", 20, b.data()}};
    uint64_t head = XXH3_64bits(s.data(), 8), tail = XXH3_64bits(s.data() + 8, 12);
    ASSERT_EQ(0, wtx__rx_begin(rx_, first, 1, 0, 8, WTX__RX_VERIFY));
    ASSERT_EQ(0, wtx_rx_span_checksums(rx_));
    wtx__rx_expect_checksums(rx_, &head, 1);
    ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data(), 8));
    ASSERT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_);
    int flags = WTX__RX_VERIFY | (unread ? WTX__RX_UNREAD : 0);
    ASSERT_EQ(0, wtx__rx_begin(rx_, second, 1, 8, 12, flags));
    ASSERT_EQ(0, wtx_rx_span_checksums(rx_));
    wtx__rx_expect_checksums(rx_, &tail, 1);
    ASSERT_EQ(0, wtx_rx_bytes(rx_, s.data() + 8, 12));
    ASSERT_EQ(0, wtx__rx_end(rx_)) << wtx__rx_error(rx_);
    ASSERT_EQ(1u, wtx__rx_completed(rx_));
    EXPECT_EQ(!unread, wtx__rx_whole_sums(rx_)) << unread;
    // Read back, b's whole is not the tensor's: it lacks bytes 0-7.
    if (!unread) {
      EXPECT_EQ(XXH3_64bits(b.data(), 20), wtx__rx_checksum(rx_, 0));
    }
    EXPECT_NE(XXH3_64bits(s.data(), 20), XXH3_64bits(b.data(), 20));
    EXPECT_EQ(0, memcmp(b.data() + 8, s.data() + 8, 12));
  }
}

}  // namespace
