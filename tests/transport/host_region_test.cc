// A worker's receive region in host shared memory (transport/host_region.h):
// made by the worker, opened by its senders by name only while the name
// stands, written by them at stream offsets within its bounds, and read by
// the worker either in place (hashed where it lies) or copied into staging.
#include "transport/host_region.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <cstring>
#include <string>
#include <vector>

#include "transport/rx.h"

namespace {

class HostRegionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(0, wtx__host_region_make(kBytes, 0, &worker_, err_, sizeof err_)) << err_;
    name_ = wtx__host_region_name(worker_);
  }
  void TearDown() override {
    wtx__host_region_free(sender_);
    wtx__host_region_free(worker_);
  }
  uint8_t *Base(wtx__host_region *r) {
    uint8_t *base = nullptr;
    uint64_t bytes = 0;
    EXPECT_EQ(0, wtx__host_region_get(r, &base, &bytes));
    EXPECT_EQ(kBytes, bytes);
    return base;
  }

  static constexpr uint64_t kBytes = 1 << 20;
  wtx__host_region *worker_ = nullptr, *sender_ = nullptr;
  std::string name_;
  char err_[400] = "";
};

TEST_F(HostRegionTest, OnlyThisUsersRegionOfTheSizeSaidOpensAndOnlyWhileItsNameStands) {
  EXPECT_EQ(0u, name_.rfind("/wtx-region-", 0)) << name_;
  EXPECT_EQ(WTX_EPROTO, wtx__host_region_open(name_.c_str(), kBytes + 1, &sender_, err_,
                                              sizeof err_));
  EXPECT_NE(nullptr, strstr(err_, "not the size the worker said")) << err_;
  for (const char *other : {"/dev/shm/x", "/etc/passwd", "/wtx-no-such-region"})
    EXPECT_NE(0, wtx__host_region_open(other, kBytes, &sender_, err_, sizeof err_)) << other;
  ASSERT_EQ(0, wtx__host_region_open(name_.c_str(), kBytes, &sender_, err_, sizeof err_))
      << err_;
  wtx__host_region_unlink(worker_);
  EXPECT_STREQ("", wtx__host_region_name(worker_));
  wtx__host_region *late = nullptr;
  EXPECT_EQ(WTX_EIO, wtx__host_region_open(name_.c_str(), kBytes, &late, err_, sizeof err_));
  EXPECT_EQ(nullptr, late);
}

TEST_F(HostRegionTest, ASendersPiecesLandAtTheirOffsetAndOnesThatWouldOverrunAreRefused) {
  ASSERT_EQ(0, wtx__host_region_open(name_.c_str(), kBytes, &sender_, err_, sizeof err_));
  char a[] = "abc", b[] = "defgh";
  struct iovec v[2] = {{a, 3}, {b, 5}};
  uint64_t at = 1000;
  const char *why = "";
  ASSERT_EQ(0, wtx__host_region_put(sender_, &at, v, 2, &why)) << why;
  EXPECT_EQ(1008u, at);
  EXPECT_EQ(0, memcmp(Base(worker_) + 1000, "abcdefgh", 8));
  at = kBytes - 7;  // 8 bytes from here end one past the region
  EXPECT_EQ(WTX_EINVAL, wtx__host_region_put(sender_, &at, v, 2, &why));
  EXPECT_NE(nullptr, strstr(why, "past the worker's receive region")) << why;
  EXPECT_EQ(kBytes - 7, at);
  EXPECT_NE('a', Base(worker_)[kBytes - 7]) << "nothing of a refused put is written";
}

TEST_F(HostRegionTest, OverTheWorkersModelLimitNoRegionIsMade) {
  wtx__host_region *big = nullptr;
  EXPECT_EQ(WTX_EUNAVAIL, wtx__host_region_make(2 * kBytes, kBytes, &big, err_, sizeof err_));
  EXPECT_EQ(nullptr, big);
  EXPECT_NE(nullptr, strstr(err_, "--max-model-bytes")) << err_;
}

