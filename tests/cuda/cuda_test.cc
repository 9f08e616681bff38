// The CUDA/NCCL seam (cuda/cuda.c) and the GPU backends' halves in one
// process, on the TEST DOUBLE of CUDA and NCCL (cuda/testing/fake_cuda.c):
// each test is a defect read against real CUDA semantics that the double
// now models, and fails without its fix.
#include "cuda/cuda.h"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <xxhash.h>

#include "transport/rx.h"
#include "transport/transport.h"
#include "wtx/error.h"

namespace {

using Clock = std::chrono::steady_clock;

std::string DoublePath() {
  char cwd[4096];
  EXPECT_NE(nullptr, getcwd(cwd, sizeof cwd));
  return std::string(cwd) + "/cuda/testing/libwtx_fake_cuda.so";
}

// What a receive fills: an assembler expecting one 4 KiB tensor.
struct OneTensorRx {
  std::vector<uint8_t> dst = std::vector<uint8_t>(4096);
  wtx_rx_tensor rt{"t", 4096, nullptr};
  wtx_rx *rx = nullptr;
  OneTensorRx() {
    rt.dst = dst.data();
    if (wtx__rx_create(&rx) != 0 || Begin() != 0) abort();
  }
  ~OneTensorRx() { wtx__rx_destroy(rx); }
  int Begin() { return wtx__rx_begin(rx, &rt, 1, 0, dst.size(), 0); }
  std::string Error() const { return wtx__rx_error(rx); }
};

class CudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    setenv("WTX_CUDART_LIB", DoublePath().c_str(), 1);
    setenv("WTX_NCCL_LIB", DoublePath().c_str(), 1);
    char err[600] = "";
    ASSERT_EQ(0, wtx__cuda_load(1, &c_, err, sizeof err)) << err;
    // The double's own export: broadcasts of this process still running.
    void *h = dlopen(DoublePath().c_str(), RTLD_NOW | RTLD_NOLOAD);
    ASSERT_NE(nullptr, h);
    running_ = reinterpret_cast<int (*)()>(dlsym(h, "wtx_fake_cuda_running_kernels"));
    ASSERT_NE(nullptr, running_);
    posted_ = reinterpret_cast<uint64_t (*)(void *)>(dlsym(h, "wtx_fake_cuda_posted"));
    ASSERT_NE(nullptr, posted_);
  }
  void TearDown() override {
    unsetenv("WTX_FAKE_CUDA_HARD");
    unsetenv("WTX_CUDA_DEVICE");
    unsetenv("WTX_FAKE_CUDA_LAG_MS");
  }
  int Device() {
    int d = -1;
    EXPECT_EQ(0, c_->GetDevice(&d));
    return d;
  }
  // The nccl worker half as rank 1 of 2 on GPU 1, joined to id (rank 0
  // joins elsewhere), its waits bounded by timeout_ms.
  void JoinWorker(wtx_nccl_id &id, uint32_t timeout_ms, void **w) {
    setenv("WTX_CUDA_DEVICE", "1", 1);
    wtx_wire_params wire{1, 1 << 20, 2, 2, timeout_ms};
    Wtx__V1__NcclInitInfo ni = WTX__V1__NCCL_INIT_INFO__INIT;
    ni.unique_id.data = reinterpret_cast<uint8_t *>(&id);
    ni.unique_id.len = sizeof id;
    ni.world_size = 2;
    ni.rank_offset = 1;
    Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
    ii.backend_case = WTX__V1__INIT_INFO__BACKEND_NCCL;
    ii.nccl = &ni;
    char err[600] = "", addr[64];
    ASSERT_EQ(0, wtx_nccl_worker_transport.init(&ii, &wire, nullptr, w, err, sizeof err)) << err;
    ASSERT_EQ(0, wtx_nccl_worker_transport.connect(*w, addr, sizeof addr, err, sizeof err))
        << err;
  }
  // A communicator of two: the root (rank 0, GPU 0) joined on a thread of
  // its own, and the nccl worker half as rank 1.
  void JoinBoth(uint32_t timeout_ms, void **root, void **w) {
    wtx_nccl_id id = NewId(c_);
    std::thread r0([&] {
      c_->SetDevice(0);
      char e[400];
      ASSERT_EQ(0, wtx__nccl_join(c_, root, 2, &id, 0, 10000, nullptr, e, sizeof e)) << e;
    });
    JoinWorker(id, timeout_ms, w);
    r0.join();
  }
  static wtx_nccl_id NewId(const wtx_cuda *c) {
    wtx_nccl_id id;
    EXPECT_EQ(0, c->GetUniqueId(&id));
    return id;
  }
  const wtx_cuda *c_ = nullptr;
  int (*running_)() = nullptr;
  uint64_t (*posted_)(void *comm) = nullptr;  // broadcasts a root has posted
};

