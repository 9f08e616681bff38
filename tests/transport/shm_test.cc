// The shm backend's worker half on its own: it reads only "/wtx-" regions of
// its own user, checks the range on every chunk, and a region that shrinks
// between chunks or while a chunk is copied is an error, never SIGBUS.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <dlfcn.h>

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "transport/rx.h"

// TEST DOUBLE at the syscall seam: this executable's fstat wraps libc's and,
// when armed, truncates the region right after its n-th call has reported
// the full size, as another process shrinking the region between the
// worker's size check and its copy would: the copy then reads past the end
// of the mapping (SIGBUS without the guard). Armed with an owner, it reports
// that uid, as for a region another user made (only root could make one
// for real, with fchown).
std::atomic<int> g_shrink_on_call{0};  // 0: disarmed
std::atomic<int> g_calls{0};
std::string g_shrink_region;
std::atomic<long long> g_owner{-1};  // -1: disarmed

extern "C" int fstat(int fd, struct stat *st) {
  using fn = int (*)(int, struct stat *);
  static fn real = reinterpret_cast<fn>(dlsym(RTLD_NEXT, "fstat"));
  int r = real(fd, st);
  if (r == 0 && g_owner >= 0) st->st_uid = static_cast<uid_t>(g_owner.load());
  int call = ++g_calls;
  if (g_shrink_on_call > 0 && call == g_shrink_on_call) {
    int w = shm_open(g_shrink_region.c_str(), O_RDWR, 0);
    if (w >= 0) {
      if (ftruncate(w, 4096) != 0) abort();
      close(w);
    }
  }
  return r;
}

