// The trainer engine end to end against wtx-worker processes on loopback,
// over both host backends and, on a test double of CUDA and NCCL, both GPU
// backends: full pushes with checksums compared on every worker, the
// fan-out rules with a failing replica, a source whose iteration disagrees
// with its metadata, and a worker killed mid-transfer.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "wtx/client.h"
#include "client/engine.h"
#include "client/fanout.h"
#include "common/safetensors.h"
#include "tests/client/harness.h"
#include "tests/common/dir_wait.h"
#include "transport/transport.h"

namespace {

using wtxtest::EngineTest;
using wtxtest::Worker;

// A model of 512 MiB in many tensors of mixed dtypes, one of them larger
// than the 16 MiB buffer, to one worker and then to three.
struct MixedModel {
  std::vector<std::vector<uint8_t>> data;
  std::vector<std::vector<uint64_t>> shapes;
  std::vector<std::string> names;
  std::vector<wtx_memory_tensor> tensors;
  MixedModel() {
    const int dtypes[] = {WTX_DTYPE_BFLOAT16, WTX_DTYPE_FLOAT32, WTX_DTYPE_FLOAT16,
                          WTX_DTYPE_INT8, WTX_DTYPE_UINT8, WTX_DTYPE_INT32};
    const size_t elsize[] = {2, 4, 2, 1, 1, 4};
    uint64_t total = 0, x = 0x9e3779b97f4a7c15ULL;
    for (int i = 0; total < (UINT64_C(512) << 20); i++) {
      int d = i % 6;
      // Mostly 1..9 MiB; tensor 7 is 40 MiB, larger than a buffer.
      uint64_t bytes = i == 7 ? (UINT64_C(40) << 20) : (UINT64_C(1) << 20) * (1 + i % 9) + 64 * i;
      uint64_t rows = 64, cols = bytes / elsize[d] / rows;
      shapes.push_back({rows, cols});
      names.push_back("model.layers." + std::to_string(i / 4) + ".w" + std::to_string(i % 4));
      data.emplace_back(rows * cols * elsize[d]);
      for (size_t k = 0; k + 8 <= data.back().size(); k += 8) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        memcpy(&data.back()[k], &x, 8);
      }
      total += data.back().size();
    }
    for (size_t i = 0; i < data.size(); i++)
      tensors.push_back({names[i].c_str(), dtypes[i % 6], shapes[i].data(), 2, data[i].data(), 0});
  }
};

TEST_P(EngineTest, PushesHalfAGigabyteOfMixedDtypesToOneThenThreeWorkerProcesses) {
  static MixedModel model;  // built once for every backend
  wtx_source *src = nullptr;
  char e[512] = "";
  ASSERT_EQ(0, wtx_source_memory(model.tensors.data(), model.tensors.size(), &src, e,
                                 sizeof e))
      << e;
  uint64_t total = 0;
  wtx_source_total_bytes(src, &total);
  ASSERT_GE(total, UINT64_C(512) << 20);
  Worker w0 = Spawn();
  std::vector<std::vector<Worker>> groups = {{w0}, {w0, Spawn(), Spawn()}};
  int round = 0;
  for (const auto &ws : groups) {
    wtx_client *c = Client(ws);
    std::string v = "mixed-" + std::to_string(++round), err;
    std::vector<uint64_t> sums;
    // Four buffers: on shm and cuda_ipc each chunk's call leaves before
    // the answer to the one before.
    ASSERT_EQ(0, Push(c, src, v.c_str(), 16 << 20, 4, 60000, &err, &sums)) << err;
    // Every worker's published checksums equal the trainer's.
    EXPECT_EQ(0, wtx_client_verify(c, src, sums.data())) << wtx_client_last_error(c);
    for (size_t i = 0; i < ws.size(); i++) {
      wtx_weight_info info;
      ASSERT_EQ(0, wtx_client_weight_info(c, i, 0, &info));
      EXPECT_STREQ(v.c_str(), info.version);
      EXPECT_EQ(total, info.total_bytes);
      EXPECT_EQ(model.tensors.size(), info.num_params);
      wtx_weight_info_free(&info);
    }
    wtx_client_destroy(c);
  }
  wtx_source_destroy(src);
}

// Mixed dtypes, an empty tensor, one tensor larger than the buffer, three
// workers, buffers from 1 KiB to 1 GiB.
TEST_P(EngineTest, MixedDtypesAndATensorLargerThanTheBufferReachThreeWorkers) {
  Worker w0 = Spawn(), w1 = Spawn(), w2 = Spawn();
  wtx_client *c = Client({w0, w1, w2});
  std::vector<uint8_t> big(3 << 20), small(1000), bf(4096), i8(77);
  for (size_t i = 0; i < big.size(); i++) big[i] = (uint8_t)(i * 31 + 7);
  for (size_t i = 0; i < bf.size(); i++) bf[i] = (uint8_t)(i ^ 0x5a);
  uint64_t s_big[2] = {768, 1024}, s_small[1] = {250}, s_bf[2] = {32, 64}, s_i8[1] = {77},
           s_empty[2] = {0, 5};
  wtx_memory_tensor ts[] = {
      {"model.layers.0.big", WTX_DTYPE_FLOAT32, s_big, 2, big.data(), 0},
      {"model.layers.0.small", WTX_DTYPE_INT32, s_small, 1, small.data(), 0},
      {"model.layers.1.bf", WTX_DTYPE_BFLOAT16, s_bf, 2, bf.data(), 0},
      {"model.layers.1.empty", WTX_DTYPE_FLOAT16, s_empty, 2, nullptr, 0},
      {"lm_head.q", WTX_DTYPE_INT8, s_i8, 1, i8.data(), 0},
  };
  wtx_source *src = nullptr;
  char e[512] = "";
  ASSERT_EQ(0, wtx_source_memory(ts, 5, &src, e, sizeof e)) << e;
  int round = 0;
  for (uint64_t buffer : {UINT64_C(1) << 10, UINT64_C(1) << 20, UINT64_C(1) << 30}) {
    std::string v = "v" + std::to_string(++round), err;
    std::vector<uint64_t> sums;
    big[5] ^= (uint8_t)round;  // new content every round
    ASSERT_EQ(0, Push(c, src, v.c_str(), buffer, buffer > (1u << 20) ? 1 : 2, 60000,
                      &err, &sums))
        << "buffer " << buffer << ": " << err;
    EXPECT_EQ(0, wtx_client_verify(c, src, sums.data())) << wtx_client_last_error(c);
    for (const Worker &w : {w0, w1, w2}) EXPECT_EQ(v, Version(w));
  }
  wtx_source_destroy(src);
  wtx_client_destroy(c);
}

