// The GPU backends on the real CUDA runtime and NCCL (no test double): run by
// tests/gpu/run.sh on a machine with an NVIDIA GPU. Without one every test
// reports SKIPPED with the reason, never passed.
#include <dlfcn.h>
#include <unistd.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "tests/client/harness.h"

namespace {

using wtxtest::EngineTest;
using wtxtest::Worker;

// Whether this machine has an NVIDIA GPU, asked of the driver, not of the
// CUDA runtime: a GPU machine whose runtime cannot be found must fail.
bool HasGpu() {
  return access("/dev/nvidiactl", F_OK) == 0 || access("/proc/driver/nvidia/gpus", F_OK) == 0;
}

// GPUs visible through the real CUDA runtime (WTX_GPU_CUDART names it when
// it is not on the loader's path, e.g. in a torch wheel); 0 with the
// reason when none.
int DeviceCount(std::string *why) {
  void *h = nullptr;
  const char *named = getenv("WTX_GPU_CUDART");
  if (named != nullptr && named[0] != '\0') h = dlopen(named, RTLD_NOW | RTLD_LOCAL);
  for (const char *lib : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"})
    if (h == nullptr) h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (h == nullptr) {
    *why = "no CUDA runtime (libcudart) on this machine";
    return 0;
  }
  auto count = reinterpret_cast<int (*)(int *)>(dlsym(h, "cudaGetDeviceCount"));
  int n = 0;
  if (count == nullptr || count(&n) != 0 || n == 0) {
    *why = "no NVIDIA GPU visible to the CUDA runtime";
    return 0;
  }
  return n;
}

class GpuTest : public EngineTest {
 protected:
  void SetUp() override {
    EngineTest::SetUp();
    // The real libraries, never the double: WTX_GPU_CUDART / WTX_GPU_NCCL
    // (tests/gpu/device_check.sh finds them) or the loader's path.
    const char *rt = getenv("WTX_GPU_CUDART"), *nccl = getenv("WTX_GPU_NCCL");
    if (rt != nullptr) setenv("WTX_CUDART_LIB", rt, 1);
    else unsetenv("WTX_CUDART_LIB");
    if (nccl != nullptr) setenv("WTX_NCCL_LIB", nccl, 1);
    else unsetenv("WTX_NCCL_LIB");
    gpus_ = DeviceCount(&why_);
    if (gpus_ == 0 && HasGpu()) FAIL() << "this machine has an NVIDIA GPU but " << why_;
    if (gpus_ == 0) GTEST_SKIP() << why_;
  }
  int gpus_ = 0;
  std::string why_;
};

TEST_P(GpuTest, PushesToWorkerProcessesAndEveryChecksumMatches) {
  size_t n_workers = 2;
  if (std::string(GetParam()) == "nccl") {
    // One GPU per rank: the trainer (rank 0) plus each worker.
    if (gpus_ < 2) GTEST_SKIP() << "nccl needs 2 GPUs (trainer + worker), this machine has "
                                << gpus_;
    n_workers = static_cast<size_t>(std::min(gpus_ - 1, 2));
  }
  std::vector<Worker> ws;
  for (size_t i = 0; i < n_workers; i++) {
    // cuda_ipc: every process on GPU 0; nccl: worker i on GPU i+1.
    std::string dev = std::string(GetParam()) == "nccl" ? std::to_string(i + 1) : "0";
    setenv("WTX_CUDA_DEVICE", dev.c_str(), 1);
    ws.push_back(Spawn());
  }
  setenv("WTX_CUDA_DEVICE", "0", 1);
  wtx_client *c = Client(ws);
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(UINT64_C(512) << 20, 11, &src));
  for (const char *v : {"gpu-1", "gpu-2"}) {
    std::vector<uint64_t> sums;
    std::string err;
    ASSERT_EQ(0, Push(c, src, v, 64 << 20, 2, 60000, &err, &sums)) << err;
    EXPECT_EQ(0, wtx_client_verify(c, src, sums.data())) << wtx_client_last_error(c);
    for (const Worker &w : ws) EXPECT_EQ(v, Version(w));
  }
  wtx_source_destroy(src);
  wtx_client_destroy(c);
}

// A model that lives on the GPU (tests/client/gpu_model_worker: it stages
// on the device and refuses host staging) gets every byte device to
// device, and each tensor's device bytes hash to what the trainer sent
// (checked by the worker at prepare, so the push fails otherwise).
TEST_P(GpuTest, AModelOnTheGpuIsStagedThereAndReceivesEveryByte) {
  if (std::string(GetParam()) == "nccl" && gpus_ < 2)
    GTEST_SKIP() << "nccl needs 2 GPUs (trainer + worker), this machine has " << gpus_;
  worker_binary_ = "tests/client/gpu_model_worker";
  std::string dev = std::string(GetParam()) == "nccl" ? "1" : "0";
  setenv("WTX_CUDA_DEVICE", dev.c_str(), 1);
  std::vector<Worker> ws = {Spawn()};
  setenv("WTX_CUDA_DEVICE", "0", 1);
  wtx_client *c = Client(ws);
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(UINT64_C(256) << 20, 12, &src));
  for (const char *v : {"gpu-model-1", "gpu-model-2"}) {
    std::string err;
    ASSERT_EQ(0, Push(c, src, v, 64 << 20, 2, 60000, &err)) << err;
  }
  wtx_source_destroy(src);
  wtx_client_destroy(c);
}