namespace {

class ShmTest : public ::testing::Test {
 protected:
  void SetUp() override {
    region_ = "/wtx-shmtest-" + std::to_string(getpid());
    ASSERT_EQ(0, wtx__rx_create(&rx_));
    wtx_wire_params wire{1, 16 << 20, 1, 2, 5000};
    Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
    char err[256];
    ASSERT_EQ(0, wtx_shm_worker_transport.init(&ii, &wire, nullptr, &w_, err, sizeof err));
  }
  void TearDown() override {
    wtx_shm_worker_transport.destroy(w_);
    wtx__rx_destroy(rx_);
    shm_unlink(region_.c_str());
    g_shrink_on_call = 0;
    g_owner = -1;
  }
  // A region of n bytes: 0, 1, 2, ...
  void MakeRegion(size_t n, const std::string &name) {
    int fd = shm_open(name.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(0, ftruncate(fd, static_cast<off_t>(n)));
    std::vector<uint8_t> b(n);
    for (size_t i = 0; i < n; i++) b[i] = static_cast<uint8_t>(i * 13);
    ASSERT_EQ(static_cast<ssize_t>(n), write(fd, b.data(), n));
    close(fd);
  }
  // Receives [offset, +n) of name into dst_: the backend's return code.
  int Receive(const std::string &name, uint64_t offset, size_t n) {
    return Receive(name, offset, std::vector<size_t>{n});
  }
  // The same for a chunk of tensors of these sizes, back to back in dst_.
  int Receive(const std::string &name, uint64_t offset, const std::vector<size_t> &sizes) {
    size_t n = 0;
    for (size_t k : sizes) n += k;
    dst_.assign(n, 0);
    std::vector<wtx_rx_tensor> ts;
    size_t at = 0;
    for (size_t k : sizes) {
      ts.push_back({"t", k, dst_.data() + at});
      at += k;
    }
    wtx__rx_reset(rx_);
    EXPECT_EQ(0, wtx__rx_begin(rx_, ts.data(), ts.size(), 0, n, 0));
    Wtx__V1__ShmUpdateInfo su = WTX__V1__SHM_UPDATE_INFO__INIT;
    su.region = const_cast<char *>(name.c_str());
    su.offset = offset;
    Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
    ui.backend_case = WTX__V1__UPDATE_INFO__BACKEND_SHM;
    ui.shm = &su;
    int rc = wtx_shm_worker_transport.receive(w_, &ui, rx_);
    if (rc == 0) rc = wtx__rx_end(rx_);
    error_ = wtx__rx_error(rx_);
    return rc;
  }
  std::string region_, error_;
  std::vector<uint8_t> dst_;
  wtx_rx *rx_ = nullptr;
  void *w_ = nullptr;
};

TEST_F(ShmTest, ReadsTheRangeItIsGiven) {
  MakeRegion(1 << 20, region_);
  ASSERT_EQ(0, Receive(region_, 1000, 5000)) << error_;
  for (size_t i = 0; i < 5000; i++) ASSERT_EQ(static_cast<uint8_t>((1000 + i) * 13), dst_[i]);
}

TEST_F(ShmTest, SmallTensorsAroundALargeOneLandByteExact) {
  // 20,000 tensors of 16 bytes around a 1 MiB one, at an odd offset: the
  // pieces copied out of the mapping span tensor boundaries both ways.
  std::vector<size_t> sizes(10000, 16);
  sizes.push_back(1 << 20);
  sizes.insert(sizes.end(), 10000, 16);
  sizes.push_back(3);
  MakeRegion(2 << 20, region_);
  ASSERT_EQ(0, Receive(region_, 7, sizes)) << error_;
  for (size_t i = 0; i < dst_.size(); i++)
    ASSERT_EQ(static_cast<uint8_t>((7 + i) * 13), dst_[i]) << "byte " << i;
}

TEST_F(ShmTest, CancelStopsARead) {
  MakeRegion(12 << 20, region_);
  wtx_shm_worker_transport.cancel(w_);
  EXPECT_EQ(WTX_ECANCELED, Receive(region_, 0, 12 << 20));
  EXPECT_NE(std::string::npos, error_.find("shm: cancelled")) << error_;
  wtx_shm_worker_transport.reset(w_);  // the abort that follows
  EXPECT_EQ(0, Receive(region_, 0, 12 << 20)) << error_;
}

TEST_F(ShmTest, OnlyRegionsWithTheProjectsPrefixAreOpened) {
  std::string other = "/other-" + std::to_string(getpid());
  MakeRegion(4096, other);
  EXPECT_EQ(WTX_EINVAL, Receive(other, 0, 16));
  EXPECT_NE(std::string::npos, error_.find("must be a POSIX shm name starting '/wtx-'"))
      << error_;
  EXPECT_EQ(WTX_EINVAL, Receive("/wtx-a/b", 0, 16));  // one component only
  shm_unlink(other.c_str());
}

TEST_F(ShmTest, ARegionOfAnotherUserIsRefused) {
  // Any user runs this part: fstat says the region is another user's.
  MakeRegion(4096, region_);
  g_owner = geteuid() + 1;
  EXPECT_EQ(WTX_EPERM, Receive(region_, 0, 16));
  EXPECT_NE(std::string::npos, error_.find("is not a region of this worker's user")) << error_;
  g_owner = -1;
  // Root (as CI runs) also gives it away for real: the kernel's owner, not
  // the double's, is refused the same way.
  if (geteuid() == 0) {
    int fd = shm_open(region_.c_str(), O_RDWR, 0);
    ASSERT_EQ(0, fchown(fd, 65534, 65534));
    EXPECT_EQ(WTX_EPERM, Receive(region_, 0, 16));
    EXPECT_NE(std::string::npos, error_.find("is not a region of this worker's user"))
        << error_;
    ASSERT_EQ(0, fchown(fd, 0, 0));
    close(fd);
  }
  EXPECT_EQ(0, Receive(region_, 0, 16)) << error_;  // this user's again: read
}

TEST_F(ShmTest, ARegionShrunkBetweenChunksIsARangeError) {
  MakeRegion(8 << 20, region_);
  ASSERT_EQ(0, Receive(region_, 0, 4 << 20)) << error_;
  int fd = shm_open(region_.c_str(), O_RDWR, 0);
  ASSERT_EQ(0, ftruncate(fd, 1 << 20));
  close(fd);
  EXPECT_EQ(WTX_EINVAL, Receive(region_, 4 << 20, 4 << 20));
  EXPECT_NE(std::string::npos, error_.find("is outside region")) << error_;
  // The backend recovers: a fresh region of the same name works.
  MakeRegion(8 << 20, region_);
  EXPECT_EQ(0, Receive(region_, 4 << 20, 4 << 20)) << error_;
}

TEST_F(ShmTest, ARegionShrunkWhileAChunkIsReadIsAnErrorNotSigbus) {
  MakeRegion(12 << 20, region_);
  g_shrink_region = region_;
  g_calls = 0;
  g_shrink_on_call = 2;  // the size check before the copy (1: opening)
  EXPECT_EQ(WTX_EABORTED, Receive(region_, 0, 12 << 20));
  EXPECT_NE(std::string::npos, error_.find("shrunk or removed while read")) << error_;
  g_shrink_on_call = 0;
  // Unlinked after the worker opened it: its bytes stay until closed, as
  // POSIX says, and the next chunk still reads them.
  MakeRegion(12 << 20, region_);
  ASSERT_EQ(0, Receive(region_, 0, 1 << 20));
  ASSERT_EQ(0, shm_unlink(region_.c_str()));
  EXPECT_EQ(0, Receive(region_, 1 << 20, 1 << 20)) << error_;
}

}  // namespace