// Thousands of tensors of 1..97 bytes around two larger than the buffer:
// a tcp chunk sent in place is hundreds of pieces (more than one sendmsg
// takes), resumed after short writes; every worker's checksums match.
TEST_P(EngineTest, ThousandsOfSmallTensorsAroundLargeOnesArriveExact) {
  const size_t n = 3000;
  std::vector<std::vector<uint8_t>> data(n);
  std::vector<std::string> names(n);
  std::vector<uint64_t> shapes(n);
  std::vector<wtx_memory_tensor> ts(n);
  for (size_t i = 0; i < n; i++) {
    shapes[i] = i % 1000 == 500 ? (3u << 20) + 5 : 1 + (i * 7) % 97;
    data[i].resize(shapes[i]);
    for (size_t k = 0; k < shapes[i]; k++) data[i][k] = static_cast<uint8_t>(i * 131 + k * 7);
    names[i] = "model.layers." + std::to_string(i / 100) + ".p" + std::to_string(i);
    ts[i] = {names[i].c_str(), WTX_DTYPE_UINT8, &shapes[i], 1, data[i].data(), 0};
  }
  wtx_source *src = nullptr;
  char e[512] = "";
  ASSERT_EQ(0, wtx_source_memory(ts.data(), n, &src, e, sizeof e)) << e;
  std::vector<Worker> ws = {Spawn(), Spawn()};
  wtx_client *c = Client(ws);
  std::vector<uint64_t> sums;
  PushAndVerify(c, ws, src, "small", &sums);
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

// An MoE-sized checkpoint: more tiny tensors than one chunk may name
// (WTX_MAX_CHUNK_PARAMS), all of which fit one buffer, so the trainer must
// cut by count as well as by bytes. Twice: the second sync names them by
// position (UpdateInfo.layout), in ranges that span the chunks.
TEST_P(EngineTest, MoreTinyTensorsThanAChunkMayNameArriveExactTwice) {
  const size_t n = WTX_MAX_CHUNK_PARAMS + 4464;
  std::vector<std::vector<uint8_t>> data(n);
  std::vector<std::string> names(n);
  std::vector<uint64_t> shapes(n);
  std::vector<wtx_memory_tensor> ts(n);
  for (size_t i = 0; i < n; i++) {
    shapes[i] = 1 + i % 13;
    data[i].resize(shapes[i]);
    for (size_t k = 0; k < shapes[i]; k++) data[i][k] = static_cast<uint8_t>(i * 31 + k);
    names[i] = "model.layers." + std::to_string(i / 1000) + ".experts." + std::to_string(i);
    ts[i] = {names[i].c_str(), WTX_DTYPE_UINT8, &shapes[i], 1, data[i].data(), 0};
  }
  wtx_source *src = nullptr;
  char e[512] = "";
  ASSERT_EQ(0, wtx_source_memory(ts.data(), n, &src, e, sizeof e)) << e;
  std::vector<Worker> ws = {Spawn()};
  wtx_client *c = Client(ws);
  std::vector<uint64_t> sums;
  PushAndVerify(c, ws, src, "moe1", &sums);
  for (size_t i = 0; i < n; i += 997) data[i][0] ^= 0x5a;  // the next step's weights
  PushAndVerify(c, ws, src, "moe2", &sums);
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

TEST_P(EngineTest, AFailingReplicaFailsTheSyncByNameAndTheOthersKeepTheirWeights) {
  // Replica 1 declares another layout, so it refuses the update that
  // replica 0 accepts and stages.
  std::string spec = dir_ + "/spec.safetensors";
  std::vector<uint8_t> x(8);
  wtx_st_tensor other = {{"other.weight", WTX_DTYPE_UINT8, {8}, 1, 8}, x.data()};
  char e[512] = "";
  ASSERT_EQ(0, wtx_st_write(spec.c_str(), &other, 1, nullptr, 0, e, sizeof e));
  Worker a = Spawn(), b = Spawn({"--model-spec", spec});
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(4 << 20, 1, &src));
  wtx_client *ca = Client({a});
  std::string err;
  ASSERT_EQ(0, Push(ca, src, "before", 1 << 20, 2, 60000, &err)) << err;
  wtx_client_destroy(ca);

  wtx_client *c = Client({a, b});
  EXPECT_EQ(WTX_ENOENT, Push(c, src, "after", 1 << 20, 2, 60000, &err));
  EXPECT_NE(std::string::npos, err.find("worker 1 (" + b.addr() + ")")) << err;
  EXPECT_NE(std::string::npos, err.find("NOT_FOUND")) << err;
  EXPECT_NE(std::string::npos, err.find("is not in the model")) << err;
  EXPECT_EQ(1, wtx_client_last_replica(c));
  EXPECT_EQ("before", Version(a));  // aborted on the healthy replica too
  wtx_client_destroy(c);

  // An unreachable replica: the sync fails at once, naming it.
  Worker gone = Spawn();
  Stop(gone);
  c = Client({a, gone}, 5000);
  EXPECT_NE(0, Push(c, src, "after", 1 << 20, 2, 5000, &err));
  EXPECT_NE(std::string::npos, err.find("worker 1 (" + gone.addr() + ")")) << err;
  EXPECT_NE(std::string::npos, err.find("UNAVAILABLE")) << err;
  EXPECT_EQ("before", Version(a));
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

// A chunk in the middle of a sync refused by one replica fails the sync
// with that refusal, though on shm the next chunk's call is already in
// flight there (it then finds the update ended), and every replica keeps
// what it served; the next sync goes through.
TEST_P(EngineTest, AChunkRefusedMidSyncFailsItWithItsOwnErrorWhileTheNextIsInFlight) {
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(8 << 20, 3, &src));
  const wtx_tensor_meta *metas = nullptr;
  size_t n = 0;
  ASSERT_EQ(0, wtx_source_metadata(src, &metas, &n));
  ASSERT_GT(n, 4u);
  // Replica 1's model lacks one tensor past the first chunks.
  size_t missing = n * 2 / 3;
  std::vector<uint8_t> zeros(8 << 20);
  std::vector<wtx_st_tensor> spec;
  for (size_t i = 0; i < n; i++)
    if (i != missing) spec.push_back({metas[i], zeros.data()});
  std::string path = dir_ + "/most.safetensors";
  char e[512] = "";
  ASSERT_EQ(0, wtx_st_write(path.c_str(), spec.data(), spec.size(), nullptr, 0, e, sizeof e))
      << e;
  Worker a = Spawn(), b = Spawn({"--model-spec", path});
  wtx_client *ca = Client({a});
  std::string err;
  ASSERT_EQ(0, Push(ca, src, "before", 1 << 20, 4, 60000, &err)) << err;
  wtx_client *c = Client({a, b});
  EXPECT_EQ(WTX_ENOENT, Push(c, src, "after", 1 << 20, 4, 60000, &err));
  EXPECT_NE(std::string::npos, err.find("worker 1 (" + b.addr() + ")")) << err;
  EXPECT_NE(std::string::npos, err.find(std::string("'") + metas[missing].name +
                                        "' is not in the model")) << err;
  EXPECT_EQ("before", Version(a));
  EXPECT_EQ("", Version(b));
  ASSERT_EQ(0, Push(ca, src, "again", 1 << 20, 4, 60000, &err)) << err;
  EXPECT_EQ("again", Version(a));
  wtx_client_destroy(c);
  wtx_client_destroy(ca);
  wtx_source_destroy(src);
}

// What the sources of these tests share: metadata from metas, a pass that
// is a position, and S::Next for the tensors.
template <class S>
struct TestSource {
  std::vector<wtx_tensor_meta> metas;
  static int Metadata(void *self, const wtx_tensor_meta **m, size_t *n) {
    auto *s = static_cast<S *>(self);
    *m = s->metas.data();
    *n = s->metas.size();
    return 0;
  }
  static int Open(void *, void **iter) {
    *iter = new size_t(0);
    return 0;
  }
  static void Close(void *, void *iter) { delete static_cast<size_t *>(iter); }
  static wtx_source_ops Ops(const char *name) {
    return {WTX_SOURCE_OPS_VERSION, name, Metadata, Open, S::Next, Close, nullptr, nullptr,
            nullptr};
  }
};

// A source whose iteration yields a different shape than its metadata.
struct LyingSource : TestSource<LyingSource> {
  LyingSource() {
    metas.resize(3);
    const char *names[] = {"a", "b", "c"};
    for (int i = 0; i < 3; i++) {
      metas[i] = wtx_tensor_meta{};
      metas[i].name = names[i];
      metas[i].dtype = WTX_DTYPE_FLOAT32;
      metas[i].shape[0] = 16;
      metas[i].ndim = 1;
      metas[i].nbytes = 64;
    }
  }
  std::vector<uint8_t> data = std::vector<uint8_t>(64, 9);
  static int Next(void *self, void *iter, wtx_tensor_meta *meta, const uint8_t **data) {
    auto *s = static_cast<LyingSource *>(self);
    size_t &i = *static_cast<size_t *>(iter);
    if (i == 3) return 0;
    *meta = s->metas[i];
    if (i == 2) meta->shape[0] = 8;  // metadata says 16
    *data = s->data.data();
    i++;
    return 1;
  }
};
const wtx_source_ops kLying = LyingSource::Ops("lying");

TEST_P(EngineTest, IterationDisagreeingWithMetadataIsCaughtBeforeTheWire) {
  Worker a = Spawn();
  LyingSource ls;
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_create(&kLying, &ls, &src));
  wtx_client *c = Client({a});
  std::string err;
  EXPECT_EQ(WTX_EINVAL, Push(c, src, "lie", 1 << 20, 2, 60000, &err));
  EXPECT_NE(std::string::npos,
            err.find("parameter 2 of the iteration is 'c' shape [8] FLOAT32 but "
                     "metadata() says 'c' shape [16] FLOAT32"))
      << err;
  EXPECT_EQ("", Version(a));  // nothing was published
  wtx_weight_info info;
  ASSERT_EQ(0, wtx_client_weight_info(c, 0, 0, &info));
  EXPECT_EQ(0u, info.num_params);
  wtx_weight_info_free(&info);
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

// The CUDA runtime the engine loads (the TEST DOUBLE here, the same
// library instance): device memory for a test's tensors.
struct DeviceMemory {
  int (*malloc_)(void **, size_t) = nullptr;
  int (*free_)(void *) = nullptr;
  int (*memcpy_)(void *, const void *, size_t, int) = nullptr;
  std::vector<void *> held;
  DeviceMemory() {
    void *h = dlopen(getenv("WTX_CUDART_LIB"), RTLD_NOW | RTLD_LOCAL);
    if (h == nullptr) abort();
    malloc_ = reinterpret_cast<decltype(malloc_)>(dlsym(h, "cudaMalloc"));
    free_ = reinterpret_cast<decltype(free_)>(dlsym(h, "cudaFree"));
    memcpy_ = reinterpret_cast<decltype(memcpy_)>(dlsym(h, "cudaMemcpy"));
  }
  ~DeviceMemory() {
    for (void *p : held) free_(p);
  }
  // A device copy of bytes.
  void *Upload(const std::vector<uint8_t> &bytes) {
    void *d = nullptr;
    if (malloc_(&d, bytes.size()) != 0 || memcpy_(d, bytes.data(), bytes.size(), 1) != 0)
      abort();
    held.push_back(d);
    return d;
  }
};

// A model with two of every three tensors in device memory, one larger
// than a buffer, as the memory source's tensors and as a source of its own
// whose next says 3 (device memory that stays put).
struct DeviceModel : TestSource<DeviceModel> {
  static constexpr size_t kN = 12;
  DeviceMemory dm;
  std::vector<std::vector<uint8_t>> bytes;
  std::vector<std::string> names;
  std::vector<uint64_t> shapes;
  std::vector<wtx_memory_tensor> ts;
  DeviceModel() : bytes(kN), names(kN), shapes(kN), ts(kN) {
    metas.resize(kN);
    for (size_t i = 0; i < kN; i++) {
      shapes[i] = i == 4 ? (3u << 20) + 3 : 1000 + i * 4099;
      bytes[i].resize(shapes[i]);
      for (size_t k = 0; k < shapes[i]; k++) bytes[i][k] = static_cast<uint8_t>(i * 31 + k * 17);
      names[i] = "model.layers." + std::to_string(i) + ".w";
      int device = i % 3 != 1;
      const void *data = device ? dm.Upload(bytes[i]) : bytes[i].data();
      ts[i] = {names[i].c_str(), WTX_DTYPE_UINT8, &shapes[i], 1, data, device};
      char e[200];
      if (wtx_tensor_meta_set(&metas[i], names[i].c_str(), WTX_DTYPE_UINT8, &shapes[i], 1, e,
                              sizeof e) != 0)
        abort();
    }
  }
  static int Next(void *self, void *iter, wtx_tensor_meta *meta, const uint8_t **data) {
    auto *m = static_cast<DeviceModel *>(self);
    size_t &i = *static_cast<size_t *>(iter);
    if (i == kN) return 0;
    *meta = m->metas[i];
    *data = static_cast<const uint8_t *>(m->ts[i].data);
    return m->ts[i++].device ? 3 : 2;
  }
};
const wtx_source_ops kDeviceModel = DeviceModel::Ops("device");

// On the GPU backends device tensors go device to device into the
// trainer's buffers (put_device; their host copies only feed the
// checksums), on the host backends through a host copy; every worker's
// checksums match either way, from either kind of source.
TEST_P(EngineTest, DeviceTensorsAmongHostOnesArriveExact) {
  DeviceModel model;
  std::vector<Worker> ws = {Spawn(), Spawn()};
  wtx_client *c = Client(ws);
  for (int own : {0, 1}) {
    wtx_source *src = nullptr;
    char e[512] = "";
    if (own) ASSERT_EQ(0, wtx_source_create(&kDeviceModel, &model, &src));
    else ASSERT_EQ(0, wtx_source_memory(model.ts.data(), model.kN, &src, e, sizeof e)) << e;
    std::string v = own ? "own" : "memory";
    std::vector<uint64_t> sums;
    PushAndVerify(c, ws, src, v, &sums);
    ASSERT_EQ(model.kN, sums.size()) << v;
    for (size_t i = 0; i < model.kN; i++)
      EXPECT_EQ(XXH3_64bits(model.bytes[i].data(), model.bytes[i].size()), sums[i])
          << v << ": " << model.names[i];
    wtx_source_destroy(src);
  }
  wtx_client_destroy(c);
}

// A source as a trainer copying device tensors to the host one at a time
// would be: odd tensors come from one scratch buffer that the next call
// overwrites (next returns 1), even ones from memory that stays put (2).
struct ScratchSource : TestSource<ScratchSource> {
  static constexpr size_t kN = 400;
  std::vector<std::string> names;
  std::vector<std::vector<uint8_t>> kept;
  std::vector<uint8_t> scratch;
  ScratchSource() : names(kN), kept(kN) {
    metas.resize(kN);
    for (size_t i = 0; i < kN; i++) {
      names[i] = "model.layers." + std::to_string(i / 10) + ".p" + std::to_string(i);
      uint64_t shape = i % 50 == 7 ? (600u << 10) : 1 + (i * 37) % 5000;
      char e[200];
      if (wtx_tensor_meta_set(&metas[i], names[i].c_str(), WTX_DTYPE_UINT8, &shape, 1, e,
                              sizeof e) != 0)
        abort();
      kept[i].resize(shape);
      Fill(i, kept[i].data());
    }
  }
  void Fill(size_t i, uint8_t *d) const {
    for (uint64_t k = 0; k < metas[i].nbytes; k++) d[k] = static_cast<uint8_t>(i * 7 + k * 13);
  }
  static int Next(void *self, void *iter, wtx_tensor_meta *meta, const uint8_t **data) {
    auto *s = static_cast<ScratchSource *>(self);
    size_t &i = *static_cast<size_t *>(iter);
    if (i == kN) return 0;
    *meta = s->metas[i];
    int stays = i % 2 == 0;
    if (stays) {
      *data = s->kept[i].data();
    } else {
      s->scratch.assign(meta->nbytes, 0);  // the previous copy is gone
      s->Fill(i, s->scratch.data());
      *data = s->scratch.data();
    }
    i++;
    return stays ? 2 : 1;
  }
};
const wtx_source_ops kScratch = ScratchSource::Ops("scratch");

// Tensors a source copies into a buffer it reuses are copied before the
// next one is asked for; the ones that stay put may be sent in place. Every
// byte arrives either way.
TEST_P(EngineTest, TensorsFromAReusedBufferAndTensorsInPlaceBothArriveExact) {
  ScratchSource ss;
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_create(&kScratch, &ss, &src));
  std::vector<Worker> ws = {Spawn(), Spawn()};
  wtx_client *c = Client(ws);
  std::vector<uint64_t> sums;
  PushAndVerify(c, ws, src, "mixed", &sums);
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

// Trainer halves that corrupt one byte of one chunk after it was packed and
// checksummed: what a flipped bit on the way would look like to a worker.
// TEST DOUBLES wrapping each real trainer half, registered under names of
// their own ("corrupt_shm", ...) and chosen by that name; they corrupt
// nothing unless a test asks.
std::atomic<int> g_corrupt_chunk{-1}, g_chunks{0};
wtx_trainer_transport g_corrupting[4];

// tcp hashes each piece as it sends it, so a byte changed before the send
// would be hashed as sent: there the bit flips on the wire instead, in a
// TEST DOUBLE of a faulty link between the trainer and worker 0 that
// forwards the stream record by record (hello, then per chunk its header,
// bytes and checksum trailer) and, once armed, flips a byte in the middle
// of the next chunk's bytes.
std::atomic<bool> g_flip_next_chunk{false};

bool ReadAll(int fd, void *p, size_t n) {
  return recv(fd, p, n, MSG_WAITALL) == static_cast<ssize_t>(n);
}
bool WriteAll(int fd, const void *p, size_t n) {
  return send(fd, p, n, MSG_NOSIGNAL) == static_cast<ssize_t>(n);
}
uint64_t Le64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

// Forwards n bytes from in to out; flips the middle one when flip.
bool Forward(int in, int out, uint64_t n, bool flip) {
  std::vector<uint8_t> buf(1 << 16);
  for (uint64_t done = 0; done < n;) {
    size_t k = static_cast<size_t>(std::min<uint64_t>(buf.size(), n - done));
    if (!ReadAll(in, buf.data(), k)) return false;
    if (flip && done <= n / 2 && n / 2 < done + k) buf[n / 2 - done] ^= 0x10;
    if (!WriteAll(out, buf.data(), k)) return false;
    done += k;
  }
  return true;
}

void FaultyLink(int lfd, std::string target) {
  int w = accept(lfd, nullptr, nullptr);
  close(lfd);
  if (w < 0) return;
  int t = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(target.substr(target.rfind(':') + 1))));
  bool ok = connect(t, reinterpret_cast<sockaddr *>(&a), sizeof a) == 0 &&
            Forward(w, t, 76, false);  // the hello, upstream
  while (ok) {
    uint8_t head[32];  // frame header: chunk_bytes at 24
    ok = ReadAll(t, head, 32) && WriteAll(w, head, 32) &&
         Forward(t, w, Le64(head + 24), g_flip_next_chunk.exchange(false));
    uint8_t trailer[16];  // "WTXS", count at 4
    ok = ok && ReadAll(t, trailer, 16) && WriteAll(w, trailer, 16) &&
         Forward(t, w, 8 * (Le64(trailer + 4) & 0xffffffffu), false);
  }
  close(t);
  close(w);
}