double Seconds(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// NCCL's rendezvous waits for ever for a rank that never comes; the join
// is non-blocking, so it ends at the timeout, or at once when cancelled.
TEST_F(CudaTest, AJoinWithoutItsPeersEndsAtTheTimeoutOrOnCancel) {
  wtx_nccl_id id = NewId(c_);
  void *comm = reinterpret_cast<void *>(1);
  char err[400] = "";
  auto t0 = Clock::now();
  EXPECT_EQ(WTX_ETIMEDOUT, wtx__nccl_join(c_, &comm, 2, &id, 1, 300, nullptr, err, sizeof err));
  EXPECT_LT(Seconds(t0), 5.0);
  EXPECT_EQ(nullptr, comm);
  EXPECT_NE(nullptr, strstr(err, "not every rank joined within 300 ms")) << err;

  std::atomic<int> flag{0};  // C's atomic_int, as a worker's cancel sets it
  wtx_stop stop = {};
  stop.flag = &flag;
  std::thread canceller([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    flag = 1;
  });
  id = NewId(c_);
  t0 = Clock::now();
  EXPECT_EQ(WTX_ECANCELED, wtx__nccl_join(c_, &comm, 2, &id, 1, 60000, &stop, err, sizeof err));
  canceller.join();
  EXPECT_LT(Seconds(t0), 5.0);
  EXPECT_EQ(nullptr, comm);
}

// Two ranks on one GPU: NCCL refuses, and ncclGetLastError says why.
TEST_F(CudaTest, TwoRanksOnOneGpuFailWithNcclsOwnDetail) {
  wtx_nccl_id id = NewId(c_);
  int rc0 = 0, rc1 = 0;
  char e0[400] = "", e1[400] = "";
  void *comm0 = nullptr, *comm1 = nullptr;
  std::thread r0([&] {
    c_->SetDevice(0);
    rc0 = wtx__nccl_join(c_, &comm0, 2, &id, 0, 10000, nullptr, e0, sizeof e0);
  });
  c_->SetDevice(0);
  rc1 = wtx__nccl_join(c_, &comm1, 2, &id, 1, 10000, nullptr, e1, sizeof e1);
  r0.join();
  EXPECT_EQ(WTX_EUNAVAIL, rc0);
  EXPECT_EQ(WTX_EUNAVAIL, rc1);
  EXPECT_NE(nullptr, strstr(e1, "Duplicate GPU detected : rank 0 and rank 1")) << e1;
}

// The caller's current device (PyTorch's, in a trainer) is what it was
// after every call of a GPU backend, on both halves.
TEST_F(CudaTest, TheCallersCurrentDeviceIsRestored) {
  ASSERT_EQ(0, c_->SetDevice(5));
  setenv("WTX_CUDA_DEVICE", "2", 1);
  wtx__cuda_trainer t;
  char err[600] = "";
  ASSERT_EQ(0, wtx__cuda_trainer_open(&t, "test", 1, 2, 1 << 16, 5000, err, sizeof err)) << err;
  EXPECT_EQ(5, Device());
  memset(wtx__cuda_trainer_host(&t, 1), 7, 1 << 16);
  ASSERT_EQ(0, wtx__cuda_trainer_upload(&t, 1, 1 << 16, err, sizeof err)) << err;
  EXPECT_EQ(5, Device());
  wtx__cuda_trainer_close(&t);
  EXPECT_EQ(5, Device());
  // The worker halves too.
  wtx_wire_params wire{1, 1 << 20, 2, 2, 5000};
  Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
  void *w = nullptr;
  ASSERT_EQ(0, wtx_cuda_ipc_worker_transport.init(&ii, &wire, nullptr, &w, err, sizeof err))
      << err;
  EXPECT_EQ(5, Device());
  wtx_cuda_ipc_worker_transport.destroy(w);
  EXPECT_EQ(5, Device());
}

// A chunk announced to the workers is on the device already: the trainer
// waits for its upload, which from pageable memory would land later (the
// double lands copies 300 ms late here), and another process reading the
// buffer right away sees the new bytes.
TEST_F(CudaTest, AnAnnouncedChunkIsAlreadyInDeviceMemory) {
  setenv("WTX_FAKE_CUDA_LAG_MS", "300", 1);
  wtx_trainer_args args{};
  args.wire = wtx_wire_params{1, 1 << 20, 1, 2, 5000};
  args.n_workers = 1;
  void *t = nullptr;
  char err[600] = "";
  ASSERT_EQ(0, wtx_cuda_ipc_trainer_transport.create(&args, &t, err, sizeof err)) << err;
  uint8_t *host = wtx_cuda_ipc_trainer_transport.buffer(t, 0);
  for (size_t i = 0; i < (1 << 20); i++) host[i] = static_cast<uint8_t>(i * 7 + 3);
  wtx_chunk ch{};
  ch.bytes = 1 << 20;
  Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
  ASSERT_EQ(0, wtx_cuda_ipc_trainer_transport.prepare(t, 0, &ch, &ui, err, sizeof err)) << err;
  // Another process opens the exported handle and reads at once.
  const Wtx__V1__CudaIpcBuffer *b = ui.cuda_ipc->buffers[0];
  wtx_cuda_ipc_handle h;
  memcpy(&h, b->handle.data, sizeof h);
  // The child maps the object the double's handle names with plain
  // syscalls (after fork only async-signal-safe calls: no CUDA, no locks).
  std::string name(h.bytes + 8);
  pid_t pid = fork();
  if (pid == 0) {
    int fd = shm_open(name.c_str(), O_RDONLY, 0);
    void *p = fd >= 0 ? mmap(nullptr, 1 << 20, PROT_READ, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (p == MAP_FAILED) _exit(2);
    const uint8_t *d = static_cast<const uint8_t *>(p);
    for (size_t i = 0; i < (1 << 20); i++)
      if (d[i] != static_cast<uint8_t>(i * 7 + 3)) _exit(1);
    _exit(0);
  }
  int st = 0;
  ASSERT_EQ(pid, waitpid(pid, &st, 0));
  EXPECT_TRUE(WIFEXITED(st));
  EXPECT_EQ(0, WEXITSTATUS(st)) << "1: the other process read stale bytes; 2: no handle";
  // CUDA opens an IPC handle in another process only.
  void *p = nullptr;
  EXPECT_NE(0, c_->IpcOpenMemHandle(&p, h, WTX_CUDA_IPC_LAZY_PEER));
  wtx_cuda_ipc_trainer_transport.destroy(t);
}

// The double's device memory is not host memory: touching a device address
// on the CPU crashes, as on a GPU, so no test passes on a host read of
// device bytes; copies must say where their pointers are.
TEST_F(CudaTest, DeviceAddressesAreReachableOnlyThroughCopies) {
  void *dev = nullptr;
  ASSERT_EQ(0, c_->Malloc(&dev, 4096));
  std::vector<uint8_t> in(4096), out(4096, 0);
  for (size_t i = 0; i < in.size(); i++) in[i] = static_cast<uint8_t>(i * 5 + 1);
  ASSERT_EQ(0, c_->Memcpy(dev, in.data(), in.size(), WTX_CUDA_H2D));
  ASSERT_EQ(0, c_->Memcpy(out.data(), dev, out.size(), WTX_CUDA_D2H));
  EXPECT_EQ(in, out);
  void *dev2 = nullptr;
  ASSERT_EQ(0, c_->Malloc(&dev2, 4096));
  ASSERT_EQ(0, c_->Memcpy(dev2, static_cast<uint8_t *>(dev) + 96, 64, WTX_CUDA_D2D));
  std::vector<uint8_t> back(64);
  ASSERT_EQ(0, c_->Memcpy(back.data(), dev2, 64, WTX_CUDA_D2H));
  EXPECT_EQ(0, memcmp(back.data(), in.data() + 96, 64));
  // The wrong kind, or past the end of the allocation: invalid value.
  EXPECT_NE(0, c_->Memcpy(out.data(), in.data(), 16, WTX_CUDA_H2D));
  EXPECT_NE(0, c_->Memcpy(out.data(), dev, 16, WTX_CUDA_D2D));
  EXPECT_NE(0, c_->Memcpy(out.data(), static_cast<uint8_t *>(dev) + 4000, 200, WTX_CUDA_D2H));
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH({ volatile uint8_t b = *static_cast<volatile uint8_t *>(dev); (void)b; }, "");
  EXPECT_DEATH(memset(dev, 0, 16), "");
  c_->Free(dev2);
  c_->Free(dev);
}

// A worker's broadcast that times out is aborted at once: its kernel does
// not keep running on the GPU, and the next update says the communicator
// is gone.
TEST_F(CudaTest, ATimedOutBroadcastIsAbortedNotLeftRunning) {
  wtx_nccl_id id = NewId(c_);
  std::atomic<bool> stop_root{false};
  void *root = nullptr;
  std::thread r0([&] {
    c_->SetDevice(0);
    char e[400];
    ASSERT_EQ(0, wtx__nccl_join(c_, &root, 2, &id, 0, 10000, nullptr, e, sizeof e)) << e;
    while (!stop_root) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  });
  void *w = nullptr;
  ASSERT_NO_FATAL_FAILURE(JoinWorker(id, 300, &w));
  OneTensorRx r;
  Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
  auto t0 = Clock::now();
  // Rank 0 never broadcasts.
  EXPECT_EQ(WTX_ETIMEDOUT, wtx_nccl_worker_transport.receive(w, &ui, r.rx));
  EXPECT_LT(Seconds(t0), 5.0);
  EXPECT_NE(std::string::npos, r.Error().find("communicator aborted")) << r.Error();
  EXPECT_EQ(0, running_());  // the worker's broadcast kernel is gone
  wtx__rx_reset(r.rx);
  ASSERT_EQ(0, r.Begin());
  EXPECT_EQ(WTX_ESTATE, wtx_nccl_worker_transport.receive(w, &ui, r.rx));
  wtx_nccl_worker_transport.destroy(w);
  stop_root = true;
  r0.join();
  c_->CommAbort(root);
}

// The double's point to point, as NCCL's: a send runs until its peer's
// receive takes the bytes (one nobody receives keeps its stream busy until
// the communicator is aborted), sends meet receives in order per pair,
// and sizes that differ fail both.
TEST_F(CudaTest, ASendRunsUntilItsReceiveTakesItAndSizesMustMatch) {
  wtx_nccl_id id = NewId(c_);
  void *comm[2] = {nullptr, nullptr};
  std::thread t([&] {
    c_->SetDevice(1);
    char e[400];
    ASSERT_EQ(0, wtx__nccl_join(c_, &comm[1], 2, &id, 1, 10000, nullptr, e, sizeof e)) << e;
  });
  char e[400];
  ASSERT_EQ(0, c_->SetDevice(0));
  ASSERT_EQ(0, wtx__nccl_join(c_, &comm[0], 2, &id, 0, 10000, nullptr, e, sizeof e)) << e;
  t.join();
  std::vector<uint8_t> in(4096), out(4096);
  for (size_t i = 0; i < in.size(); i++) in[i] = static_cast<uint8_t>(i * 7 + 1);
  void *src = nullptr, *dst = nullptr, *s0 = nullptr, *s1 = nullptr;
  ASSERT_EQ(0, c_->Malloc(&src, 4096));
  ASSERT_EQ(0, c_->Malloc(&dst, 4096));
  ASSERT_EQ(0, c_->StreamCreate(&s0));
  ASSERT_EQ(0, c_->StreamCreate(&s1));
  ASSERT_EQ(0, c_->Memcpy(src, in.data(), 4096, WTX_CUDA_H2D));
  ASSERT_EQ(0, c_->StreamSynchronize(nullptr));
  // Two sends, the second half first; the receives take them in order.
  ASSERT_EQ(0, c_->Send(static_cast<uint8_t *>(src) + 2048, 2048, WTX_NCCL_UINT8, 1, comm[0], s0));
  ASSERT_EQ(0, c_->Send(src, 2048, WTX_NCCL_UINT8, 1, comm[0], s0));
  EXPECT_EQ(WTX_CUDA_NOT_READY, c_->StreamQuery(s0));  // no receive yet: still running
  ASSERT_EQ(0, c_->Recv(static_cast<uint8_t *>(dst) + 2048, 2048, WTX_NCCL_UINT8, 0, comm[1], s1));
  ASSERT_EQ(0, c_->Recv(dst, 2048, WTX_NCCL_UINT8, 0, comm[1], s1));
  ASSERT_EQ(0, c_->StreamSynchronize(s1));
  ASSERT_EQ(0, c_->StreamSynchronize(s0));
  ASSERT_EQ(0, c_->Memcpy(out.data(), dst, 4096, WTX_CUDA_D2H));
  EXPECT_TRUE(out == in);
  // Sizes that differ: both sides' communicators report the error.
  ASSERT_EQ(0, c_->Send(src, 100, WTX_NCCL_UINT8, 1, comm[0], s0));
  ASSERT_EQ(0, c_->Recv(dst, 200, WTX_NCCL_UINT8, 0, comm[1], s1));
  ASSERT_EQ(0, c_->StreamSynchronize(s1));
  int async = 0;
  ASSERT_EQ(0, c_->CommGetAsyncError(comm[1], &async));
  EXPECT_NE(0, async);
  // The send nobody took runs until its communicator is aborted.
  EXPECT_EQ(WTX_CUDA_NOT_READY, c_->StreamQuery(s0));
  EXPECT_EQ(1, running_());
  c_->CommAbort(comm[0]);
  c_->CommAbort(comm[1]);
  EXPECT_EQ(0, running_());
  c_->StreamDestroy(s0);
  c_->StreamDestroy(s1);
  c_->Free(src);
  c_->Free(dst);
}

// A collective that failed on a peer may still end on the stream, with
// whatever its buffer held: the worker reads NCCL's asynchronous error too,
// and fails instead of delivering those bytes.
TEST_F(CudaTest, ABroadcastEndedByAPeersFailureIsAnErrorNotData) {
  void *root = nullptr, *w = nullptr;
  ASSERT_NO_FATAL_FAILURE(JoinBoth(5000, &root, &w));
  // The root posts its bytes, then fails (aborts) before the worker takes
  // them: the worker's broadcast ends without them.
  void *buf = nullptr, *s = nullptr;
  ASSERT_EQ(0, c_->SetDevice(0));
  ASSERT_EQ(0, c_->Malloc(&buf, 4096));
  ASSERT_EQ(0, c_->StreamCreate(&s));
  ASSERT_EQ(0, c_->Broadcast(buf, buf, 4096, WTX_NCCL_UINT8, 0, root, s));
  for (auto t0 = Clock::now(); posted_(root) == 0 && Seconds(t0) < 10;) std::this_thread::yield();
  ASSERT_EQ(1u, posted_(root));  // the bytes are out; the worker has not taken them
  c_->CommAbort(root);
  OneTensorRx r;
  Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
  EXPECT_EQ(WTX_EIO, wtx_nccl_worker_transport.receive(w, &ui, r.rx));
  EXPECT_NE(std::string::npos, r.Error().find("NCCL:")) << r.Error();
  wtx_nccl_worker_transport.destroy(w);
  c_->StreamDestroy(s);
  c_->Free(buf);
}

// In hard mode (WTX_FAKE_CUDA_HARD) a broadcast whose sizes differ hangs,
// as NCCL's does, instead of failing at once: the worker's receive still
// ends, at its timeout, with its broadcast aborted, not left running.
TEST_F(CudaTest, InHardModeAMismatchedBroadcastEndsAtTheTimeoutAndIsAborted) {
  setenv("WTX_FAKE_CUDA_HARD", "1", 1);
  void *root = nullptr, *w = nullptr;
  ASSERT_NO_FATAL_FAILURE(JoinBoth(300, &root, &w));
  void *buf = nullptr, *s = nullptr;
  ASSERT_EQ(0, c_->SetDevice(0));
  ASSERT_EQ(0, c_->Malloc(&buf, 4096));
  ASSERT_EQ(0, c_->StreamCreate(&s));
  ASSERT_EQ(0, c_->Broadcast(buf, buf, 2048, WTX_NCCL_UINT8, 0, root, s));  // 4096 expected
  OneTensorRx r;
  Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
  auto t0 = Clock::now();
  EXPECT_EQ(WTX_ETIMEDOUT, wtx_nccl_worker_transport.receive(w, &ui, r.rx)) << r.Error();
  EXPECT_LT(Seconds(t0), 5.0);
  EXPECT_NE(std::string::npos, r.Error().find("communicator aborted")) << r.Error();
  // The root's broadcast waits for a receiver too (and cudaFree, in the
  // worker's destroy, for every stream of this process, as CUDA's does).
  c_->CommAbort(root);
  EXPECT_EQ(0, running_());
  wtx_nccl_worker_transport.destroy(w);
  unsetenv("WTX_FAKE_CUDA_HARD");
  c_->StreamDestroy(s);
  c_->Free(buf);
}

// A model that stages on the GPU gets the chunk device to device: every
// byte is in its device memory when receive returns (the double lands the
// copies 300 ms late here), and with checksums on they are checked against
// a host copy of the same bytes; the staging itself is never touched from
// the CPU (the double's device memory would crash it).
TEST_F(CudaTest, DeviceStagingIsFilledOnTheGpuBeforeReceiveReturns) {
  void *root = nullptr, *w = nullptr;
  ASSERT_NO_FATAL_FAILURE(JoinBoth(5000, &root, &w));
  EXPECT_EQ(1, wtx_nccl_worker_transport.device(w));
  // Tensors a (200000 bytes) and b (1000: under the bounce threshold) in
  // one chunk, broadcast by the root.
  const size_t na = 200000, nb = 1000, n = na + nb;
  std::vector<uint8_t> in(n);
  for (size_t i = 0; i < n; i++) in[i] = static_cast<uint8_t>(i * 13 + 5);
  uint64_t sums[2] = {XXH3_64bits(in.data(), na), XXH3_64bits(in.data() + na, nb)};
  void *buf = nullptr, *s = nullptr, *sa = nullptr, *sb = nullptr;
  ASSERT_EQ(0, c_->SetDevice(0));
  ASSERT_EQ(0, c_->Malloc(&buf, n));
  ASSERT_EQ(0, c_->StreamCreate(&s));
  ASSERT_EQ(0, c_->Memcpy(buf, in.data(), n, WTX_CUDA_H2D));
  ASSERT_EQ(0, c_->StreamSynchronize(nullptr));
  ASSERT_EQ(0, c_->SetDevice(1));
  ASSERT_EQ(0, c_->Malloc(&sa, na));
  ASSERT_EQ(0, c_->Malloc(&sb, nb));
  setenv("WTX_FAKE_CUDA_LAG_MS", "300", 1);
  ASSERT_EQ(0, c_->Broadcast(buf, buf, n, WTX_NCCL_UINT8, 0, root, s));
  wtx_rx_tensor rt[2] = {{"a", na, static_cast<uint8_t *>(sa)},
                         {"b", nb, static_cast<uint8_t *>(sb)}};
  wtx_rx *rx = nullptr;
  ASSERT_EQ(0, wtx__rx_create(&rx));
  ASSERT_EQ(0, wtx__rx_begin(rx, rt, 2, 0, 0, WTX__RX_VERIFY | WTX__RX_DEVICE));
  wtx__rx_expect_checksums(rx, sums, 2);
  Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
  ASSERT_EQ(0, wtx_nccl_worker_transport.receive(w, &ui, rx)) << wtx__rx_error(rx);
  EXPECT_EQ(0, wtx__rx_end(rx)) << wtx__rx_error(rx);
  unsetenv("WTX_FAKE_CUDA_LAG_MS");
  std::vector<uint8_t> out(n, 0);
  ASSERT_EQ(0, c_->Memcpy(out.data(), sa, na, WTX_CUDA_D2H));
  ASSERT_EQ(0, c_->Memcpy(out.data() + na, sb, nb, WTX_CUDA_D2H));
  EXPECT_TRUE(out == in) << "device staging read before its copies landed";
  wtx__rx_destroy(rx);
  wtx_nccl_worker_transport.destroy(w);
  c_->CommDestroy(root);
  c_->StreamDestroy(s);
  for (void *p : {buf, sa, sb}) c_->Free(p);
}

// The worker's GPU comes from its options (a vLLM rank names its own), else
// from WTX_CUDA_DEVICE; anything but an ordinal is refused, naming where it
// came from.
TEST_F(CudaTest, TheWorkersDeviceComesFromItsOptionsOrTheEnvironment) {
  wtx_wire_params wire{1, 1 << 20, 2, 2, 5000};
  Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
  wtx_worker_env env{};
  char err[600] = "";
  void *w = nullptr;
  setenv("WTX_CUDA_DEVICE", "2", 1);
  ASSERT_EQ(0, wtx_cuda_ipc_worker_transport.init(&ii, &wire, &env, &w, err, sizeof err)) << err;
  EXPECT_EQ(2, wtx_cuda_ipc_worker_transport.device(w));
  wtx_cuda_ipc_worker_transport.destroy(w);
  env.cuda_device = "3";
  ASSERT_EQ(0, wtx_cuda_ipc_worker_transport.init(&ii, &wire, &env, &w, err, sizeof err)) << err;
  EXPECT_EQ(3, wtx_cuda_ipc_worker_transport.device(w));
  wtx_cuda_ipc_worker_transport.destroy(w);
  env.cuda_device = "cuda:1";
  EXPECT_EQ(WTX_EINVAL, wtx_cuda_ipc_worker_transport.init(&ii, &wire, &env, &w, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "cuda_device: not a device ordinal")) << err;
  env.cuda_device = nullptr;
  setenv("WTX_CUDA_DEVICE", "-1", 1);
  EXPECT_EQ(WTX_EINVAL, wtx_cuda_ipc_worker_transport.init(&ii, &wire, &env, &w, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "WTX_CUDA_DEVICE: not a device ordinal")) << err;
}

}  // namespace
