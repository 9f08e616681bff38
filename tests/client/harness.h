// Test harness shared by the engine tests and the GPU tests: wtx-worker
// processes on loopback and one-call pushes through the trainer engine.
#ifndef WTX_TESTS_CLIENT_HARNESS_H
#define WTX_TESTS_CLIENT_HARNESS_H

#include <gtest/gtest.h>
#include <xxhash.h>
#include <signal.h>
#include <spawn.h>
#include <poll.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "wtx/client.h"

extern char **environ;

namespace wtxtest {

struct Worker {
  pid_t pid = -1;
  int port = 0;
  std::string addr() const { return "127.0.0.1:" + std::to_string(port); }
};

// n float32 tensors "model.layers.I.w" of shape [16, 1024 + 64 I] and
// pseudo-random bytes, in memory, for tests that change some of them
// between syncs (data) and compare what workers hold with Hashes().
struct FloatModel {
  explicit FloatModel(size_t n) : names(n), shapes(n), data(n), ts(n) {
    uint64_t x = 0x9e3779b97f4a7c15ULL;
    for (size_t i = 0; i < n; i++) {
      shapes[i] = {16, 1024 + 64 * i};
      names[i] = "model.layers." + std::to_string(i) + ".w";
      data[i].resize(shapes[i][0] * shapes[i][1] * 4);
      for (auto &b : data[i]) x ^= x << 13, x ^= x >> 7, x ^= x << 17, b = (uint8_t)x;
      ts[i] = {names[i].c_str(), WTX_DTYPE_FLOAT32, shapes[i].data(), 2, data[i].data(), 0};
    }
  }
  FloatModel(const FloatModel &) = delete;
  FloatModel &operator=(const FloatModel &) = delete;
  // A source over the tensors as they are at each sync (the caller's);
  // nullptr, with a failure recorded, when it cannot be made.
  wtx_source *Source() {
    wtx_source *src = nullptr;
    char e[512] = "";
    EXPECT_EQ(0, wtx_source_memory(ts.data(), ts.size(), &src, e, sizeof e)) << e;
    return src;
  }
  // Each tensor's XXH3 by name, as the test holds it.
  std::map<std::string, uint64_t> Hashes() const {
    std::map<std::string, uint64_t> out;
    for (size_t i = 0; i < data.size(); i++)
      out[names[i]] = XXH3_64bits(data[i].data(), data[i].size());
    return out;
  }
  // Element e of tensor i set to v.
  void Set(size_t i, size_t e, float v) { memcpy(&data[i][e * 4], &v, 4); }
  std::vector<std::string> names;
  std::vector<std::vector<uint64_t>> shapes;
  std::vector<std::vector<uint8_t>> data;
  std::vector<wtx_memory_tensor> ts;
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
    std::vector<std::string> args = {worker_binary_, "--listen", "127.0.0.1:0",
                                     "--port-file", pf, "--log-level", "warn"};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char *> argv;
    for (auto &a : args) argv.push_back(const_cast<char *>(a.c_str()));
    argv.push_back(nullptr);
    // NCCL refuses two ranks on one GPU: unless the test chose a device,
    // worker k takes GPU k + 1 (the trainer, rank 0, has GPU 0).
    std::vector<std::string> env_s;
    for (char **e = environ; *e != nullptr; e++) env_s.emplace_back(*e);
    std::string backend = backend_.empty() ? GetParam() : backend_;
    if (backend.find("nccl") != std::string::npos && getenv("WTX_CUDA_DEVICE") == nullptr)
      env_s.push_back("WTX_CUDA_DEVICE=" + std::to_string(1 + workers_.size() % 7));
    std::vector<char *> envp;
    for (auto &e : env_s) envp.push_back(const_cast<char *>(e.c_str()));
    envp.push_back(nullptr);
    EXPECT_EQ(0, posix_spawn(&w.pid, argv[0], nullptr, nullptr, argv.data(), envp.data()));
    for (int i = 0; i < 1000 && w.port == 0; i++) {
      std::ifstream f(pf);
      if (!(f >> w.port)) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_NE(0, w.port) << worker_binary_ << " did not start";
    workers_.push_back(w);
    return w;
  }