// Worker 0's upstream becomes a faulty link to the trainer's data port.
int ThroughAFaultyLink(void *self, size_t i, const char *const *prev, Wtx__V1__InitInfo *out) {
  int rc = g_corrupting[1].init_info(self, i, prev, out);
  if (rc != 0 || i != 0) return rc;
  static std::string link;
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (bind(lfd, reinterpret_cast<sockaddr *>(&a), sizeof a) != 0 || listen(lfd, 1) != 0 ||
      getsockname(lfd, reinterpret_cast<sockaddr *>(&a), &len) != 0)
    return WTX_EIO;
  std::thread(FaultyLink, lfd, std::string(out->tcp->upstream_address)).detach();
  link = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  out->tcp->upstream_address = const_cast<char *>(link.c_str());
  return 0;
}

template <int I>
int CorruptingPrepare(void *self, uint32_t k, const wtx_chunk *c, Wtx__V1__UpdateInfo *ui,
                      char *err, size_t errlen) {
  const wtx_trainer_transport *real = &g_corrupting[I];
  if (g_chunks++ == g_corrupt_chunk && c->bytes > 0) {
    if (real->hashes_in_stream) g_flip_next_chunk = true;
    else real->buffer(self, k)[c->bytes / 2] ^= 0x10;
  }
  return real->prepare(self, k, c, ui, err, errlen);
}

void RegisterCorrupting() {
  static std::once_flag once;
  std::call_once(once, [] {
    wtx_transports_register_builtin();
    static const char *const names[4] = {"corrupt_shm", "corrupt_tcp", "corrupt_nccl",
                                         "corrupt_cuda_ipc"};
    const char *reals[4] = {"shm", "tcp", "nccl", "cuda_ipc"};
    int (*prepares[4])(void *, uint32_t, const wtx_chunk *, Wtx__V1__UpdateInfo *, char *,
                       size_t) = {
        CorruptingPrepare<0>, CorruptingPrepare<1>, CorruptingPrepare<2>,
        CorruptingPrepare<3>};
    static wtx_trainer_transport wrappers[4];
    for (int i = 0; i < 4; i++) {
      g_corrupting[i] = *wtx_trainer_transport_find(reals[i]);
      wrappers[i] = g_corrupting[i];
      wrappers[i].name = names[i];
      wrappers[i].prepare = prepares[i];
      ASSERT_EQ(g_corrupting[i].hashes_in_stream, i == 1);  // tcp only
      if (i == 1) wrappers[i].init_info = ThroughAFaultyLink;
      ASSERT_EQ(0, wtx_trainer_transport_register(&wrappers[i]));
    }
  });
}

// A config that leaves the buffer at 0 gets the backend's default: on shm
// 4 MiB per worker (every chunk costs a call to each worker, so chunks grow
// with them), elsewhere the protocol's 64 MiB; seen in the chunk count.
TEST_P(EngineTest, TheDefaultBufferIsTheBackendsAndOnShmGrowsWithTheWorkers) {
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(16 << 20, 4, &src));
  for (size_t n : {1, 2}) {
    std::vector<Worker> ws;
    for (size_t i = 0; i < n; i++) ws.push_back(Spawn());
    wtx_client *c = Client(ws);
    std::string backend = GetParam();
    wtx_trainer_config cfg = Config(backend, 0, 0, 60000);
    wtx_trainer *t = nullptr;
    char e[2048] = "";
    ASSERT_EQ(0, wtx_trainer_init(&cfg, c, src, &t, e, sizeof e)) << e;
    wtx_send_result res;
    ASSERT_EQ(0, wtx_trainer_send_weights(t, nullptr, &res)) << wtx_trainer_last_error(t);
    uint64_t buffer = backend == "shm" ? (4u << 20) * n : 64u << 20;
    EXPECT_EQ((res.bytes + buffer - 1) / buffer, res.chunks) << n << " workers";
    wtx_trainer_shutdown(t);
    wtx_client_destroy(c);
  }
  wtx_source_destroy(src);
}

TEST_P(EngineTest, ACorruptedByteIsDataLossAndEveryWorkerKeepsItsWeights) {
  Worker w0 = Spawn(), w1 = Spawn(), w2 = Spawn();
  wtx_client *c = Client({w0, w1, w2});
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(8 << 20, 9, &src));
  std::string err;
  RegisterCorrupting();
  backend_ = std::string("corrupt_") + GetParam();  // the wrapper of GetParam()
  ASSERT_EQ(0, Push(c, src, "clean", 1 << 20, 2, 10000, &err)) << err;
  g_chunks = 0;
  g_corrupt_chunk = 3;
  EXPECT_EQ(WTX_ECHECKSUM, Push(c, src, "corrupt", 1 << 20, 2, 10000, &err));
  g_corrupt_chunk = -1;
  EXPECT_EQ(15 /* DATA_LOSS */, wtx_client_last_status(c)) << err;
  EXPECT_NE(std::string::npos, err.find("checksum mismatch for 'model.")) << err;
  for (const Worker &w : {w0, w1, w2}) EXPECT_EQ("clean", Version(w));
  // The next sync goes through.
  ASSERT_EQ(0, Push(c, src, "again", 1 << 20, 2, 10000, &err)) << err;
  for (const Worker &w : {w0, w1, w2}) EXPECT_EQ("again", Version(w));
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

struct KillAt {
  pid_t pid;
  std::atomic<bool> killed{false};
};

void KillHalfway(void *arg, uint64_t done, uint64_t total) {
  auto *k = static_cast<KillAt *>(arg);
  if (!k->killed && done * 3 >= total) {
    kill(k->pid, SIGKILL);
    k->killed = true;
  }
}

// With two buffers a chunk's call waits for the answer to the one before;
// with four, on shm and cuda_ipc, two are in flight when the worker dies.
TEST_P(EngineTest, AWorkerKilledMidTransferEndsTheSyncWithinTheTimeout) {
  for (uint32_t nbuf : {2u, 4u}) {
    SCOPED_TRACE(std::to_string(nbuf) + " buffers");
    Worker w0 = Spawn(), w1 = Spawn(), w2 = Spawn();
    wtx_source *src = nullptr;
    ASSERT_EQ(0, wtx_source_synthetic(64 << 20, 3, &src));
    wtx_client *c = Client({w0, w1, w2}, 5000);
    std::string err;
    ASSERT_EQ(0, Push(c, src, "v1", 1 << 20, nbuf, 5000, &err)) << err;
    KillAt k;
    k.pid = w1.pid;
    auto t0 = std::chrono::steady_clock::now();
    EXPECT_NE(0, Push(c, src, "v2", 1 << 20, nbuf, 5000, &err, nullptr, KillHalfway, &k));
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_TRUE(k.killed);
    EXPECT_LT(secs, 15.0) << "bounded by the 5 s timeout per step: " << err;
    EXPECT_NE(std::string::npos, err.find("worker")) << err;
    int st;
    waitpid(w1.pid, &st, 0);
    for (auto &w : workers_)
      if (w.pid == w1.pid) w.pid = -1;
    // The survivors keep the previous version and take the next sync.
    EXPECT_EQ("v1", Version(w0));
    EXPECT_EQ("v1", Version(w2));
    wtx_client_destroy(c);
    c = Client({w0, w2}, 5000);
    ASSERT_EQ(0, Push(c, src, "v3", 1 << 20, nbuf, 5000, &err)) << err;
    EXPECT_EQ("v3", Version(w2));
    wtx_client_destroy(c);
    wtx_source_destroy(src);
  }
}

TEST_P(EngineTest, RanksOtherThanZeroIterateWithoutSending) {
  // No client at all: such a rank never talks to a worker. It still runs
  // its source's pass, checked like the sender's: a lying source fails.
  // Its buffers are left at their defaults, which depend on the workers.
  std::string backend = GetParam();
  wtx_trainer_config ti = Config(backend, 0, 0, 1000);
  ti.rank = 1;
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(1 << 20, 1, &src));
  wtx_trainer *t = nullptr;
  char e[512] = "";
  ASSERT_EQ(0, wtx_trainer_init(&ti, nullptr, src, &t, e, sizeof e)) << e;
  EXPECT_EQ(0, wtx_trainer_send_weights(t, nullptr, nullptr)) << wtx_trainer_last_error(t);
  wtx_trainer_shutdown(t);
  wtx_source_destroy(src);

  LyingSource ls;
  ASSERT_EQ(0, wtx_source_create(&kLying, &ls, &src));
  ASSERT_EQ(0, wtx_trainer_init(&ti, nullptr, src, &t, e, sizeof e)) << e;
  EXPECT_EQ(WTX_EINVAL, wtx_trainer_send_weights(t, nullptr, nullptr));
  EXPECT_NE(nullptr, strstr(wtx_trainer_last_error(t), "parameter 2 of the iteration"))
      << wtx_trainer_last_error(t);
  wtx_trainer_shutdown(t);
  wtx_source_destroy(src);
}

INSTANTIATE_TEST_SUITE_P(HostBackends, EngineTest, ::testing::Values("shm", "tcp"),
                         [](const auto &info) { return std::string(info.param); });

// The GPU backends' own logic (packing, chunk order, handle routing, the
// collective rendezvous, errors, timeouts) against the TEST DOUBLE of CUDA
// and NCCL (cuda/testing/fake_cuda.c) loaded at the dlopen seam; the
// real libraries run in tests/gpu/run.sh.
INSTANTIATE_TEST_SUITE_P(GpuBackendsOnTheCudaDouble, EngineTest,
                         ::testing::Values("nccl", "cuda_ipc"),
                         [](const auto &info) { return std::string(info.param); });

// cuda_ipc: a worker uses the buffer exported for its own GPU only.
class CudaIpcRoutingTest : public EngineTest {};

TEST_P(CudaIpcRoutingTest, AWorkerOnAnotherGpuGetsNoHandleAndSaysWhichItHas) {
  setenv("WTX_FAKE_CUDA_UUID", "00112233445566778899aabbccddeeff", 1);
  Worker other = Spawn();
  unsetenv("WTX_FAKE_CUDA_UUID");
  Worker same = Spawn();
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(1 << 20, 1, &src));
  wtx_client *c = Client({same});
  std::string err;
  ASSERT_EQ(0, Push(c, src, "v1", 1 << 20, 2, 5000, &err)) << err;
  wtx_client_destroy(c);
  c = Client({same, other});
  EXPECT_EQ(WTX_EINVAL, Push(c, src, "v2", 1 << 20, 2, 5000, &err));
  EXPECT_NE(std::string::npos, err.find("worker 1 (" + other.addr() + ")")) << err;
  EXPECT_NE(std::string::npos,
            err.find("none for this worker's GPU 00112233445566778899aabbccddeeff")) << err;
  // The trainer's own GPU is what it offered.
  EXPECT_NE(std::string::npos, err.find("offered: 7774782d66616b652d6770752d303030"))
      << err;
  EXPECT_EQ("v1", Version(same));
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

INSTANTIATE_TEST_SUITE_P(GpuBackendsOnTheCudaDouble, CudaIpcRoutingTest,
                         ::testing::Values("cuda_ipc"),
                         [](const auto &info) { return std::string(info.param); });

