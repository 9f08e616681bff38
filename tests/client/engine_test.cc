// The trainer engine end to end against wtx-worker processes on loopback,
// over both host backends: full pushes with checksums compared on every
// worker, the fan-out rules with a failing replica, a source whose iteration
// disagrees with its metadata, and a worker killed mid-transfer.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "client/client.h"
#include "common/safetensors.h"

extern char **environ;

namespace {

struct Worker {
  pid_t pid = -1;
  int port = 0;
  std::string addr() const { return "127.0.0.1:" + std::to_string(port); }
};

class EngineTest : public ::testing::TestWithParam<const char *> {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/wtx-engine-XXXXXX";
    ASSERT_NE(nullptr, mkdtemp(tmpl));
    dir_ = tmpl;
  }
  void TearDown() override {
    for (Worker &w : workers_) Stop(w);
    EXPECT_EQ(0, std::system(("rm -rf " + dir_).c_str()));
  }

  Worker Spawn(std::vector<std::string> extra = {}) {
    Worker w;
    std::string pf = dir_ + "/port" + std::to_string(workers_.size());
    std::vector<std::string> args = {"server/wtx-worker", "--listen", "127.0.0.1:0",
                                     "--port-file", pf, "--log-level", "warn"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char *> argv;
    for (auto &a : args) argv.push_back(const_cast<char *>(a.c_str()));
    argv.push_back(nullptr);
    EXPECT_EQ(0, posix_spawn(&w.pid, argv[0], nullptr, nullptr, argv.data(), environ));
    for (int i = 0; i < 1000 && w.port == 0; i++) {
      std::ifstream f(pf);
      if (!(f >> w.port)) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_NE(0, w.port) << "wtx-worker did not start";
    workers_.push_back(w);
    return w;
  }

  static void Stop(Worker &w) {
    if (w.pid <= 0) return;
    kill(w.pid, SIGTERM);
    int st;
    waitpid(w.pid, &st, 0);
    w.pid = -1;
  }

  wtx_client *Client(const std::vector<Worker> &ws, int64_t timeout_ms = 60000) {
    std::vector<std::string> addrs;
    for (auto &w : ws) addrs.push_back(w.addr());
    std::vector<const char *> t;
    for (auto &a : addrs) t.push_back(a.c_str());
    wtx_client_options o = WTX_CLIENT_OPTIONS_INIT;
    o.timeout_ms = timeout_ms;
    wtx_client *c = nullptr;
    EXPECT_EQ(0, wtx_client_create(t.data(), t.size(), &o, &c));
    return c;
  }

  // The trainer's init info for the backend under test.
  struct Init {
    Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
    Wtx__V1__PackingParams pk = WTX__V1__PACKING_PARAMS__INIT;
    Wtx__V1__ShmInitInfo shm = WTX__V1__SHM_INIT_INFO__INIT;
    Wtx__V1__TcpInitInfo tcp = WTX__V1__TCP_INIT_INFO__INIT;
    Init(const std::string &backend, uint64_t buffer, uint32_t nbuf, uint32_t timeout_ms) {
      pk.packed = 1;
      pk.buffer_size_bytes = buffer;
      pk.num_buffers = nbuf;
      if (backend == "shm") {
        shm.packing = &pk;
        shm.timeout_ms = timeout_ms;
        ii.backend_case = WTX__V1__INIT_INFO__BACKEND_SHM;
        ii.shm = &shm;
      } else {
        tcp.packing = &pk;
        tcp.timeout_ms = timeout_ms;
        ii.backend_case = WTX__V1__INIT_INFO__BACKEND_TCP;
        ii.tcp = &tcp;
      }
    }
  };

  // One push of src to c's workers; returns the engine's result code.
  int Push(wtx_client *c, wtx_source *src, const char *version, uint64_t buffer = 4 << 20,
           uint32_t nbuf = 2, uint32_t timeout_ms = 60000, std::string *err = nullptr,
           std::vector<uint64_t> *sums = nullptr,
           void (*progress)(void *, uint64_t, uint64_t) = nullptr, void *arg = nullptr) {
    Init in(GetParam(), buffer, nbuf, timeout_ms);
    wtx_trainer_init_info ti = {0, &in.ii};
    wtx_trainer *t = nullptr;
    char e[2048] = "";
    int rc = wtx_trainer_init(&ti, c, src, &t, e, sizeof e);
    if (rc != 0) {
      if (err) *err = e;
      return rc;
    }
    wtx_send_options so = WTX_SEND_OPTIONS_INIT;
    so.version = version;
    so.progress = progress;
    so.progress_arg = arg;
    wtx_send_result res;
    rc = wtx_trainer_send_weights(t, &so, &res);
    if (rc != 0 && err) *err = wtx_trainer_last_error(t);
    if (rc == 0) {
      EXPECT_STREQ(version, res.version);
      if (sums) sums->assign(res.xxh3, res.xxh3 + res.params);
    }
    wtx_trainer_shutdown(t);
    return rc;
  }

  std::string Version(const Worker &w) {
    wtx_client *c = Client({w});
    Wtx__V1__GetWeightInfoResponse *info = nullptr;
    std::string v = "?";
    if (wtx_client_weight_info(c, 0, 0, &info) == 0) {
      v = info->weight_version;
      protobuf_c_message_free_unpacked(&info->base, nullptr);
    }
    wtx_client_destroy(c);
    return v;
  }

  std::string dir_;
  std::vector<Worker> workers_;
};

TEST_P(EngineTest, PushesAMultiHundredMegabyteModelToTwoWorkerProcesses) {
  Worker a = Spawn(), b = Spawn();
  wtx_client *c = Client({a, b});
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(UINT64_C(300) << 20, 42, &src));
  std::vector<uint64_t> sums;
  std::string err;
  ASSERT_EQ(0, Push(c, src, "step-1", 16 << 20, 2, 60000, &err, &sums)) << err;
  // Every worker's published checksums equal the trainer's.
  EXPECT_EQ(0, wtx_client_verify(c, src, sums.data())) << wtx_client_last_error(c);
  uint64_t total = 0;
  wtx_source_total_bytes(src, &total);
  EXPECT_GT(total, UINT64_C(250) << 20);
  for (size_t i = 0; i < 2; i++) {
    Wtx__V1__GetWeightInfoResponse *info = nullptr;
    ASSERT_EQ(0, wtx_client_weight_info(c, i, 0, &info));
    EXPECT_STREQ("step-1", info->weight_version);
    EXPECT_EQ(total, info->total_bytes);
    protobuf_c_message_free_unpacked(&info->base, nullptr);
  }
  wtx_source_destroy(src);
  wtx_client_destroy(c);
}

// Mixed dtypes, one tensor larger than the buffer, three workers, buffers
// from 1 KiB to 1 GiB.
TEST_P(EngineTest, MixedDtypesAndATensorLargerThanTheBufferReachThreeWorkers) {
  Worker w0 = Spawn(), w1 = Spawn(), w2 = Spawn();
  wtx_client *c = Client({w0, w1, w2});
  std::vector<uint8_t> big(3 << 20), small(1000), bf(4096), i8(77);
  for (size_t i = 0; i < big.size(); i++) big[i] = (uint8_t)(i * 31 + 7);
  for (size_t i = 0; i < bf.size(); i++) bf[i] = (uint8_t)(i ^ 0x5a);
  uint64_t s_big[2] = {768, 1024}, s_small[1] = {250}, s_bf[2] = {32, 64}, s_i8[1] = {77},
           s_empty[2] = {0, 5};
  wtx_memory_tensor ts[] = {
      {"model.layers.0.big", WTX_DTYPE_FLOAT32, s_big, 2, big.data()},
      {"model.layers.0.small", WTX_DTYPE_INT32, s_small, 1, small.data()},
      {"model.layers.1.bf", WTX_DTYPE_BFLOAT16, s_bf, 2, bf.data()},
      {"model.layers.1.empty", WTX_DTYPE_FLOAT16, s_empty, 2, nullptr},
      {"lm_head.q", WTX_DTYPE_INT8, s_i8, 1, i8.data()},
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

TEST_P(EngineTest, AFailingReplicaFailsTheSyncByNameAndTheOthersKeepTheirWeights) {
  // Replica 1 declares another layout, so it refuses the update that
  // replica 0 accepts and stages.
  std::string spec = dir_ + "/spec.safetensors";
  std::vector<uint8_t> x(8);
  wtx_st_tensor other = {"other.weight", WTX_DTYPE_UINT8, {8}, 1, 8, x.data()};
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

// A source whose iteration yields a different shape than its metadata.
struct LyingSource {
  wtx_param_meta metas[3];
  std::vector<uint8_t> data = std::vector<uint8_t>(64, 9);
  static int Metadata(void *self, const wtx_param_meta **m, size_t *n) {
    *m = static_cast<LyingSource *>(self)->metas;
    *n = 3;
    return 0;
  }
  static int Open(void *, void **iter) {
    *iter = new size_t(0);
    return 0;
  }
  static int Next(void *self, void *iter, wtx_param_meta *meta, const uint8_t **data) {
    auto *s = static_cast<LyingSource *>(self);
    size_t &i = *static_cast<size_t *>(iter);
    if (i == 3) return 0;
    *meta = s->metas[i];
    if (i == 2) meta->shape[0] = 8;  // metadata says 16
    *data = s->data.data();
    i++;
    return 1;
  }
  static void Close(void *, void *iter) { delete static_cast<size_t *>(iter); }
};
const wtx_source_ops kLying = {"lying", LyingSource::Metadata, LyingSource::Open,
                               LyingSource::Next, LyingSource::Close, nullptr};

TEST_P(EngineTest, IterationDisagreeingWithMetadataIsCaughtBeforeTheWire) {
  Worker a = Spawn();
  LyingSource ls;
  const char *names[] = {"a", "b", "c"};
  for (int i = 0; i < 3; i++) {
    ls.metas[i] = wtx_param_meta{};
    ls.metas[i].name = names[i];
    ls.metas[i].dtype = WTX_DTYPE_FLOAT32;
    ls.metas[i].shape[0] = 16;
    ls.metas[i].ndim = 1;
    ls.metas[i].nbytes = 64;
  }
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_create(&kLying, &ls, &src));
  wtx_client *c = Client({a});
  std::string err;
  EXPECT_EQ(WTX_EINVAL, Push(c, src, "lie", 1 << 20, 2, 60000, &err));
  EXPECT_NE(std::string::npos,
            err.find("parameter 2 of the iteration is 'c' FLOAT32 [8] but metadata() "
                     "says 'c' FLOAT32 [16]"))
      << err;
  EXPECT_EQ("", Version(a));  // nothing was published
  Wtx__V1__GetWeightInfoResponse *info = nullptr;
  ASSERT_EQ(0, wtx_client_weight_info(c, 0, 0, &info));
  EXPECT_EQ(0u, info->num_params);
  protobuf_c_message_free_unpacked(&info->base, nullptr);
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

TEST_P(EngineTest, AWorkerKilledMidTransferEndsTheSyncWithinTheTimeout) {
  Worker w0 = Spawn(), w1 = Spawn(), w2 = Spawn();
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(64 << 20, 3, &src));
  wtx_client *c = Client({w0, w1, w2}, 5000);
  std::string err;
  ASSERT_EQ(0, Push(c, src, "v1", 1 << 20, 2, 5000, &err)) << err;
  KillAt k;
  k.pid = w1.pid;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(0, Push(c, src, "v2", 1 << 20, 2, 5000, &err, nullptr, KillHalfway, &k));
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(k.killed);
  EXPECT_LT(secs, 15.0) << "bounded by the 5 s timeout per step: " << err;
  EXPECT_NE(std::string::npos, err.find("worker")) << err;
  int st;
  waitpid(w1.pid, &st, 0);
  workers_[1].pid = -1;
  // The survivors keep the previous version and take the next sync.
  EXPECT_EQ("v1", Version(w0));
  EXPECT_EQ("v1", Version(w2));
  wtx_client_destroy(c);
  c = Client({w0, w2}, 5000);
  ASSERT_EQ(0, Push(c, src, "v3", 1 << 20, 2, 5000, &err)) << err;
  EXPECT_EQ("v3", Version(w2));
  wtx_client_destroy(c);
  wtx_source_destroy(src);
}

TEST_P(EngineTest, RanksOtherThanZeroIterateWithoutSending) {
  wtx_source *src = nullptr;
  ASSERT_EQ(0, wtx_source_synthetic(1 << 20, 1, &src));
  Init in(GetParam(), 1 << 20, 2, 1000);
  wtx_trainer_init_info ti = {1, &in.ii};
  wtx_trainer *t = nullptr;
  char e[512] = "";
  ASSERT_EQ(0, wtx_trainer_init(&ti, nullptr, src, &t, e, sizeof e)) << e;
  EXPECT_EQ(0, wtx_trainer_send_weights(t, nullptr, nullptr)) << wtx_trainer_last_error(t);
  wtx_trainer_shutdown(t);
  wtx_source_destroy(src);
}

INSTANTIATE_TEST_SUITE_P(HostBackends, EngineTest, ::testing::Values("shm", "tcp"),
                         [](const auto &info) { return std::string(info.param); });

}  // namespace