  // SIGTERM, then the worker must exit 0 within 30 s.
  static void Stop(Worker &w) {
    if (w.pid <= 0) return;
    kill(w.pid, SIGTERM);
    ExpectExit(w.pid, 0, "worker, after SIGTERM");
    w.pid = -1;
  }

  // Process pid must exit with code within 30 s (it was told to end: what
  // says so). Under ASan a leak or an error report at exit is another
  // status, which fails the test that started it; one that does not exit
  // is killed and fails it too.
  static void ExpectExit(pid_t pid, int code, const char *what) {
    int st = 0, pidfd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
    pollfd p = {pidfd, POLLIN, 0};  // readable once the process has exited
    if (pidfd >= 0) poll(&p, 1, 30000);
    if (pidfd >= 0) close(pidfd);
    if (waitpid(pid, &st, WNOHANG) == 0) {
      kill(pid, SIGKILL);
      waitpid(pid, &st, 0);
      ADD_FAILURE() << what << " " << pid << ": did not exit within 30 s";
    } else {
      EXPECT_TRUE(WIFEXITED(st) && WEXITSTATUS(st) == code)
          << what << " " << pid << ": ended with status " << st
          << (WIFSIGNALED(st) ? " (a signal)" : " (its exit code)") << ", not exit " << code;
    }
  }

  wtx_client *Client(const std::vector<Worker> &ws, int64_t timeout_ms = 60000) {
    std::vector<std::string> addrs;
    for (auto &w : ws) addrs.push_back(w.addr());
    std::vector<const char *> t;
    for (auto &a : addrs) t.push_back(a.c_str());
    wtx_client_options o = WTX_CLIENT_OPTIONS_INIT;
    o.timeout_ms = timeout_ms;
    wtx_client *c = nullptr;
    char err[600] = "";
    EXPECT_EQ(0, wtx_client_create(t.data(), t.size(), &o, &c, err, sizeof err)) << err;
    return c;
  }

  // The trainer's config for the backend under test: checksums on for every
  // backend (GPU backends default to none). backend: GetParam() unless a
  // test names a wrapper registered under a name of its own.
  static wtx_trainer_config Config(const std::string &backend, uint64_t buffer,
                                   uint32_t nbuf, uint32_t timeout_ms) {
    wtx_trainer_config cfg = WTX_TRAINER_CONFIG_INIT;
    cfg.buffer_size = buffer;
    cfg.num_buffers = nbuf;
    cfg.timeout_ms = timeout_ms;
    cfg.checksum = WTX_CHECKSUM_XXH3_64;
    cfg.backend = backend.c_str();  // the caller keeps backend alive
    return cfg;
  }

  // A trainer of c over src for the backend under test, in delta mode
  // delta, 64 KiB buffers (tensors cut across chunks); nullptr, with a
  // failure recorded, when it cannot start.
  wtx_trainer *DeltaTrainer(wtx_client *c, wtx_source *src, int delta, uint32_t timeout_ms) {
    std::string backend = backend_.empty() ? GetParam() : backend_;
    wtx_trainer_config cfg = Config(backend, 64 << 10, 2, timeout_ms);
    cfg.delta = delta;
    wtx_trainer *t = nullptr;
    char e[1024] = "";
    EXPECT_EQ(0, wtx_trainer_init(&cfg, c, src, &t, e, sizeof e)) << e;
    return t;
  }