// A worker whose model lives on the GPU (tests/client/gpu_model_worker,
// vLLM's stand-in: it stages on the device and refuses host staging) gets
// every tensor device to device, from device and host tensors of the
// trainer alike, and each one's device bytes hash to what the trainer sent;
// with a lag on every copy (the double lands them 50 ms late), nothing is
// read before it landed. A tensor larger than the buffer and many small
// ones in one chunk take the same path.
class GpuModelTest : public EngineTest {
 protected:
  void SetUp() override {
    EngineTest::SetUp();
    worker_binary_ = "tests/client/gpu_model_worker";
  }
};

TEST_P(GpuModelTest, AModelOnTheGpuIsStagedThereAndReceivesEveryByte) {
  DeviceModel model;
  std::vector<Worker> ws = {Spawn(), Spawn()};
  wtx_client *c = Client(ws);
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_create(&kDeviceModel, &model, &src));
  std::string err;
  std::vector<uint64_t> sums;
  setenv("WTX_FAKE_CUDA_LAG_MS", "50", 1);
  ASSERT_EQ(0, Push(c, src, "v1", 1 << 20, 2, 20000, &err, &sums)) << err;
  unsetenv("WTX_FAKE_CUDA_LAG_MS");
  for (size_t i = 0; i < model.kN; i++)
    EXPECT_EQ(XXH3_64bits(model.bytes[i].data(), model.bytes[i].size()), sums[i]) << i;
  wtx_source_destroy(src);
  ASSERT_EQ(0, wtx_source_synthetic(4 << 20, 3000, &src));
  ASSERT_EQ(0, Push(c, src, "v2", 1 << 20, 2, 20000, &err)) << err;
  wtx_source_destroy(src);
  wtx_client_destroy(c);
}

// The GPU backends' default, checksums off, takes its own path (no host
// bounce, nothing verified by the session): every byte is checked here
// instead, the worker's model hashing its device bytes (a copy to the
// host) and the test hashing the trainer's tensors, staged and received
// in place alike.
TEST_P(GpuModelTest, WithChecksumsOffEveryByteLandsAsTheTestHashesIt) {
  DeviceModel model;
  std::string sums = dir_ + "/sums";
  std::vector<Worker> ws = {Spawn({"--sums", sums})};
  wtx_client *c = Client(ws);
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_create(&kDeviceModel, &model, &src));
  std::map<std::string, uint64_t> want = HostSums(src);
  ASSERT_EQ(model.kN, want.size());
  checksum_ = WTX_CHECKSUM_NONE;
  for (int direct : {0, 1}) {
    direct_ = direct;
    std::string err, v = "off-" + std::to_string(direct), got_version;
    std::remove(sums.c_str());
    ASSERT_EQ(0, Push(c, src, v.c_str(), 1 << 20, 2, 20000, &err)) << err;
    EXPECT_EQ(want, DeviceSums(sums, &got_version)) << v;
    EXPECT_EQ(v, got_version);
  }
  wtx_source_destroy(src);
  wtx_client_destroy(c);
}

INSTANTIATE_TEST_SUITE_P(GpuBackendsOnTheCudaDouble, GpuModelTest,
                         ::testing::Values("nccl", "cuda_ipc"),
                         [](const auto &info) { return std::string(info.param); });

// The double in hard mode (WTX_FAKE_CUDA_HARD=1), where it behaves as the
// real libraries do at the places they hang or fault: a dead peer is never
// noticed, freed memory holds garbage, calls fail when told to
// (WTX_FAKE_CUDA_FAIL_DIR). What wtx did there on the gentle double must
// hold here too, by its own timeouts and checks.
class HardDoubleTest : public EngineTest {
 protected:
  void SetUp() override {
    EngineTest::SetUp();
    for (const char *who : {"/trainer", "/worker"})
      ASSERT_EQ(0, mkdir((dir_ + who).c_str(), 0700));
    setenv("WTX_FAKE_CUDA_HARD", "1", 1);
    setenv("WTX_FAKE_CUDA_FAIL_DIR", (dir_ + "/trainer").c_str(), 1);
  }
  void TearDown() override {
    unsetenv("WTX_FAKE_CUDA_HARD");
    unsetenv("WTX_FAKE_CUDA_FAIL_DIR");
    EngineTest::TearDown();
  }
  // A worker whose injected failures come from dir_/worker (the trainer's,
  // this process's, from dir_/trainer).
  Worker SpawnFailing(std::vector<std::string> extra = {}) {
    setenv("WTX_FAKE_CUDA_FAIL_DIR", (dir_ + "/worker").c_str(), 1);
    Worker w = Spawn(extra);
    setenv("WTX_FAKE_CUDA_FAIL_DIR", (dir_ + "/trainer").c_str(), 1);
    return w;
  }
  // The next call of kind ("copy", "sync") of who ("trainer", "worker")
  // fails; Fired says whether one did.
  void FailNext(const std::string &who, const std::string &kind) {
    std::ofstream(dir_ + "/" + who + "/" + kind) << "1\n";
  }
  bool Fired(const std::string &who, const std::string &kind) {
    return access((dir_ + "/" + who + "/" + kind).c_str(), F_OK) != 0;
  }
};

// A worker killed mid-transfer: NCCL never notices a dead peer, so only
// wtx's timeout (5 s a step) ends the sync; the survivors keep v1 and take
// the next sync.
TEST_P(HardDoubleTest, AWorkerKilledMidTransferEndsTheSyncByTheTimeoutAlone) {
  Worker w0 = Spawn(), w1 = Spawn();
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(32 << 20, 3, &src));
  wtx_client *c = Client({w0, w1}, 5000);
  std::string err;
  ASSERT_EQ(0, Push(c, src, "v1", 1 << 20, 2, 5000, &err)) << err;
  KillAt k;
  k.pid = w1.pid;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(0, Push(c, src, "v2", 1 << 20, 2, 5000, &err, nullptr, KillHalfway, &k));
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(k.killed);
  EXPECT_LT(secs, 20.0) << "bounded by the 5 s timeout per step: " << err;
  int st;
  waitpid(w1.pid, &st, 0);
  workers_[1].pid = -1;
  EXPECT_EQ("v1", Version(w0));
  wtx_client_destroy(c);
  c = Client({w0}, 5000);
  ASSERT_EQ(0, Push(c, src, "v3", 1 << 20, 2, 5000, &err)) << err;
  EXPECT_EQ("v3", Version(w0));
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

// A copy that fails (into the worker's device staging, or on the trainer)
// and a synchronize that fails: each ends the sync with an error that
// names it, the worker keeps v1 (the version its model last loaded), and
// the next sync lands.
TEST_P(HardDoubleTest, FailedCopiesAndSynchronizesEndTheSyncAndKeepTheWeights) {
  worker_binary_ = "tests/client/gpu_model_worker";
  std::string sums = dir_ + "/sums", version;
  std::vector<Worker> ws = {SpawnFailing({"--sums", sums})};
  wtx_client *c = Client(ws, 5000);
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(8 << 20, 4, &src));
  std::string err;
  ASSERT_EQ(0, Push(c, src, "v1", 1 << 20, 2, 5000, &err)) << err;
  for (const char *who : {"worker", "trainer"})
    for (const char *kind : {"copy", "sync"}) {
      std::string what = std::string(who) + " " + kind;
      FailNext(who, kind);
      EXPECT_NE(0, Push(c, src, what.c_str(), 1 << 20, 2, 5000, &err)) << what;
      EXPECT_TRUE(Fired(who, kind)) << what << ": no call failed";
      EXPECT_NE(std::string::npos, err.find("unspecified launch failure")) << what << ": " << err;
      DeviceSums(sums, &version);
      EXPECT_EQ("v1", version) << what;
    }
  ASSERT_EQ(0, Push(c, src, "v2", 1 << 20, 2, 5000, &err)) << err;
  DeviceSums(sums, &version);
  EXPECT_EQ("v2", version);
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

// A trainer replaced between syncs (shut down: its buffers freed, which
// the double fills with garbage) and a new one: the worker reads the new
// trainer's buffers, never the freed ones it had opened, and every byte
// of the new version arrives.
TEST_P(HardDoubleTest, ANewTrainerIsReadFromItsOwnBuffersNotTheFreedOnes) {
  std::vector<Worker> ws = {Spawn(), Spawn()};
  wtx_client *c = Client(ws, 5000);
  wtx_source *a = nullptr, *b = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(8 << 20, 5, &a));
  ASSERT_EQ(0, wtx_source_synthetic(8 << 20, 6, &b));
  std::string err;
  std::vector<uint64_t> sums;
  ASSERT_EQ(0, Push(c, a, "first", 1 << 20, 2, 5000, &err)) << err;
  ASSERT_EQ(0, Push(c, b, "second", 1 << 20, 2, 5000, &err, &sums)) << err;
  EXPECT_EQ(0, wtx_client_verify(c, b, sums.data())) << wtx_client_last_error(c);
  wtx_client_destroy(c);
  wtx_source_destroy(a);
  wtx_source_destroy(b);
}

// A machine with 2 GPUs (the double's count, WTX_FAKE_CUDA_DEVICES) and a
// worker told to use its sixth: the sync fails naming the device, and
// nothing is published.
TEST_P(HardDoubleTest, AWorkerOnADeviceTheMachineLacksIsRefusedByNumber) {
  setenv("WTX_FAKE_CUDA_DEVICES", "2", 1);
  setenv("WTX_CUDA_DEVICE", "5", 1);
  Worker w = Spawn();
  unsetenv("WTX_CUDA_DEVICE");
  wtx_client *c = Client({w}, 5000);
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(1 << 20, 4, &src));
  std::string err;
  EXPECT_NE(0, Push(c, src, "v1", 1 << 20, 2, 5000, &err));
  unsetenv("WTX_FAKE_CUDA_DEVICES");
  EXPECT_NE(std::string::npos, err.find("5")) << err;
  EXPECT_NE(std::string::npos, err.find("invalid device ordinal")) << err;
  EXPECT_EQ(9 /* FAILED_PRECONDITION: not a failure to retry */, wtx_client_last_status(c));
  EXPECT_EQ("", Version(w));
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