// cuda_ipc direct receive on real CUDA: the trainer writes into the
// worker's region and a model that adopts it (--in-place-only refuses any
// other staging) gets every byte, checked on the device against the
// session's checksums.
TEST_P(GpuTest, DirectReceiveLandsInTheWorkersRegion) {
  if (std::string(GetParam()) != "cuda_ipc") GTEST_SKIP() << "cuda_ipc only";
  worker_binary_ = "tests/client/gpu_model_worker";
  direct_ = 1;
  setenv("WTX_CUDA_DEVICE", "0", 1);
  std::vector<Worker> ws = {Spawn({"--in-place-only"})};
  wtx_client *c = Client(ws);
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(UINT64_C(256) << 20, 13, &src));
  for (const char *v : {"direct-1", "direct-2"}) {
    std::string err;
    ASSERT_EQ(0, Push(c, src, v, 64 << 20, 2, 60000, &err)) << err;
    EXPECT_EQ(1, last_direct_) << v;
  }
  wtx_source_destroy(src);
  wtx_client_destroy(c);
}

// The GPU backends' default, checksums off, on real CUDA: the session
// verifies nothing, so the worker's model hashes its device bytes (a copy
// to the host) and the test compares them with its own hashes of the
// trainer's tensors, staged on the device and received in place.
TEST_P(GpuTest, WithChecksumsOffEveryByteLandsAsTheTestHashesIt) {
  if (std::string(GetParam()) == "nccl" && gpus_ < 2)
    GTEST_SKIP() << "nccl needs 2 GPUs (trainer + worker), this machine has " << gpus_;
  worker_binary_ = "tests/client/gpu_model_worker";
  std::string dev = std::string(GetParam()) == "nccl" ? "1" : "0", sums = dir_ + "/sums";
  setenv("WTX_CUDA_DEVICE", dev.c_str(), 1);
  std::vector<Worker> ws = {Spawn({"--sums", sums})};
  setenv("WTX_CUDA_DEVICE", "0", 1);
  wtx_client *c = Client(ws);
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(UINT64_C(256) << 20, 14, &src));
  std::map<std::string, uint64_t> want = HostSums(src);
  checksum_ = WTX_CHECKSUM_NONE;
  for (int direct : {0, 1}) {
    direct_ = direct;
    std::string err, v = "off-" + std::to_string(direct), got_version;
    std::remove(sums.c_str());
    ASSERT_EQ(0, Push(c, src, v.c_str(), 64 << 20, 2, 60000, &err)) << err;
    EXPECT_EQ(want, DeviceSums(sums, &got_version)) << v;
    EXPECT_EQ(v, got_version);
  }
  wtx_source_destroy(src);
  wtx_client_destroy(c);
}

// A delta's patches into a model staging on the GPU, on real CUDA: a
// chunk carrying a patch is received on the host, the patch applied to
// the published tensor read back from the device (gpu_model_worker
// --read), and the chunk's tensors copied to their device staging. One
// delta of whole tensors around a patch in 64 KiB chunks, so tensors run
// into and out of the chunk that carries it, then patches alone; the
// model's device bytes are compared with the test's own hashes each time.
TEST_P(GpuTest, PatchesReachAModelStagingOnTheGpu) {
  if (std::string(GetParam()) == "nccl" && gpus_ < 2)
    GTEST_SKIP() << "nccl needs 2 GPUs (trainer + worker), this machine has " << gpus_;
  wtxtest::FloatModel model(12);
  worker_binary_ = "tests/client/gpu_model_worker";
  std::string dev = std::string(GetParam()) == "nccl" ? "1" : "0", sums = dir_ + "/sums";
  setenv("WTX_CUDA_DEVICE", dev.c_str(), 1);
  std::vector<Worker> ws = {Spawn({"--read", "--sums", sums})};
  setenv("WTX_CUDA_DEVICE", "0", 1);
  wtx_client *c = Client(ws);
  wtx_source *src = model.Source();
  wtx_trainer *t = DeltaTrainer(c, src, WTX_DELTA_PATCHES, 60000);
  ASSERT_NE(nullptr, t);
  auto sync = [&](const char *v, wtx_send_result *res) {
    wtx_send_options so = WTX_SEND_OPTIONS_INIT;
    so.version = v;
    ASSERT_EQ(0, wtx_trainer_send_weights(t, &so, res)) << v << ": " << wtx_trainer_last_error(t);
    std::string got;
    EXPECT_EQ(model.Hashes(), DeviceSums(sums, &got)) << v;
    EXPECT_EQ(v, got);
  };
  wtx_send_result res;
  sync("p0", &res);
  for (size_t i : {1, 2, 4, 6, 8})
    for (auto &b : model.data[i]) b ^= 0x33;
  model.Set(5, 100, 2.0f);
  sync("p1", &res);
  EXPECT_EQ(1, res.delta);
  EXPECT_EQ(1u, res.patched_params);
  model.Set(0, 7, 2.0f);
  model.Set(11, 3, 2.0f);
  sync("p2", &res);
  EXPECT_EQ(2u, res.patched_params);
  wtx_trainer_shutdown(t);
  wtx_source_destroy(src);
  wtx_client_destroy(c);
}

INSTANTIATE_TEST_SUITE_P(RealCuda, GpuTest, ::testing::Values("cuda_ipc", "nccl"),
                         [](const auto &info) { return std::string(info.param); });

}  // namespace