  // One push of src to c's workers; returns the engine's result code.
  int Push(wtx_client *c, wtx_source *src, const char *version, uint64_t buffer = 4 << 20,
           uint32_t nbuf = 2, uint32_t timeout_ms = 60000, std::string *err = nullptr,
           std::vector<uint64_t> *sums = nullptr,
           void (*progress)(void *, uint64_t, uint64_t) = nullptr, void *arg = nullptr) {
    std::string backend = backend_.empty() ? GetParam() : backend_;
    wtx_trainer_config cfg = Config(backend, buffer, nbuf, timeout_ms);
    cfg.direct = direct_;
    cfg.checksum = checksum_;
    wtx_trainer *t = nullptr;
    char e[2048] = "";
    int rc = wtx_trainer_init(&cfg, c, src, &t, e, sizeof e);
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
      last_direct_ = res.direct;
      if (sums) sums->assign(res.xxh3, res.xxh3 + res.params);
    }
    wtx_trainer_shutdown(t);
    return rc;
  }

  // Pushes src to c's workers ws as version v (1 MiB buffers) and checks
  // that every worker's published checksums equal the trainer's and that
  // each serves v; *sums gets the trainer's checksums.
  void PushAndVerify(wtx_client *c, const std::vector<Worker> &ws, wtx_source *src,
                     const std::string &v, std::vector<uint64_t> *sums) {
    std::string err;
    ASSERT_EQ(0, Push(c, src, v.c_str(), 1 << 20, 2, 60000, &err, sums)) << v << ": " << err;
    EXPECT_EQ(0, wtx_client_verify(c, src, sums->data())) << wtx_client_last_error(c);
    for (const Worker &w : ws) EXPECT_EQ(v, Version(w));
  }

  // What gpu_model_worker --sums wrote at its last commit: each tensor's
  // device bytes' hash by name; *version (may be NULL) its version.
  static std::map<std::string, uint64_t> DeviceSums(const std::string &path,
                                                    std::string *version = nullptr) {
    std::map<std::string, uint64_t> out;
    std::ifstream f(path);
    std::string name, hex;
    if (f >> name >> hex && name == "version" && version != nullptr) *version = hex;
    while (f >> name >> hex) out[name] = std::stoull(hex, nullptr, 16);
    return out;
  }
  // XXH3 of each tensor of src by name, as the test sees it (a device
  // tensor's bytes through the source's copy to the host).
  static std::map<std::string, uint64_t> HostSums(wtx_source *src) {
    std::map<std::string, uint64_t> out;
    void *it = nullptr;
    EXPECT_EQ(0, wtx_source_open(src, &it));
    wtx_tensor_meta m;
    const uint8_t *data;
    while (wtx_source_next(src, it, &m, &data) > 0) out[m.name] = XXH3_64bits(data, m.nbytes);
    wtx_source_close(src, it);
    return out;
  }

  std::string Version(const Worker &w) {
    wtx_client *c = Client({w});
    wtx_weight_info info;
    std::string v = "?";
    if (wtx_client_weight_info(c, 0, 0, &info) == 0) v = info.version;
    wtx_weight_info_free(&info);
    wtx_client_destroy(c);
    return v;
  }

  // What Spawn runs: wtx-worker, or a program taking the same --listen and
  // --port-file (tests/client/gpu_model_worker).
  std::string worker_binary_ = "server/wtx-worker";
  int direct_ = 0;       // wtx_trainer_config.direct of Push
  wtx_checksum checksum_ = WTX_CHECKSUM_XXH3_64;  // wtx_trainer_config.checksum of Push
  int last_direct_ = 0;  // wtx_send_result.direct of the last Push that landed
  std::string dir_;
  std::string backend_;  // a wrapper's name instead of GetParam(), when set
  std::vector<Worker> workers_;
};

// Every process of a test that registers this environment (workers and
// ranks inherit it) loads the TEST DOUBLE of CUDA and NCCL instead of the
// real libraries.
struct UseCudaDouble : ::testing::Environment {
  void SetUp() override {
    char cwd[4096];
    ASSERT_NE(nullptr, getcwd(cwd, sizeof cwd));
    std::string lib = std::string(cwd) + "/cuda/testing/libwtx_fake_cuda.so";
    setenv("WTX_CUDART_LIB", lib.c_str(), 1);
    setenv("WTX_NCCL_LIB", lib.c_str(), 1);
  }
};