// A delta with patches into a model staging on the GPU whose copy or
// synchronize fails partway (the chunk's bytes out of the backend's
// buffer, the base read back, or the patched tensors put on the device):
// the sync fails naming the CUDA error, the model serves the version
// before, bit for bit, and the next delta lands.
TEST_P(HardDoubleTest, AFailedCopyInAPatchedDeltaKeepsTheVersionBefore) {
  wtxtest::FloatModel model(6);
  worker_binary_ = "tests/client/gpu_model_worker";
  std::string sums = dir_ + "/sums", version;
  std::vector<Worker> ws = {SpawnFailing({"--read", "--sums", sums})};
  wtx_client *c = Client(ws, 5000);
  wtx_source *src = model.Source();
  wtx_trainer *t = DeltaTrainer(c, src, WTX_DELTA_PATCHES, 5000);
  ASSERT_NE(nullptr, t);
  wtx_send_options so = WTX_SEND_OPTIONS_INIT;
  wtx_send_result res;
  so.version = "v1";
  ASSERT_EQ(0, wtx_trainer_send_weights(t, &so, &res)) << wtx_trainer_last_error(t);
  std::map<std::string, uint64_t> v1 = model.Hashes();
  // A patch of tensor 2 beside tensor 3 rewritten whole, each time anew.
  for (const char *kind : {"copy", "sync"}) {
    model.Set(2, kind[0] == 'c' ? 5 : 9, 2.0f);
    for (auto &b : model.data[3]) b ^= 0x33;
    FailNext("worker", kind);
    so.version = kind;
    EXPECT_NE(0, wtx_trainer_send_weights(t, &so, &res)) << kind;
    EXPECT_TRUE(Fired("worker", kind)) << kind << ": no call failed";
    EXPECT_NE(nullptr, strstr(wtx_trainer_last_error(t), "unspecified launch failure"))
        << kind << ": " << wtx_trainer_last_error(t);
    EXPECT_EQ(v1, DeviceSums(sums, &version)) << kind;
    EXPECT_EQ("v1", version) << kind;
  }
  // This model reports no per-tensor hashes: what the trainer knew of v1
  // stands through both failures, so only tensor 2 travels (tensor 3,
  // flipped twice, is as v1 has it).
  so.version = "v2";
  ASSERT_EQ(0, wtx_trainer_send_weights(t, &so, &res)) << wtx_trainer_last_error(t);
  EXPECT_EQ(1, res.delta) << (res.full_reason ? res.full_reason : "");
  EXPECT_EQ(1u, res.params);
  EXPECT_EQ(5u, res.skipped_params);
  EXPECT_EQ(model.Hashes(), DeviceSums(sums, &version));
  EXPECT_EQ("v2", version);
  wtx_trainer_shutdown(t);
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

INSTANTIATE_TEST_SUITE_P(GpuBackendsOnTheHardDouble, HardDoubleTest,
                         ::testing::Values("nccl", "cuda_ipc"),
                         [](const auto &info) { return std::string(info.param); });

// What the double logged (WTX_FAKE_CUDA_LOG): per pid, the allocations it
// opened through IPC handles (name -> times) and the bytes it copied device
// to device (logged at its exit).
struct CudaLog {
  std::map<std::string, std::map<std::string, int>> opens;
  std::map<std::string, uint64_t> d2d;
  explicit CudaLog(const std::string &path) {
    std::ifstream f(path);
    for (std::string pid, what, detail; f >> pid >> what >> detail;) {
      if (what == "open") opens[pid][detail]++;
      if (what == "d2d") d2d[pid] += std::stoull(detail);
    }
  }
};

// Direct receive: every chunk lands straight in each worker's receive
// region (cuda_ipc: the trainer writes it there; nccl: the broadcast does).
// A model that adopts its tensors there (gpu_model_worker --in-place-only
// refuses any other staging) gets every byte, twice in a row, from device
// and host tensors, and copies nothing itself (the double counts each
// process's device-to-device bytes); wtx-worker's store (host staging)
// copies out of its region; and beside a worker with no room for a region
// (the double's device holds 3 MiB there, the model 3.4) the push still
// lands: cuda_ipc's whole session uses its buffers, nccl's worker its own.
class DirectTest : public GpuModelTest {
 protected:
  // Stops ws and expects that none of them copied a byte device to device.
  static void ExpectNoDeviceCopies(std::vector<Worker> &ws, const std::string &log) {
    for (Worker &w : ws) {
      std::string pid = std::to_string(w.pid);
      Stop(w);
      CudaLog after(log);
      ASSERT_EQ(1u, after.d2d.count(pid)) << "worker " << pid << " logged no exit";
      EXPECT_EQ(0u, after.d2d[pid]) << "worker " << pid << " copied device to device";
    }
  }
};

TEST_P(DirectTest, EveryChunkLandsInTheRegionsOrInBuffersWhereThereIsNoRoom) {
  bool ipc = std::string(GetParam()) == "cuda_ipc";  // nccl's trainer cannot tell
  direct_ = 1;
  DeviceModel model;
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_create(&kDeviceModel, &model, &src));
  std::string err, log = dir_ + "/cuda.log";
  setenv("WTX_FAKE_CUDA_LOG", log.c_str(), 1);
  std::vector<Worker> ws = {Spawn({"--in-place-only"}), Spawn({"--in-place-only"})};
  unsetenv("WTX_FAKE_CUDA_LOG");
  wtx_client *c = Client(ws);
  setenv("WTX_FAKE_CUDA_LAG_MS", "20", 1);
  for (const char *v : {"direct-1", "direct-2"}) {
    ASSERT_EQ(0, Push(c, src, v, 1 << 20, 2, 20000, &err)) << v << ": " << err;
    EXPECT_EQ(ipc ? 1 : 0, last_direct_) << v;
  }
  unsetenv("WTX_FAKE_CUDA_LAG_MS");
  wtx_client_destroy(c);
  ASSERT_NO_FATAL_FAILURE(ExpectNoDeviceCopies(ws, log));
  // The store stages on the host, out of the region.
  worker_binary_ = "server/wtx-worker";
  std::vector<Worker> hs = {Spawn()};
  c = Client(hs);
  std::vector<uint64_t> sums;
  PushAndVerify(c, hs, src, "store", &sums);
  EXPECT_EQ(ipc ? 1 : 0, last_direct_);
  wtx_client_destroy(c);
  // One worker without room, beside a GPU model (the plain one: on
  // cuda_ipc the session falls back to buffers, which the in-place-only
  // one would refuse).
  setenv("WTX_FAKE_CUDA_MEMORY", "3145728", 1);
  Worker small = Spawn();
  unsetenv("WTX_FAKE_CUDA_MEMORY");
  worker_binary_ = "tests/client/gpu_model_worker";
  c = Client({Spawn(), small});
  ASSERT_EQ(0, Push(c, src, "fallback", 1 << 20, 2, 20000, &err)) << err;
  EXPECT_EQ(0, last_direct_);
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

INSTANTIATE_TEST_SUITE_P(GpuBackendsOnTheCudaDouble, DirectTest,
                         ::testing::Values("cuda_ipc", "nccl"),
                         [](const auto &info) { return std::string(info.param); });

// The GPU goal's "at most one handle opened per buffer per session": over
// three sessions of several chunks each through two buffers, then two
// direct ones, every process opens each allocation once (the double logs
// every open): a worker each trainer buffer, a trainer each worker region.
class IpcOpensTest : public GpuModelTest {};

TEST_P(IpcOpensTest, EachBufferAndRegionIsOpenedOncePerSession) {
  std::string log = dir_ + "/cuda.log";
  setenv("WTX_FAKE_CUDA_LOG", log.c_str(), 1);
  std::vector<Worker> ws = {Spawn(), Spawn()};
  wtx_client *c = Client(ws);
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(4 << 20, 5, &src));
  std::string err;
  int round = 0;
  for (int direct : {0, 0, 0, 1, 1}) {
    direct_ = direct;
    std::string v = "s" + std::to_string(++round);
    ASSERT_EQ(0, Push(c, src, v.c_str(), 1 << 20, 2, 20000, &err)) << err;
    EXPECT_EQ(direct, last_direct_) << v;
  }
  unsetenv("WTX_FAKE_CUDA_LOG");
  CudaLog got(log);
  for (const auto &[pid, names] : got.opens)
    for (const auto &[name, n] : names)
      EXPECT_EQ(1, n) << pid << " " << name << " opened " << n << " times";
  // Two direct sessions x two worker regions; three buffered sessions x
  // two buffers per worker.
  EXPECT_EQ(4u, got.opens[std::to_string(getpid())].size());
  for (const Worker &w : ws)
    EXPECT_EQ(6u, got.opens[std::to_string(w.pid)].size()) << "worker " << w.pid;
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

INSTANTIATE_TEST_SUITE_P(GpuBackendsOnTheCudaDouble, IpcOpensTest, ::testing::Values("cuda_ipc"),
                         [](const auto &info) { return std::string(info.param); });

// Every process of this test (workers and ranks inherit the environment)
// loads the TEST DOUBLE of CUDA and NCCL instead of the real libraries.
const auto *const kDouble = ::testing::AddGlobalTestEnvironment(new wtxtest::UseCudaDouble);

}  // namespace

namespace wtxtest {

// Every replica or none: a replica that cannot publish (its model spec
// declares a tensor the trainer never sends, so its first version would be
// incomplete) is found before any replica publishes, and every replica
// keeps its previous weights.
TEST_P(EngineTest, AReplicaThatCannotPublishLeavesEveryReplicaOnItsPreviousWeights) {
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(2 << 20, 5, &src));
  const wtx_tensor_meta *metas;
  size_t n;
  ASSERT_EQ(0, wtx_source_metadata(src, &metas, &n));
  // The spec: the synthetic model's layout plus one tensor it lacks.
  std::vector<wtx_st_tensor> spec(n + 1);
  uint64_t biggest = 0;
  for (size_t i = 0; i < n; i++) {
    spec[i].meta = metas[i];
    biggest = std::max(biggest, metas[i].nbytes);
  }
  std::vector<uint8_t> zeros(biggest);
  for (size_t i = 0; i < n; i++) spec[i].data = zeros.data();
  uint64_t shape = 4;
  char err[512] = "";
  ASSERT_EQ(0, wtx_tensor_meta_set(&spec[n].meta, "extra.weight", WTX_DTYPE_FLOAT32, &shape, 1,
                                   err, sizeof err));
  spec[n].data = zeros.data();
  std::string path = dir_ + "/spec.safetensors";
  ASSERT_EQ(0, wtx_st_write(path.c_str(), spec.data(), spec.size(), nullptr, 0, err, sizeof err))
      << err;
  Worker w0 = Spawn(), w1 = Spawn(), w2 = Spawn({"--model-spec", path});
  wtx_client *c = Client({w0, w1, w2});
  std::string e;
  EXPECT_EQ(WTX_ENOENT, Push(c, src, "v1", 1 << 20, 2, 10000, &e));
  EXPECT_EQ(2, wtx_client_last_replica(c)) << e;
  EXPECT_NE(std::string::npos, e.find("PrepareWeightUpdate")) << e;
  EXPECT_NE(std::string::npos, e.find("'extra.weight' is missing")) << e;
  for (const Worker &w : {w0, w1, w2}) EXPECT_EQ("", Version(w));  // none published
  wtx_client_destroy(c);
  // Without the incomplete replica, the same sync publishes everywhere.
  c = Client({w0, w1});
  ASSERT_EQ(0, Push(c, src, "v1", 1 << 20, 2, 10000, &e)) << e;
  for (const Worker &w : {w0, w1}) EXPECT_EQ("v1", Version(w));
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

}  // namespace wtxtest

namespace wtxtest {

// A source behind wtx_source_ops that answers one of two tables, for a
// trainer whose source changes what it holds between syncs.
struct SwitchingSource {
  wtx_source *tables[2];
  int current = 0;
  static int Metadata(void *self, const wtx_tensor_meta **metas, size_t *n) {
    auto *s = static_cast<SwitchingSource *>(self);
    return wtx_source_metadata(s->tables[s->current], metas, n);
  }
  static int Open(void *self, void **iter) {
    auto *s = static_cast<SwitchingSource *>(self);
    return wtx_source_open(s->tables[s->current], iter);
  }
  static int Next(void *self, void *iter, wtx_tensor_meta *meta, const uint8_t **data) {
    auto *s = static_cast<SwitchingSource *>(self);
    return wtx_source_next(s->tables[s->current], iter, meta, data);
  }
  static void Close(void *self, void *iter) {
    auto *s = static_cast<SwitchingSource *>(self);
    wtx_source_close(s->tables[s->current], iter);
  }
  static void Destroy(void *) {}
};
// A source that fails its pass number fail_pass at tensor fail_at
// (passes count from 1), else yields inner's.
struct FailingSource {
  wtx_source *inner;
  int passes = 0, fail_pass = 0;
  size_t fail_at = 0, at = 0;
  static int Metadata(void *self, const wtx_tensor_meta **metas, size_t *n) {
    return wtx_source_metadata(static_cast<FailingSource *>(self)->inner, metas, n);
  }
  static int Open(void *self, void **iter) {
    auto *s = static_cast<FailingSource *>(self);
    s->passes++;
    s->at = 0;
    return wtx_source_open(s->inner, iter);
  }
  static int Next(void *self, void *iter, wtx_tensor_meta *meta, const uint8_t **data) {
    auto *s = static_cast<FailingSource *>(self);
    if (s->passes == s->fail_pass && s->at++ == s->fail_at) return WTX_EIO;
    return wtx_source_next(s->inner, iter, meta, data);
  }
  static void Close(void *self, void *iter) {
    wtx_source_close(static_cast<FailingSource *>(self)->inner, iter);
  }
  static void Destroy(void *) {}
};

const wtx_source_ops kFailingOps = {WTX_SOURCE_OPS_VERSION, "failing", FailingSource::Metadata,
                                    FailingSource::Open,
                                    FailingSource::Next, FailingSource::Close,
                                    FailingSource::Destroy, nullptr, nullptr};

const wtx_source_ops kSwitchingOps = {WTX_SOURCE_OPS_VERSION, "switching", SwitchingSource::Metadata,
                                      SwitchingSource::Open, SwitchingSource::Next,
                                      SwitchingSource::Close, SwitchingSource::Destroy, nullptr,
                                      nullptr};

// One trainer plans its syncs once from its source's table; a source that
// answers another table (a new array) is planned anew, and the workers get
// exactly the table each sync holds, named by position when they have it.
TEST_P(EngineTest, OneTrainerFollowsItsSourceToAnotherTableAndBack) {
  const size_t n = 9000, more = 700;  // two chunks of tensors either way
  std::vector<std::vector<uint8_t>> data(n + more);
  std::vector<std::string> names(n + more);
  std::vector<uint64_t> shapes(n + more);
  std::vector<wtx_memory_tensor> ts(n + more);
  for (size_t i = 0; i < n + more; i++) {
    shapes[i] = 1 + i % 11;
    data[i].assign(shapes[i], static_cast<uint8_t>(i * 29));
    names[i] = "model.layers." + std::to_string(i / 100) + ".e" + std::to_string(i);
    ts[i] = {names[i].c_str(), WTX_DTYPE_UINT8, &shapes[i], 1, data[i].data(), 0};
  }
  SwitchingSource sw;
  char e[1024] = "";
  // The whole model, then an update of part of it (the rest stays).
  ASSERT_EQ(0, wtx_source_memory(ts.data(), n + more, &sw.tables[0], e, sizeof e)) << e;
  ASSERT_EQ(0, wtx_source_memory(ts.data(), n, &sw.tables[1], e, sizeof e)) << e;
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_create(&kSwitchingOps, &sw, &src));
  std::vector<Worker> ws = {Spawn(), Spawn()};
  wtx_client *c = Client(ws, 10000);
  std::string backend = GetParam();
  wtx_trainer_config cfg = Config(backend, 1 << 20, 2, 10000);
  wtx_trainer *t = nullptr;
  ASSERT_EQ(0, wtx_trainer_init(&cfg, c, src, &t, e, sizeof e)) << e;
  const int tables[] = {0, 0, 1, 1, 0};
  std::vector<uint64_t> held(n + more);  // the workers' checksums, all of them
  for (int round = 0; round < 5; round++) {
    sw.current = tables[round];
    for (auto &d : data) d[0]++;  // each round's weights differ
    std::string v = "round-" + std::to_string(round);
    wtx_send_options so = WTX_SEND_OPTIONS_INIT;
    so.version = v.c_str();
    wtx_send_result res;
    ASSERT_EQ(0, wtx_trainer_send_weights(t, &so, &res)) << v << ": " << wtx_trainer_last_error(t);
    ASSERT_EQ(sw.current ? n : n + more, res.params) << v;
    std::copy(res.xxh3, res.xxh3 + res.params, held.begin());
    EXPECT_EQ(0, wtx_client_verify(c, sw.tables[0], held.data()))
        << v << ": " << wtx_client_last_error(c);
    for (const Worker &w : ws) EXPECT_EQ(v, Version(w));
  }
  wtx_trainer_shutdown(t);
  wtx_client_destroy(c);
  wtx_source_destroy(src);
  wtx_source_destroy(sw.tables[0]);
  wtx_source_destroy(sw.tables[1]);
}