// More than shared memory holds in all is declined when the region is
// made. A page that cannot be written later (no room left, or the object
// cut short under the sender) fails that put, not the sender's process.
TEST_F(HostRegionTest, NoRoomForAPageIsAnErrorOfThePutNotASignal) {
  wtx__host_region *huge = nullptr;
  EXPECT_EQ(WTX_EUNAVAIL, wtx__host_region_make(1ull << 60, 0, &huge, err_, sizeof err_));
  EXPECT_NE(nullptr, strstr(err_, "shared memory holds")) << err_;
  EXPECT_EQ(nullptr, huge);
  ASSERT_EQ(0, wtx__host_region_open(name_.c_str(), kBytes, &sender_, err_, sizeof err_));
  int fd = shm_open(name_.c_str(), O_RDWR, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(0, ftruncate(fd, 4096));  // the pages past the first are gone
  close(fd);
  std::vector<uint8_t> piece(8192, 7);
  struct iovec v = {piece.data(), piece.size()};
  uint64_t at = 0;
  const char *why = "";
  EXPECT_EQ(WTX_EIO, wtx__host_region_put(sender_, &at, &v, 1, &why));
  EXPECT_NE(nullptr, strstr(why, "no room left")) << why;
  EXPECT_EQ(0u, at);
}

// Tensors a and b of a chunk at stream offset 64: a adopted where it lies
// (its staging is the region), b staged apart; the worker hashes a in
// place, copies b, and both verify against the sender's sums. A byte
// changed in the region after the sender hashed it fails the chunk.
TEST_F(HostRegionTest, TheWorkerHashesAnAdoptedTensorWhereItLiesAndCopiesAStagedOne) {
  ASSERT_EQ(0, wtx__host_region_open(name_.c_str(), kBytes, &sender_, err_, sizeof err_));
  std::vector<uint8_t> bytes(300);
  for (size_t i = 0; i < bytes.size(); i++) bytes[i] = static_cast<uint8_t>(i * 13 + 1);
  for (int corrupt = 0; corrupt <= 1; corrupt++) {
    uint64_t at = 64;
    struct iovec v = {bytes.data(), bytes.size()};
    const char *why = "";
    ASSERT_EQ(0, wtx__host_region_put(sender_, &at, &v, 1, &why)) << why;
    uint64_t sums[2] = {XXH3_64bits(bytes.data(), 100), XXH3_64bits(bytes.data() + 100, 200)};
    if (corrupt) Base(worker_)[64 + 150] ^= 1;
    std::vector<uint8_t> b(200);
    wtx_rx_tensor t[2] = {{"a", 100, Base(worker_) + 64}, {"b", 200, b.data()}};
    wtx_rx *rx = nullptr;
    ASSERT_EQ(0, wtx__rx_create(&rx));
    ASSERT_EQ(0, wtx__rx_begin(rx, t, 2, 0, 300, WTX__RX_VERIFY)) << wtx__rx_error(rx);
    wtx__rx_expect_checksums(rx, sums, 2);
    ASSERT_EQ(0, wtx__host_region_out(worker_, 64, rx)) << wtx__rx_error(rx);
    if (corrupt) {
      EXPECT_EQ(WTX_ECHECKSUM, wtx__rx_end(rx));
      EXPECT_NE(nullptr, strstr(wtx__rx_error(rx), "'b'")) << wtx__rx_error(rx);
    } else {
      EXPECT_EQ(0, wtx__rx_end(rx)) << wtx__rx_error(rx);
      EXPECT_EQ(0, memcmp(b.data(), bytes.data() + 100, 200));
    }
    wtx__rx_destroy(rx);
  }
}

TEST_F(HostRegionTest, AChunkBeyondTheRegionIsRefusedBeforeAByteIsRead) {
  std::vector<uint8_t> a(100);
  wtx_rx_tensor t = {"a", 100, a.data()};
  wtx_rx *rx = nullptr;
  ASSERT_EQ(0, wtx__rx_create(&rx));
  ASSERT_EQ(0, wtx__rx_begin(rx, &t, 1, 0, 100, 0));
  EXPECT_EQ(WTX_EINVAL, wtx__host_region_out(worker_, kBytes - 50, rx));
  EXPECT_NE(nullptr, strstr(wtx__rx_error(rx), "beyond")) << wtx__rx_error(rx);
  EXPECT_EQ(100u, wtx_rx_remaining(rx));
  wtx__rx_destroy(rx);
}

}  // namespace