// A TCP proxy on loopback in front of one worker's gRPC port, for faults of
// the network between a trainer and that worker. kPass: bytes flow both
// ways. kDropAnswers: requests reach the worker, its answers are lost.
// kCut: every connection is closed and the port refuses new ones, as an
// unreachable host does, until the next kPass listens on it again. The
// pumps wait in poll on their sockets; a cut or the destructor shuts those
// down, which ends the waits at once.
class Proxy {
 public:
  enum Mode { kPass, kDropAnswers, kCut };
  explicit Proxy(int upstream) : upstream_(upstream) { Listen(); }
  ~Proxy() {
    stop_ = true;
    Unlisten();
    ShutAll();
    for (auto &t : pumps_) t.join();
  }
  std::string addr() const { return "127.0.0.1:" + std::to_string(port_); }
  void Set(Mode m) {
    if (m == kCut && mode_ != kCut) {
      mode_ = m;
      Unlisten();
      ShutAll();
    } else if (m != kCut && mode_ == kCut) {
      mode_ = m;
      Listen();
    }
    mode_ = m;
  }

 private:
  void Listen() {
    lfd_ = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(lfd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port_));
    socklen_t len = sizeof a;
    ASSERT_EQ(0, bind(lfd_, reinterpret_cast<sockaddr *>(&a), sizeof a)) << port_;
    ASSERT_EQ(0, listen(lfd_, 16));
    ASSERT_EQ(0, getsockname(lfd_, reinterpret_cast<sockaddr *>(&a), &len));
    port_ = ntohs(a.sin_port);
    accept_ = std::thread([this] { Accept(); });
  }
  void Unlisten() {
    if (lfd_ < 0) return;
    shutdown(lfd_, SHUT_RDWR);  // ends the accept
    accept_.join();
    close(lfd_);
    lfd_ = -1;
  }
  void ShutAll() {
    std::lock_guard<std::mutex> l(mu_);
    for (int fd : open_) shutdown(fd, SHUT_RDWR);
  }
  void Accept() {
    for (;;) {
      int c = accept(lfd_, nullptr, nullptr);
      if (c < 0) return;  // shut down
      int u = Connect();
      if (u < 0) {
        close(c);
        continue;
      }
      std::lock_guard<std::mutex> l(mu_);
      open_.push_back(c);
      open_.push_back(u);
      pumps_.emplace_back([this, c, u] { Pump(c, u); });
    }
  }
  int Connect() {
    int u = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(upstream_));
    if (connect(u, reinterpret_cast<sockaddr *>(&a), sizeof a) == 0) return u;
    close(u);
    return -1;
  }
  // Copies c <-> u until either side closes or the proxy shuts them.
  void Pump(int c, int u) {
    char buf[65536];
    for (bool up = true; up && !stop_ && mode_ != kCut;) {
      pollfd p[2] = {{c, POLLIN, 0}, {u, POLLIN, 0}};
      poll(p, 2, -1);
      if (p[0].revents) up = Copy(c, u, buf, sizeof buf, true);
      if (up && p[1].revents) up = Copy(u, c, buf, sizeof buf, false);
    }
    std::lock_guard<std::mutex> l(mu_);
    for (int fd : {c, u}) {
      open_.erase(std::find(open_.begin(), open_.end(), fd));
      close(fd);
    }
  }
  bool Copy(int from, int to, char *buf, size_t len, bool request) {
    ssize_t n = read(from, buf, len);
    if (n <= 0) return false;
    if (!request && mode_ == kDropAnswers) return true;
    for (ssize_t o = 0; o < n;) {
      ssize_t w = write(to, buf + o, static_cast<size_t>(n - o));
      if (w <= 0) return false;
      o += w;
    }
    return true;
  }

  int upstream_, port_ = 0, lfd_ = -1;
  std::atomic<int> mode_{kPass};
  std::atomic<bool> stop_{false};
  std::mutex mu_;  // open_, pumps_
  std::vector<int> open_;
  std::thread accept_;
  std::vector<std::thread> pumps_;
};

}  // namespace wtxtest

#endif  // WTX_TESTS_CLIENT_HARNESS_H