// A worker restarted between two syncs of one trainer has lost the
// session: the next sync initializes again by itself and goes through.
TEST_P(EngineTest, AWorkerRestartedBetweenRoundsTakesTheNextSync) {
  Worker w0 = Spawn(), w1 = Spawn();
  wtx_client *c = Client({w0, w1}, 10000);
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(4 << 20, 2, &src));
  std::string backend = GetParam();
  wtx_trainer_config cfg = Config(backend, 1 << 20, 2, 10000);
  wtx_trainer *t = nullptr;
  char e[1024] = "";
  ASSERT_EQ(0, wtx_trainer_init(&cfg, c, src, &t, e, sizeof e)) << e;
  wtx_send_options so = WTX_SEND_OPTIONS_INIT;
  so.version = "round-1";
  ASSERT_EQ(0, wtx_trainer_send_weights(t, &so, nullptr)) << wtx_trainer_last_error(t);
  // Restart worker 1 on its port: a new process, no session, no weights.
  int port = w1.port;
  Stop(workers_[1]);
  Worker again = Spawn({"--listen", "127.0.0.1:" + std::to_string(port)});
  ASSERT_EQ(port, again.port);
  so.version = "round-2";
  ASSERT_EQ(0, wtx_trainer_send_weights(t, &so, nullptr)) << wtx_trainer_last_error(t);
  EXPECT_EQ("round-2", Version(w0));
  EXPECT_EQ("round-2", Version(again));
  wtx_trainer_shutdown(t);
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

}  // namespace wtxtest

namespace wtxtest {

// Every replica or none, once Finish has begun (docs/operations.md, "Every
// replica or none"): a model of 8 tensors whose bytes each version
// changes, pushed by one trainer to two workers, the second behind a proxy
// when the test cuts its network.
class UndoTest : public EngineTest {
 protected:
  void SetUp() override {
    EngineTest::SetUp();
    for (int i = 0; i < 8; i++) {
      names_.push_back("layers." + std::to_string(i) + ".w");
      shapes_.push_back(64 << 10);
      data_.emplace_back(64 << 10);
    }
    for (int i = 0; i < 8; i++)
      ts_.push_back({names_[i].c_str(), WTX_DTYPE_UINT8, &shapes_[i], 1, data_[i].data(), 0});
    char e[512] = "";
    ASSERT_EQ(0, wtx_source_memory(ts_.data(), ts_.size(), &src_, e, sizeof e)) << e;
  }
  void TearDown() override {
    if (t_ != nullptr) wtx_trainer_shutdown(t_);
    if (c_ != nullptr) wtx_client_destroy(c_);
    wtx_source_destroy(src_);
    EngineTest::TearDown();
  }
  // A trainer over a client of addrs (short deadlines: a cut costs little).
  void Trainer(const std::vector<std::string> &addrs) {
    std::vector<const char *> t;
    for (auto &a : addrs) t.push_back(a.c_str());
    wtx_client_options o = WTX_CLIENT_OPTIONS_INIT;
    o.timeout_ms = 2000;
    char e[600] = "";
    ASSERT_EQ(0, wtx_client_create(t.data(), t.size(), &o, &c_, e, sizeof e)) << e;
    backend_name_ = GetParam();
    wtx_trainer_config cfg = Config(backend_name_, 1 << 20, 2, 10000);
    ASSERT_EQ(0, wtx_trainer_init(&cfg, c_, src_, &t_, e, sizeof e)) << e;
  }
  // Version v's bytes: each version fills every tensor anew.
  void Fill(int v) {
    for (size_t i = 0; i < data_.size(); i++)
      for (size_t k = 0; k < data_[i].size(); k++)
        data_[i][k] = static_cast<uint8_t>(v * 31 + i * 7 + k);
  }
  // Publishes version v everywhere; *sums gets its checksums.
  void Publish(int v, std::vector<uint64_t> *sums) {
    Fill(v);
    std::string name = "v" + std::to_string(v);
    wtx_send_options so = WTX_SEND_OPTIONS_INIT;
    so.version = name.c_str();
    wtx_send_result res;
    ASSERT_EQ(0, wtx_trainer_send_weights(t_, &so, &res)) << wtx_trainer_last_error(t_);
    ASSERT_NE(nullptr, res.xxh3);
    sums->assign(res.xxh3, res.xxh3 + res.params);
  }
  // Version v sent and prepared on every replica, not published; *sums
  // (may be NULL) gets its checksums.
  void Prepare(int v, std::vector<uint64_t> *sums = nullptr) {
    Fill(v);
    std::string name = "v" + std::to_string(v);
    wtx_send_options so = WTX_SEND_OPTIONS_INIT;
    so.version = name.c_str();
    wtx_send_result res;
    ASSERT_EQ(0, wtx__trainer_send_prepared(t_, &so, &res)) << wtx_trainer_last_error(t_);
    if (sums != nullptr) sums->assign(res.xxh3, res.xxh3 + res.params);
  }
  // The Finish of a prepared v that must fail: the trainer's error, and its
  // engine told as a failed sync tells it.
  std::string FailedFinish(int v) {
    std::string name = "v" + std::to_string(v);
    char published[WTX_MAX_VERSION_BYTES + 1];
    EXPECT_NE(0, wtx__client_commit(c_, name.c_str(), published, sizeof published));
    std::string e = wtx_client_last_error(c_);
    wtx__trainer_abort(t_, e.c_str());
    return e;
  }
  // w serves version v with exactly the checksums sums.
  void ExpectServes(const Worker &w, const std::string &v, const std::vector<uint64_t> &sums) {
    EXPECT_EQ(v, Version(w));
    wtx_client *c = Client({w});
    EXPECT_EQ(0, wtx_client_verify(c, src_, sums.data())) << wtx_client_last_error(c);
    wtx_client_destroy(c);
  }
  static void Contains(const std::string &e, const std::string &part) {
    EXPECT_NE(std::string::npos, e.find(part)) << "missing \"" << part << "\" in: " << e;
  }

  std::vector<std::string> names_;
  std::vector<uint64_t> shapes_;
  std::vector<std::vector<uint8_t>> data_;
  std::vector<wtx_memory_tensor> ts_;
  wtx_source *src_ = nullptr;
  wtx_client *c_ = nullptr;
  wtx_trainer *t_ = nullptr;
  std::string backend_name_;
};

// A replica killed between Prepare and Finish: the other, which published,
// is undone and serves v1 again; the error names the dead worker and says
// the undo could not reach it. Restarted, it holds nothing of v2 (nothing
// at all: a worker starts empty), and the next sync reaches both.
TEST_P(UndoTest, AReplicaKilledAfterPrepareLeavesEveryReplicaOnTheVersionBefore) {
  Worker w0 = Spawn(), w1 = Spawn();
  Trainer({w0.addr(), w1.addr()});
  std::vector<uint64_t> v1, v3;
  Publish(1, &v1);
  Prepare(2);
  kill(w1.pid, SIGKILL);
  int st = 0;
  ASSERT_EQ(w1.pid, waitpid(w1.pid, &st, 0));
  workers_[1].pid = -1;
  std::string e = FailedFinish(2);
  Contains(e, "worker 1 (" + w1.addr() + ")");
  Contains(e, "FinishWeightUpdate");
  Contains(e, "UNAVAILABLE");
  Contains(e, "undone on 1 of 2 replicas, back on their weights from before (version 'v1')");
  Contains(e, "not reached to undo it: worker 1 (" + w1.addr() + ")");
  ExpectServes(w0, "v1", v1);
  Worker again = Spawn({"--listen", w1.addr()});
  ASSERT_EQ(w1.port, again.port);
  EXPECT_EQ("", Version(again));
  ASSERT_NO_FATAL_FAILURE(Publish(3, &v3));
  ExpectServes(w0, "v3", v3);
  ExpectServes(again, "v3", v3);
}

// A partition between Prepare and Finish: the reachable replica is undone;
// the cut one never published. While the cut lasts the next sync fails,
// naming the update still to undo there; once it heals, that sync first
// discards the prepared update there, then publishes everywhere.
TEST_P(UndoTest, APartitionAfterPrepareUndoesTheOthersAndTheNextSyncSettlesIt) {
  Worker w0 = Spawn(), w1 = Spawn();
  Proxy net(w1.port);
  Trainer({w0.addr(), net.addr()});
  std::vector<uint64_t> v1, v3;
  Publish(1, &v1);
  Prepare(2);
  net.Set(Proxy::kCut);
  std::string e = FailedFinish(2);
  Contains(e, "worker 1 (" + net.addr() + ")");
  Contains(e, "undone on 1 of 2 replicas");
  Contains(e, "not reached to undo it: worker 1");
  ExpectServes(w0, "v1", v1);
  ExpectServes(w1, "v1", v1);  // prepared, never published
  Fill(3);
  wtx_send_options so = WTX_SEND_OPTIONS_INIT;
  so.version = "v3";
  EXPECT_NE(0, wtx_trainer_send_weights(t_, &so, nullptr));
  Contains(wtx_trainer_last_error(t_), "is still to undo here");
  ExpectServes(w0, "v1", v1);
  net.Set(Proxy::kPass);
  ASSERT_NO_FATAL_FAILURE(Publish(3, &v3));
  ExpectServes(w0, "v3", v3);
  ExpectServes(w1, "v3", v3);
}

// A Finish that reaches a replica whose answers are lost, then a cut: it
// published v2, its Finish failed, and the undo cannot reach it, so it
// serves v2 until the network heals (the documented window); the next
// sync undoes it there before anything else, then publishes everywhere.
TEST_P(UndoTest, AReplicaThatPublishedBehindACutIsUndoneWhenItIsReachedAgain) {
  Worker w0 = Spawn(), w1 = Spawn();
  Proxy net(w1.port);
  Trainer({w0.addr(), net.addr()});
  std::vector<uint64_t> v1, v3;
  Publish(1, &v1);
  Prepare(2);
  net.Set(Proxy::kDropAnswers);
  std::string e;
  std::thread finish([&] { e = FailedFinish(2); });
  for (int i = 0; i < 1000 && Version(w1) != "v2"; i++)  // a state, at most 10 s
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ("v2", Version(w1));
  net.Set(Proxy::kCut);
  finish.join();
  Contains(e, "worker 1 (" + net.addr() + ")");
  Contains(e, "undone on 1 of 2 replicas");
  Contains(e, "not reached to undo it: worker 1");
  ExpectServes(w0, "v1", v1);
  EXPECT_EQ("v2", Version(w1));
  net.Set(Proxy::kPass);
  // The next sync's settle reverts w1 before its update starts: held at
  // Prepare, both serve v1.
  ASSERT_NO_FATAL_FAILURE(Prepare(3, &v3));
  ExpectServes(w0, "v1", v1);
  ExpectServes(w1, "v1", v1);
  char published[WTX_MAX_VERSION_BYTES + 1];
  ASSERT_EQ(0, wtx__client_commit(c_, "v3", published, sizeof published))
      << wtx_client_last_error(c_);
  ExpectServes(w0, "v3", v3);
  ExpectServes(w1, "v3", v3);
}

INSTANTIATE_TEST_SUITE_P(HostBackends, UndoTest, ::testing::Values("shm", "tcp"),
                         [](const ::testing::TestParamInfo<const char *> &i) {
                           return std::string(i.param);
                         });

}  // namespace wtxtest

namespace wtxtest {

// Delta syncs (docs/data-plane.md, "Delta updates"): a model of 20 tensors
// of mixed dtypes, pushed to two workers that write every published
// version to disk; the test reads those files and hashes every tensor
// itself, so what it compares never comes from wtx's own checksums.
class DeltaTest : public EngineTest {
 protected:
  static constexpr size_t kN = 20;
  void SetUp() override {
    EngineTest::SetUp();
    const int dtypes[] = {WTX_DTYPE_FLOAT32, WTX_DTYPE_BFLOAT16, WTX_DTYPE_INT8,
                          WTX_DTYPE_FLOAT16};
    const size_t elsize[] = {4, 2, 1, 2};
    uint64_t x = 0x2545f4914f6cdd1dULL;
    for (size_t i = 0; i < kN; i++) {
      int d = i % 4;
      shapes_[i] = {16, 1024 + 64 * i};
      names_[i] = "model.layers." + std::to_string(i) + ".w";
      data_[i].resize(shapes_[i][0] * shapes_[i][1] * elsize[d]);
      for (auto &b : data_[i]) x ^= x << 13, x ^= x >> 7, x ^= x << 17, b = (uint8_t)x;
      ts_[i] = {names_[i].c_str(), dtypes[d], shapes_[i].data(), 2, data_[i].data(), 0};
    }
    char e[512] = "";
    ASSERT_EQ(0, wtx_source_memory(ts_, kN, &src_, e, sizeof e)) << e;
  }
  void TearDown() override {
    wtx_client_destroy(c_);
    wtx_source_destroy(src_);
    EngineTest::TearDown();
  }

  // A worker that writes each published version to its own directory.
  Worker SpawnPublishing() {
    std::string d = dir_ + "/pub" + std::to_string(pubs_.size());
    EXPECT_EQ(0, mkdir(d.c_str(), 0700));
    pubs_.push_back(d);
    return Spawn({"--publish-dir", d});
  }

  // Two workers that write what they publish, and a client of both.
  void TwoWorkers() {
    ws_ = {SpawnPublishing(), SpawnPublishing()};
    c_ = Client(ws_, 10000);
  }

  // Two workers whose model stages on the GPU and keeps the version it
  // publishes there (gpu_model_worker --read), each writing its tensors'
  // device hashes at each commit, and a client of both.
  void TwoGpuWorkers() {
    worker_binary_ = "tests/client/gpu_model_worker";
    for (int k = 0; k < 2; k++) {
      sums_.push_back(dir_ + "/sums" + std::to_string(k));
      ws_.push_back(Spawn({"--read", "--sums", sums_.back()}));
    }
    c_ = Client(ws_, 10000);
  }

  // A trainer of c in the test's delta mode, from src (NULL: the model).
  wtx_trainer *Trainer(wtx_client *c, wtx_source *src = nullptr) {
    return DeltaTrainer(c, src != nullptr ? src : src_, mode_, 10000);
  }

  // The tensors' XXH3 as the test holds them.
  std::map<std::string, uint64_t> Mine() const {
    std::map<std::string, uint64_t> out;
    for (size_t i = 0; i < kN; i++) out[names_[i]] = XXH3_64bits(data_[i].data(), data_[i].size());
    return out;
  }

  // Worker k's published file of version v, hashed tensor by tensor by the
  // test, once the worker's writer names it in LATEST (a bounded wait).
  std::map<std::string, uint64_t> OnDisk(size_t k, const std::string &v) {
    std::string file = v + ".safetensors";  // the test's labels need no escaping
    std::map<std::string, uint64_t> out;
    EXPECT_TRUE(WaitLatest(pubs_[k], file)) << "worker " << k << " never wrote version " << v;
    wtx_st_file *st = nullptr;
    char e[512] = "";
    if (wtx_st_open((pubs_[k] + "/" + file).c_str(), &st, e, sizeof e) != 0) {
      ADD_FAILURE() << e;
      return out;
    }
    for (size_t i = 0; i < wtx_st_count(st); i++) {
      const wtx_st_tensor *t = wtx_st_tensor_at(st, i);
      out[t->meta.name] = XXH3_64bits(t->data, t->meta.nbytes);
    }
    wtx_st_close(st);
    return out;
  }

  // One sync labelled v; *res its result. Every worker must then hold the
  // test's bytes.
  void Sync(wtx_trainer *t, const std::string &v, wtx_send_result *res) {
    wtx_send_options so = WTX_SEND_OPTIONS_INIT;
    so.version = v.c_str();
    ASSERT_EQ(0, wtx_trainer_send_weights(t, &so, res)) << v << ": " << wtx_trainer_last_error(t);
    for (size_t k = 0; k < pubs_.size(); k++) EXPECT_EQ(Mine(), OnDisk(k, v)) << v << " on worker " << k;
    for (const std::string &path : sums_) {
      std::string version;
      EXPECT_EQ(Mine(), DeviceSums(path, &version)) << v << " in " << path;
      EXPECT_EQ(v, version);
    }
  }

  // Sets one element of tensor i (of its dtype's size) to the bytes at v.
  void Poke(size_t i, size_t element, const void *v) {
    size_t es = data_[i].size() / (shapes_[i][0] * shapes_[i][1]);
    memcpy(&data_[i][element * es], v, es);
  }

  // What a sync of the changes since `before` sends under mode_: each
  // changed tensor whole, or (WTX_DELTA_PATCHES) as a patch of its changed
  // elements where that is fewer bytes and fits the 64 KiB buffer.
  void Expect(const std::vector<std::vector<uint8_t>> &before, size_t *params, uint64_t *bytes,
              size_t *patched) const {
    *params = *bytes = *patched = 0;
    for (size_t i = 0; i < kN; i++) {
      if (before[i] == data_[i]) continue;
      size_t es = data_[i].size() / (shapes_[i][0] * shapes_[i][1]);
      uint64_t k = 0;
      for (size_t e = 0; e < data_[i].size(); e += es)
        k += memcmp(&before[i][e], &data_[i][e], es) != 0;
      uint64_t wire = k * (4 + es);
      bool patch = mode_ == WTX_DELTA_PATCHES && wire < data_[i].size() && wire <= (64 << 10);
      ++*params;
      *bytes += patch ? wire : data_[i].size();
      *patched += patch;
    }
  }

  int mode_ = WTX_DELTA_TENSORS;
  std::vector<uint64_t> shapes_[kN];
  std::string names_[kN];
  std::vector<uint8_t> data_[kN];
  wtx_memory_tensor ts_[kN];
  wtx_source *src_ = nullptr;
  std::vector<std::string> pubs_;
  std::vector<std::string> sums_;  // TwoGpuWorkers' --sums files
  std::vector<Worker> ws_;
  wtx_client *c_ = nullptr;

  void Sequence();
  void FailPartway();
};

// A full sync, then ten deltas of mixed kinds. Each sends exactly the
// tensors the step changed (as patches where cheaper, with patches on),
// and every worker's bytes equal the trainer's.
TEST_P(DeltaTest, TenDeltasOfMixedKindsKeepEveryWorkerBitIdentical) { Sequence(); }

TEST_P(DeltaTest, TenDeltasOfMixedKindsAsPatchesKeepEveryWorkerBitIdentical) {
  mode_ = WTX_DELTA_PATCHES;
  Sequence();
}

void DeltaTest::Sequence() {
  TwoWorkers();
  wtx_trainer *t = Trainer(c_);
  ASSERT_NE(nullptr, t);
  wtx_send_result res;
  Sync(t, "v0", &res);
  EXPECT_EQ(0, res.delta);
  ASSERT_NE(nullptr, res.full_reason);
  EXPECT_NE(nullptr, strstr(res.full_reason, "serves no version yet")) << res.full_reason;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int8_t minus = -7;
  const uint16_t half_nan = 0x7e01;  // an fp16 NaN with a payload
  // Each step: what it changes (tensor -> elements), applied before the sync.
  std::function<void()> steps[10] = {
      [] {},                                                   // nothing
      [&] { Poke(5, 3, &data_[6][0]); },                       // one tensor
      [&] {                                                    // 1 % of a tensor's elements
        size_t n = shapes_[8][0] * shapes_[8][1];
        for (size_t e = 0; e < n; e += 100) data_[8][e * 4] ^= 0x5a;
      },
      [&] { Poke(4, 17, &nan); },                              // a NaN value
      [&] { Poke(2, 99, &minus); },                            // an int8 tensor
      [&] { for (size_t i : {1, 3, 9, 13}) data_[i][i] ^= 1; },  // several dtypes
      [] {},                                                   // nothing again
      [&] { Poke(12, 0, &nan); Poke(10, 5, &minus); },          // NaN and int8 together
      [&] { for (size_t i = 0; i < kN; i++) data_[i][7] ^= 0x80; },  // every tensor
      [&] { Poke(19, 1, &half_nan); },                         // the last one, fp16 NaN
  };
  size_t patched_in_all = 0;
  for (int k = 0; k < 10; k++) {
    std::vector<std::vector<uint8_t>> before(data_, data_ + kN);
    steps[k]();
    size_t changed, patched;
    uint64_t bytes;
    Expect(before, &changed, &bytes, &patched);
    std::string v = "v" + std::to_string(k + 1);
    Sync(t, v, &res);
    EXPECT_EQ(1, res.delta) << v << ": " << (res.full_reason ? res.full_reason : "");
    EXPECT_EQ(changed, res.params) << v;
    EXPECT_EQ(bytes, res.bytes) << v;
    EXPECT_EQ(patched, res.patched_params) << v;
    EXPECT_EQ(kN - changed, res.skipped_params) << v;
    for (const Worker &w : ws_) EXPECT_EQ(v, Version(w));
    patched_in_all += patched;
  }
  if (mode_ == WTX_DELTA_PATCHES) {
    EXPECT_GT(patched_in_all, 20u);
  }
  wtx_trainer_shutdown(t);

  // A new trainer (a restarted one, or each `wtx push`) learns what the
  // workers serve from them and sends only what differs.
  data_[11][0] ^= 1;
  t = Trainer(c_);
  ASSERT_NE(nullptr, t);
  Sync(t, "fresh", &res);
  EXPECT_EQ(1, res.delta) << (res.full_reason ? res.full_reason : "");
  EXPECT_EQ(1u, res.params);
  EXPECT_EQ(kN - 1, res.skipped_params);
  wtx_trainer_shutdown(t);
}

// A worker that missed a step (another trainer published there) refuses
// the delta by its base version before any byte moves, and the same sync
// sends the whole model instead, saying why.
TEST_P(DeltaTest, ADeltaToAWorkerThatMissedAStepFallsBackToTheWholeModel) {
  TwoWorkers();
  wtx_trainer *t = Trainer(c_);
  ASSERT_NE(nullptr, t);
  wtx_send_result res;
  Sync(t, "v1", &res);
  // Another trainer (no delta) pushes other weights to worker 1 only.
  wtx_client *other = Client({ws_[1]}, 10000);
  std::vector<uint8_t> theirs[kN];
  wtx_memory_tensor tt[kN];
  for (size_t i = 0; i < kN; i++) {
    theirs[i] = data_[i];
    theirs[i][0] ^= 0xff;
    tt[i] = ts_[i];
    tt[i].data = theirs[i].data();
  }
  wtx_source *junk = nullptr;
  char e[512] = "";
  ASSERT_EQ(0, wtx_source_memory(tt, kN, &junk, e, sizeof e)) << e;
  std::string why;
  ASSERT_EQ(0, Push(other, junk, "elsewhere", 64 << 10, 2, 10000, &why)) << why;
  wtx_source_destroy(junk);
  wtx_client_destroy(other);

  data_[3][5] ^= 1;
  Sync(t, "v2", &res);
  EXPECT_EQ(0, res.delta);
  EXPECT_EQ(kN, res.params);
  ASSERT_NE(nullptr, res.full_reason);
  EXPECT_NE(nullptr, strstr(res.full_reason, "base_version")) << res.full_reason;
  EXPECT_NE(nullptr, strstr(res.full_reason, "'v1'")) << res.full_reason;
  EXPECT_NE(nullptr, strstr(res.full_reason, "'elsewhere'")) << res.full_reason;
  for (const Worker &w : ws_) EXPECT_EQ("v2", Version(w));
  // The whole model landed on both, so the next sync is a delta again.
  data_[4][0] ^= 1;
  Sync(t, "v3", &res);
  EXPECT_EQ(1, res.delta);
  EXPECT_EQ(1u, res.params);
  wtx_trainer_shutdown(t);
}

// A worker restarted between two syncs serves nothing: the delta's start
// is made again, as after any lost session, and that sync sends the whole
// model to every worker, saying why; the next is a delta again.
TEST_P(DeltaTest, AWorkerRestartedBetweenDeltasGetsTheWholeModel) {
  TwoWorkers();
  wtx_trainer *t = Trainer(c_);
  ASSERT_NE(nullptr, t);
  wtx_send_result res;
  Sync(t, "v1", &res);
  int port = ws_[1].port;
  Stop(workers_[1]);  // a new process on the same port, same publish dir
  Worker again = Spawn({"--listen", "127.0.0.1:" + std::to_string(port), "--publish-dir",
                        pubs_[1]});
  ASSERT_EQ(port, again.port);
  data_[6][0] ^= 1;
  Sync(t, "v2", &res);
  EXPECT_EQ(0, res.delta);
  EXPECT_EQ(kN, res.params);
  ASSERT_NE(nullptr, res.full_reason);
  data_[7][0] ^= 1;
  Sync(t, "v3", &res);
  EXPECT_EQ(1, res.delta) << (res.full_reason ? res.full_reason : "");
  EXPECT_EQ(1u, res.params);
  wtx_trainer_shutdown(t);
}

// A delta that fails partway (the source fails in its send pass, after the
// hash pass) leaves every worker's published version bit-exact, and the
// next sync lands.
TEST_P(DeltaTest, ADeltaThatFailsPartwayLeavesThePublishedVersionIntact) { FailPartway(); }

// The same with patches: what the failed sync would have changed is not
// taken for what the workers serve, so the next sync still lands exact.
TEST_P(DeltaTest, APatchedDeltaThatFailsPartwayLeavesThePublishedVersionIntact) {
  mode_ = WTX_DELTA_PATCHES;
  FailPartway();
}

void DeltaTest::FailPartway() {
  TwoWorkers();
  FailingSource fs{src_};
  wtx_source *failing = nullptr;
  ASSERT_EQ(0, wtx_source_create(&kFailingOps, &fs, &failing));
  wtx_trainer *t = Trainer(c_, failing);
  ASSERT_NE(nullptr, t);
  wtx_send_options so = WTX_SEND_OPTIONS_INIT;
  so.version = "v1";
  ASSERT_EQ(0, wtx_trainer_send_weights(t, &so, nullptr)) << wtx_trainer_last_error(t);
  std::map<std::string, uint64_t> v1 = Mine();
  for (size_t i = 0; i < kN; i += 2) data_[i][1] ^= 1;  // ten tensors change
  fs.fail_pass = fs.passes + 2;  // the send pass, after the hash pass
  fs.fail_at = 14;
  so.version = "v2";
  EXPECT_NE(0, wtx_trainer_send_weights(t, &so, nullptr));
  EXPECT_NE(nullptr, strstr(wtx_trainer_last_error(t), "iteration failed"))
      << wtx_trainer_last_error(t);
  for (size_t k = 0; k < ws_.size(); k++) {
    EXPECT_EQ("v1", Version(ws_[k]));
    EXPECT_EQ(v1, OnDisk(k, "v1"));
  }
  so.version = "v3";
  wtx_send_result res;
  ASSERT_EQ(0, wtx_trainer_send_weights(t, &so, &res)) << wtx_trainer_last_error(t);
  EXPECT_EQ(1, res.delta) << (res.full_reason ? res.full_reason : "");
  EXPECT_EQ(10u, res.params);
  for (size_t k = 0; k < ws_.size(); k++) EXPECT_EQ(Mine(), OnDisk(k, "v3"));
  wtx_trainer_shutdown(t);
  wtx_source_destroy(failing);
}

// The caller's own patches (vLLM's sparse_nccl trainer shape): they land
// bit-exact on every worker, a malformed one is refused before any byte
// moves, and patches computed against another version than a worker
// serves are refused by that worker with nothing applied anywhere.
TEST_P(DeltaTest, TheCallersPatchesLandExactAndBadOnesAreRefusedBeforeAnyByteMoves) {
  TwoWorkers();
  wtx_trainer *t = Trainer(c_);
  ASSERT_NE(nullptr, t);
  wtx_send_result res;
  Sync(t, "v1", &res);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<int32_t> fi = {1, 5, 100};
  std::vector<float> fv = {nan, 2.5f, -1.0f};
  std::vector<int64_t> bi = {0, 7};  // int64 indices work too
  std::vector<int8_t> bv = {-7, 3};
  wtx_patch ps[2] = {
      {names_[0].c_str(), WTX_DTYPE_FLOAT32, shapes_[0].data(), 2, WTX_DTYPE_INT32, 3, fi.data(),
       fv.data()},
      {names_[2].c_str(), WTX_DTYPE_INT8, shapes_[2].data(), 2, WTX_DTYPE_INT64, 2, bi.data(),
       bv.data()},
  };
  wtx_send_options so = WTX_SEND_OPTIONS_INIT;
  so.version = "p1";
  ASSERT_EQ(0, wtx_trainer_send_patches(t, ps, 2, &so, &res)) << wtx_trainer_last_error(t);
  EXPECT_EQ(2u, res.params);
  EXPECT_EQ(3u * 8 + 2u * 9, res.bytes);
  for (size_t k = 0; k < 3; k++) Poke(0, fi[k], &fv[k]);
  for (size_t k = 0; k < 2; k++) Poke(2, bi[k], &bv[k]);
  for (size_t k = 0; k < ws_.size(); k++) EXPECT_EQ(Mine(), OnDisk(k, "p1"));

  // Malformed: nothing moves, every worker stays on p1.
  std::vector<int32_t> twice = {3, 3}, back = {9, 2}, past = {0, 16 * 1024};
  std::vector<float> two = {1, 2};
  std::vector<float> many(9000, 1.0f);  // 72 kB of patch: past the 64 KiB buffer
  std::vector<int32_t> many_i(9000);
  for (size_t k = 0; k < many_i.size(); k++) many_i[k] = (int32_t)k;
  struct Bad {
    const int32_t *idx;
    uint64_t count;
    const float *vals;
    int rc;
    const char *says;
  } bad[] = {{twice.data(), 2, two.data(), WTX_EINVAL, "none repeats"},
             {back.data(), 2, two.data(), WTX_EINVAL, "not above the one before"},
             {past.data(), 2, two.data(), WTX_EINVAL, "past the tensor's elements"},
             {many_i.data(), 9000, many.data(), WTX_ETOOBIG, "more than a buffer"}};
  for (const Bad &b : bad) {
    wtx_patch p = {names_[0].c_str(), WTX_DTYPE_FLOAT32, shapes_[0].data(), 2, WTX_DTYPE_INT32,
                   b.count, b.idx, b.vals};
    so.version = "never";
    EXPECT_EQ(b.rc, wtx_trainer_send_patches(t, &p, 1, &so, &res)) << b.says;
    EXPECT_NE(nullptr, strstr(wtx_trainer_last_error(t), b.says)) << wtx_trainer_last_error(t);
    EXPECT_NE(nullptr, strstr(wtx_trainer_last_error(t), names_[0].c_str()))
        << wtx_trainer_last_error(t);
  }
  for (size_t k = 0; k < ws_.size(); k++) {
    EXPECT_EQ("p1", Version(ws_[k]));
    EXPECT_EQ(Mine(), OnDisk(k, "p1"));
  }

  // Worker 1 moves on without this trainer: patches for p1 are refused
  // there, and worker 0 does not apply them either.
  std::string backend = GetParam();
  wtx_client *other = Client({ws_[1]}, 10000);
  std::string why;
  ASSERT_EQ(0, Push(other, src_, "elsewhere", 64 << 10, 2, 10000, &why)) << why;
  wtx_client_destroy(other);
  so.version = "p2";
  EXPECT_EQ(WTX_ESTATE, wtx_trainer_send_patches(t, ps, 1, &so, &res));
  EXPECT_NE(nullptr, strstr(wtx_trainer_last_error(t), "'p1'")) << wtx_trainer_last_error(t);
  EXPECT_NE(nullptr, strstr(wtx_trainer_last_error(t), "'elsewhere'"))
      << wtx_trainer_last_error(t);
  EXPECT_EQ("p1", Version(ws_[0]));
  EXPECT_EQ("elsewhere", Version(ws_[1]));
  // The trainer's next delta sync learns what they serve and lands.
  data_[9][0] ^= 1;
  Sync(t, "v2", &res);
  wtx_trainer_shutdown(t);
}

// Patches into a model staging on the GPU (on the TEST DOUBLE, whose
// device memory the CPU cannot touch): a chunk carrying a patch is
// received on the host, where the patch applies to the published tensor
// read back, and each of its tensors then goes to its device staging. One
// delta of whole tensors and patches in 64 KiB chunks: tensor 4 begins in
// a chunk without a patch and ends in one with tensor 5's, and tensor 8
// runs on from that chunk into the next. The model's device bytes, hashed
// at each commit, are the trainer's, every tensor of them.
class GpuDeltaTest : public DeltaTest {};

TEST_P(GpuDeltaTest, PatchesReachAModelStagingOnTheGpuAmongWholeTensors) {
  mode_ = WTX_DELTA_PATCHES;
  TwoGpuWorkers();
  wtx_trainer *t = Trainer(c_);
  ASSERT_NE(nullptr, t);
  wtx_send_result res;
  Sync(t, "v0", &res);
  std::vector<std::vector<uint8_t>> before(data_, data_ + kN);
  for (size_t i : {1, 2, 4, 6, 8})
    for (auto &b : data_[i]) b ^= 0x33;
  const float two = 2.0f;
  Poke(5, 100, &two);
  size_t changed, patched;
  uint64_t bytes;
  Expect(before, &changed, &bytes, &patched);
  ASSERT_EQ(1u, patched);
  Sync(t, "v1", &res);
  EXPECT_EQ(1, res.delta) << (res.full_reason ? res.full_reason : "");
  EXPECT_EQ(6u, res.params);
  EXPECT_EQ(1u, res.patched_params);
  EXPECT_EQ(bytes, res.bytes);
  // Patches alone, over the version those made.
  Poke(0, 7, &two);
  Poke(19, 3, &two);
  Sync(t, "v2", &res);
  EXPECT_EQ(2u, res.patched_params);
  wtx_trainer_shutdown(t);
}

INSTANTIATE_TEST_SUITE_P(HostBackends, DeltaTest, ::testing::Values("shm", "tcp"),
                         [](const ::testing::TestParamInfo<const char *> &i) {
                           return std::string(i.param);
                         });
INSTANTIATE_TEST_SUITE_P(GpuBackendsOnTheCudaDouble, DeltaTest,
                         ::testing::Values("nccl", "cuda_ipc"),
                         [](const ::testing::TestParamInfo<const char *> &i) {
                           return std::string(i.param);
                         });
INSTANTIATE_TEST_SUITE_P(GpuBackendsOnTheCudaDouble, GpuDeltaTest,
                         ::testing::Values("nccl", "cuda_ipc"),
                         [](const ::testing::TestParamInfo<const char *> &i) {
                           return std::string(i.param);
                         });

}  // namespace wtxtest
