// The worker's session state machine over real loopback gRPC and the shm
// backend: every refusal with its code and message, and the guarantee that a
// failed or aborted update leaves the published weights bit-exact.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>
#include <xxhash.h>

#include <dirent.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/layout.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "grpc/health/v1/health.grpc-c.h"
#include "wtx/worker.h"
#include "transport/tcp_frame.h"
#include "transport/transport.h"
#include "wtx/v1/weight_transfer.grpc-c.h"
#include "tests/client/vllm_standin.h"
#include "tests/common/dir_wait.h"

namespace {

struct Tensor {
  std::string name;
  std::vector<uint8_t> data;  // FLOAT32, shape {n/4}
};

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    region_ = "/wtx-test-" + std::to_string(getpid());
    Restart(WTX_WORKER_OPTIONS_INIT);
  }
  void TearDown() override {
    if (ch_ != nullptr) wtx__rpc_channel_destroy(ch_);
    wtx_worker_destroy(w_);
    shm_unlink(region_.c_str());
  }

  // Stops the fixture's worker.
  void Stop() {
    if (ch_ != nullptr) wtx__rpc_channel_destroy(ch_);
    ch_ = nullptr;
    wtx_worker_destroy(w_);
    w_ = nullptr;
  }

  // Replaces the fixture's worker by one started with o (listen is set here).
  void Restart(wtx_worker_options o) {
    Stop();
    o.listen = "127.0.0.1:0";
    char err[256] = "";
    ASSERT_EQ(0, wtx_worker_start(&o, &w_, err, sizeof err)) << err;
    std::string t = "127.0.0.1:" + std::to_string(wtx_worker_port(w_));
    ASSERT_EQ(0, wtx__rpc_channel_create(t.c_str(), nullptr, &ch_));
  }

  int Info(Wtx__V1__GetWeightInfoResponse **info) {
    Wtx__V1__GetWeightInfoRequest req = WTX__V1__GET_WEIGHT_INFO_REQUEST__INIT;
    return wtx__v1__weight_transfer__get_weight_info__call(ch_, &req, info, nullptr, &st_);
  }

  // Replaces the fixture's worker by one serving model through ops, and
  // initializes its session.
  void Serve(const wtx_model_ops *ops, void *model) {
    wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
    o.model_ops = ops;
    o.model = model;
    Restart(o);
    ASSERT_EQ(0, Init()) << st_.message;
  }

  // InitWeightTransferEngine with the InitInfo member named backend (left
  // at its defaults), found in the schema: no per-backend code here.
  int Init(const char *backend = "shm", uint32_t checksum = 0, uint32_t timeout_ms = 0) {
    Wtx__V1__PackingParams pk = WTX__V1__PACKING_PARAMS__INIT;
    Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
    ii.packing = &pk;
    ii.checksum = (Wtx__V1__ChecksumAlgorithm)checksum;
    ii.timeout_ms = timeout_ms;
    const ProtobufCFieldDescriptor *f =
        protobuf_c_message_descriptor_get_field_by_name(&wtx__v1__init_info__descriptor, backend);
    alignas(max_align_t) uint8_t member[256];
    if (f != nullptr && (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF)) {
      const auto *md = static_cast<const ProtobufCMessageDescriptor *>(f->descriptor);
      EXPECT_LE(md->sizeof_message, sizeof member);
      md->message_init(reinterpret_cast<ProtobufCMessage *>(member));
      *reinterpret_cast<void **>(reinterpret_cast<uint8_t *>(&ii) + f->offset) = member;
      *reinterpret_cast<uint32_t *>(reinterpret_cast<uint8_t *>(&ii) + f->quantifier_offset) =
          f->id;
    }
    Wtx__V1__InitWeightTransferEngineRequest req =
        WTX__V1__INIT_WEIGHT_TRANSFER_ENGINE_REQUEST__INIT;
    req.init_info = &ii;
    Wtx__V1__InitWeightTransferEngineResponse *resp = nullptr;
    int rc = wtx__v1__weight_transfer__init_weight_transfer_engine__call(
        ch_, &req, &resp, nullptr, &st_);
    if (rc == 0) {
      session_ = resp->session_id;
      EXPECT_EQ(32u, session_.size());
      protobuf_c_message_free_unpacked(&resp->base, nullptr);
    }
    return rc;
  }

  int Start(Wtx__V1__UpdateTarget target = WTX__V1__UPDATE_TARGET__UPDATE_TARGET_MAIN,
            uint32_t expected_params = 0, const char *base_version = "") {
    Wtx__V1__StartWeightUpdateRequest req = WTX__V1__START_WEIGHT_UPDATE_REQUEST__INIT;
    req.session_id = const_cast<char *>(session_.c_str());
    req.target = target;
    req.expected_params = expected_params;
    req.base_version = const_cast<char *>(base_version);
    Wtx__V1__StartWeightUpdateResponse *resp = nullptr;
    int rc = wtx__v1__weight_transfer__start_weight_update__call(ch_, &req, &resp,
                                                                  nullptr, &st_);
    if (rc == 0) {
      update_ = resp->update_id;
      table_ = resp->table_xxh3;
      serves_ = resp->weight_version;
      protobuf_c_message_free_unpacked(&resp->base, nullptr);
    }
    return rc;
  }

  // One chunk holding whole tensors; corrupt flips a byte after hashing;
  // range (when given) names them by position instead of by params.
  int Update(const std::vector<Tensor> &ts, bool corrupt = false,
             const Wtx__V1__ParamRange *range = nullptr,
             const std::vector<Wtx__V1__TensorPart *> *parts = nullptr) {
    std::vector<uint8_t> bytes;
    std::vector<uint64_t> sums;
    std::vector<Wtx__V1__ParamMeta> pm(ts.size());
    std::vector<Wtx__V1__ParamMeta *> pmp(ts.size());
    std::vector<uint64_t> shapes(ts.size());
    for (size_t i = 0; i < ts.size(); i++) {
      bytes.insert(bytes.end(), ts[i].data.begin(), ts[i].data.end());
      sums.push_back(XXH3_64bits(ts[i].data.data(), ts[i].data.size()));
      wtx__v1__param_meta__init(&pm[i]);
      pm[i].name = const_cast<char *>(ts[i].name.c_str());
      pm[i].dtype = WTX__V1__DTYPE__DTYPE_FLOAT32;
      shapes[i] = ts[i].data.size() / 4;
      pm[i].shape = &shapes[i];
      pm[i].n_shape = 1;
      pm[i].part = parts != nullptr ? (*parts)[i] : nullptr;
      pmp[i] = &pm[i];
    }
    if (corrupt && !bytes.empty()) bytes[bytes.size() / 2] ^= 0x40;
    Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
    ui.chunk_bytes = bytes.size();
    ui.xxh3_64 = sums.data();
    ui.n_xxh3_64 = sums.size();
    if (range != nullptr) {
      ui.layout = const_cast<Wtx__V1__ParamRange *>(range);
    } else {
      ui.params = pmp.data();
      ui.n_params = pmp.size();
    }
    return SendShm(bytes, &ui);
  }

  // UpdateWeights of ui, its chunk's bytes in the fixture's shm region.
  int SendShm(const std::vector<uint8_t> &bytes, Wtx__V1__UpdateInfo *ui) {
    size_t len = bytes.empty() ? 1 : bytes.size();
    int fd = shm_open(region_.c_str(), O_RDWR | O_CREAT, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(0, ftruncate(fd, (off_t)len));
    auto *buf = static_cast<uint8_t *>(
        mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    if (!bytes.empty()) memcpy(buf, bytes.data(), bytes.size());
    Wtx__V1__ShmUpdateInfo su = WTX__V1__SHM_UPDATE_INFO__INIT;
    su.region = const_cast<char *>(region_.c_str());
    ui->backend_case = WTX__V1__UPDATE_INFO__BACKEND_SHM;
    ui->shm = &su;
    int rc = SendUpdate(ui);
    munmap(buf, len);
    close(fd);
    return rc;
  }

  // UpdateWeights of the current update with ui.
  int SendUpdate(Wtx__V1__UpdateInfo *ui) {
    Wtx__V1__UpdateWeightsRequest req = WTX__V1__UPDATE_WEIGHTS_REQUEST__INIT;
    req.session_id = const_cast<char *>(session_.c_str());
    req.update_id = update_;
    req.update_info = ui;
    Wtx__V1__UpdateWeightsResponse *resp = nullptr;
    int rc = wtx__v1__weight_transfer__update_weights__call(ch_, &req, &resp, nullptr, &st_);
    if (resp) protobuf_c_message_free_unpacked(&resp->base, nullptr);
    return rc;
  }

  // PrepareWeightUpdate of the current update; *resp (when given) is the
  // caller's to free.
  int Prepare(const char *version, Wtx__V1__PrepareWeightUpdateResponse **resp = nullptr) {
    Wtx__V1__PrepareWeightUpdateRequest req = WTX__V1__PREPARE_WEIGHT_UPDATE_REQUEST__INIT;
    req.session_id = const_cast<char *>(session_.c_str());
    req.update_id = update_;
    req.weight_version = const_cast<char *>(version);
    Wtx__V1__PrepareWeightUpdateResponse *r = nullptr;
    int rc = wtx__v1__weight_transfer__prepare_weight_update__call(ch_, &req, &r, nullptr, &st_);
    if (resp != nullptr) *resp = r;
    else if (r != nullptr) protobuf_c_message_free_unpacked(&r->base, nullptr);
    return rc;
  }

  int Finish(const char *version = "") {
    Wtx__V1__FinishWeightUpdateRequest req = WTX__V1__FINISH_WEIGHT_UPDATE_REQUEST__INIT;
    req.session_id = const_cast<char *>(session_.c_str());
    req.update_id = update_;
    req.weight_version = const_cast<char *>(version);
    Wtx__V1__FinishWeightUpdateResponse *resp = nullptr;
    int rc = wtx__v1__weight_transfer__finish_weight_update__call(ch_, &req, &resp,
                                                                   nullptr, &st_);
    if (resp) protobuf_c_message_free_unpacked(&resp->base, nullptr);
    return rc;
  }

  int Abort() {
    Wtx__V1__AbortWeightUpdateRequest req = WTX__V1__ABORT_WEIGHT_UPDATE_REQUEST__INIT;
    req.session_id = const_cast<char *>(session_.c_str());
    Wtx__V1__AbortWeightUpdateResponse *resp = nullptr;
    int rc = wtx__v1__weight_transfer__abort_weight_update__call(ch_, &req, &resp,
                                                                  nullptr, &st_);
    if (resp) protobuf_c_message_free_unpacked(&resp->base, nullptr);
    return rc;
  }

  // AbortWeightUpdate naming update (an undo, once it is published);
  // *reverted and *version (when given) take the answer.
  int AbortNamed(uint64_t update, bool *reverted = nullptr, std::string *version = nullptr) {
    Wtx__V1__AbortWeightUpdateRequest req = WTX__V1__ABORT_WEIGHT_UPDATE_REQUEST__INIT;
    req.session_id = const_cast<char *>(session_.c_str());
    req.update_id = update;
    req.reason = const_cast<char *>("another replica did not publish it");
    Wtx__V1__AbortWeightUpdateResponse *resp = nullptr;
    int rc = wtx__v1__weight_transfer__abort_weight_update__call(ch_, &req, &resp,
                                                                  nullptr, &st_);
    if (resp != nullptr) {
      if (reverted != nullptr) *reverted = resp->reverted;
      if (version != nullptr) *version = resp->weight_version;
      protobuf_c_message_free_unpacked(&resp->base, nullptr);
    }
    return rc;
  }

  static Tensor T(const std::string &name, size_t floats, uint8_t fill) {
    Tensor t{name, std::vector<uint8_t>(floats * 4)};
    for (size_t i = 0; i < t.data.size(); i++) t.data[i] = (uint8_t)(fill + i);
    return t;
  }

  // The published weights: name -> bytes, and the version.
  std::string Published(std::vector<std::pair<std::string, std::vector<uint8_t>>> *out) {
    wtx_store_view v;
    wtx_store_acquire(wtx_worker_store(w_), WTX_TARGET_MAIN, &v);
    std::string version = v.version;
    out->clear();
    for (size_t i = 0; i < v.n_params; i++)
      out->emplace_back(v.params[i].meta.name,
                        std::vector<uint8_t>(v.params[i].data,
                                             v.params[i].data + v.params[i].meta.nbytes));
    wtx_store_release(wtx_worker_store(w_), &v);
    return version;
  }

  void PublishV1() {
    ASSERT_EQ(0, Init()) << st_.message;
    ASSERT_EQ(0, Start()) << st_.message;
    ASSERT_EQ(0, Update({T("a", 16, 1), T("b", 8, 2)})) << st_.message;
    ASSERT_EQ(0, Finish("v1")) << st_.message;
    v1_version_ = Published(&v1_);
    ASSERT_EQ("v1", v1_version_);
  }

  void ExpectV1Intact() {
    std::vector<std::pair<std::string, std::vector<uint8_t>>> now;
    EXPECT_EQ("v1", Published(&now));
    EXPECT_EQ(v1_, now);
  }

  wtx_worker *w_ = nullptr;
  wtx__rpc_channel *ch_ = nullptr;
  wtx__rpc_status st_;
  std::string session_, region_;
  uint64_t update_ = 0;
  uint64_t table_ = 0;  // StartWeightUpdateResponse.table_xxh3
  std::string serves_;  // StartWeightUpdateResponse.weight_version
  std::vector<std::pair<std::string, std::vector<uint8_t>>> v1_;
  std::string v1_version_;

  wtx__rpc_pending *StartSlowUpdate();
  // A worker serving nccl with the slow double, and a session on it.
  void InitOnSlowDouble();
};

// UpdateWeights of (session, update) with ui as the update's call
// call_index (0: unordered), started (waited for by the caller).
wtx__rpc_pending *StartOrderedCall(wtx__rpc_channel *ch, const std::string &session,
                                  uint64_t update, Wtx__V1__UpdateInfo *ui,
                                  uint32_t call_index) {
  Wtx__V1__UpdateWeightsRequest req = WTX__V1__UPDATE_WEIGHTS_REQUEST__INIT;
  req.session_id = const_cast<char *>(session.c_str());
  req.update_id = update;
  req.update_info = ui;
  req.call_index = call_index;
  wtx__rpc_pending *p = nullptr;
  EXPECT_EQ(0, wtx__v1__weight_transfer__update_weights__start(ch, &req, nullptr, &p));
  return p;
}

wtx__rpc_pending *StartUpdateCall(wtx__rpc_channel *ch, const std::string &session,
                                 uint64_t update, Wtx__V1__UpdateInfo *ui) {
  return StartOrderedCall(ch, session, update, ui, 0);
}

void ReleaseSlowReceive();
// Registers the slow double (once) and has o's worker serve nccl with it.
void UseSlowDouble(wtx_worker_options *o);

TEST_F(SessionTest, FullUpdatePublishesBitExactWithChecksums) {
  PublishV1();
  ASSERT_EQ(2u, v1_.size());
  EXPECT_EQ("a", v1_[0].first);
  EXPECT_EQ(T("a", 16, 1).data, v1_[0].second);
  EXPECT_EQ(T("b", 8, 2).data, v1_[1].second);
  wtx_store_view v;
  wtx_store_acquire(wtx_worker_store(w_), WTX_TARGET_MAIN, &v);
  EXPECT_EQ(XXH3_64bits(v1_[0].second.data(), 64), v.params[0].xxh3);
  EXPECT_EQ(1u, v.generation);
  wtx_store_release(wtx_worker_store(w_), &v);
}

// Several chunks in one UpdateWeights (UpdateWeightsRequest.then), as rank
// 0 of many senders names them: "a" (16 floats) cut across the first two,
// "b" after it, "c" in the third. Each chunk's bytes lie in the region at
// its own offset.
class BatchTest : public SessionTest {
 protected:
  int SendInOrder(const std::vector<Wtx__V1__UpdateInfo *> &ui, const std::vector<size_t> &order);
  // The update's chunks: [from, to) of the stream each, and the tensors
  // (name, floats) each touches, as ParamMeta.
  struct Chunk {
    size_t from, to;
    std::vector<std::pair<std::string, uint64_t>> params;
  };
  // One call of chunks over bytes (the whole stream): checksums of every
  // tensor whose last byte is in its chunk, flipped in chunk `corrupt`.
  int SendBatch(const std::vector<uint8_t> &bytes, const std::vector<Chunk> &chunks,
                int corrupt = -1) {
    return SendChunks(bytes, chunks, corrupt, {});
  }
  // The same chunks, each in a call of its own with its call_index (from
  // 1), the calls started in `order` (indexes into chunks) a little apart
  // and then awaited. The result is the first failure in call order (st_
  // its status), else 0.
  int SendOrdered(const std::vector<uint8_t> &bytes, const std::vector<Chunk> &chunks,
                  const std::vector<size_t> &order) {
    return SendChunks(bytes, chunks, -1, order);
  }
  int SendChunks(const std::vector<uint8_t> &bytes, const std::vector<Chunk> &chunks,
                 int corrupt, const std::vector<size_t> &order) {
    size_t n = chunks.size();
    std::vector<Wtx__V1__UpdateInfo> ui(n);
    std::vector<Wtx__V1__UpdateInfo *> uip;
    std::vector<Wtx__V1__ShmUpdateInfo> su(n);
    std::vector<std::vector<Wtx__V1__ParamMeta>> pm(n);
    std::vector<std::vector<Wtx__V1__ParamMeta *>> pmp(n);
    std::vector<std::vector<uint64_t>> shapes(n), sums(n);
    std::map<std::string, size_t> begins;  // each tensor's first byte in the stream
    size_t next = 0;
    for (const Chunk &c : chunks)
      for (const auto &p : c.params)
        if (begins.emplace(p.first, next).second) next += p.second * 4;
    for (size_t k = 0; k < n; k++) {
      const Chunk &c = chunks[k];
      for (const auto &p : c.params) {
        size_t b = begins[p.first], e = b + p.second * 4;
        if (e > c.from && e <= c.to)
          sums[k].push_back(XXH3_64bits(bytes.data() + b, e - b) ^ ((int)k == corrupt));
      }
      shapes[k].resize(c.params.size());
      pm[k].resize(c.params.size());
      for (size_t i = 0; i < c.params.size(); i++) {
        wtx__v1__param_meta__init(&pm[k][i]);
        pm[k][i].name = const_cast<char *>(c.params[i].first.c_str());
        pm[k][i].dtype = WTX__V1__DTYPE__DTYPE_FLOAT32;
        shapes[k][i] = c.params[i].second;
        pm[k][i].shape = &shapes[k][i];
        pm[k][i].n_shape = 1;
        pmp[k].push_back(&pm[k][i]);
      }
      wtx__v1__update_info__init(&ui[k]);
      wtx__v1__shm_update_info__init(&su[k]);
      su[k].region = const_cast<char *>(region_.c_str());
      su[k].offset = c.from;
      ui[k].backend_case = WTX__V1__UPDATE_INFO__BACKEND_SHM;
      ui[k].shm = &su[k];
      ui[k].params = pmp[k].data();
      ui[k].n_params = pmp[k].size();
      ui[k].first_param_offset = c.from - begins[c.params[0].first];
      ui[k].chunk_bytes = c.to - c.from;
      ui[k].xxh3_64 = sums[k].data();
      ui[k].n_xxh3_64 = sums[k].size();
      uip.push_back(&ui[k]);
    }
    int fd = shm_open(region_.c_str(), O_RDWR | O_CREAT, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(0, ftruncate(fd, (off_t)bytes.size()));
    EXPECT_EQ((ssize_t)bytes.size(), pwrite(fd, bytes.data(), bytes.size(), 0));
    if (!order.empty()) {
      int rc = SendInOrder(uip, order);
      close(fd);
      return rc;
    }
    Wtx__V1__UpdateWeightsRequest req = WTX__V1__UPDATE_WEIGHTS_REQUEST__INIT;
    req.session_id = const_cast<char *>(session_.c_str());
    req.update_id = update_;
    req.update_info = uip[0];
    req.then = uip.data() + 1;
    req.n_then = n - 1;
    Wtx__V1__UpdateWeightsResponse *resp = nullptr;
    int rc = wtx__v1__weight_transfer__update_weights__call(ch_, &req, &resp, nullptr, &st_);
    if (resp) protobuf_c_message_free_unpacked(&resp->base, nullptr);
    close(fd);
    return rc;
  }
};

// The worker's log lines, while one is held: a test waits for the line
// that says a call is waiting for its turn, not for a guess of the time.
class WaitLog {
 public:
  WaitLog() {
    wtx__log_set_sink(Sink, this);
    wtx__log_set_level(WTX__LOG_DEBUG);
  }
  ~WaitLog() {
    wtx__log_set_sink(nullptr, nullptr);
    wtx__log_set_level(WTX__LOG_INFO);
  }
  // Whether a line holding `text` came within 10 s.
  bool Saw(const std::string &text) {
    std::unique_lock<std::mutex> lk(mu_);
    return cv_.wait_for(lk, std::chrono::seconds(10), [&] {
      for (const std::string &l : lines_)
        if (l.find(text) != std::string::npos) return true;
      return false;
    });
  }

 private:
  static void Sink(void *user, int, const char *line) {
    auto *w = static_cast<WaitLog *>(user);
    std::lock_guard<std::mutex> lk(w->mu_);
    w->lines_.emplace_back(line);
    w->cv_.notify_all();
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::string> lines_;
};

int BatchTest::SendInOrder(const std::vector<Wtx__V1__UpdateInfo *> &ui,
                           const std::vector<size_t> &order) {
  WaitLog log;
  std::vector<wtx__rpc_pending *> calls(ui.size(), nullptr);
  size_t taken = 0;  // calls before the first still unsent have all ended
  for (size_t k : order) {
    calls[k] = StartOrderedCall(ch_, session_, update_, ui[k], static_cast<uint32_t>(k + 1));
    while (taken < ui.size() && calls[taken] != nullptr) taken++;
    // Unless its turn has come, the call waits before the next is sent.
    if (k > taken) {
      EXPECT_TRUE(log.Saw("call_index=" + std::to_string(k + 1) + " for=")) << k + 1;
    }
  }
  int rc = 0;
  for (wtx__rpc_pending *p : calls) {
    ProtobufCMessage *m = nullptr;
    wtx__rpc_status st;
    int r = wtx__rpc_unary_wait(p, &m, &st);
    if (m != nullptr) protobuf_c_message_free_unpacked(m, nullptr);
    if (r != 0 && rc == 0) {
      rc = r;
      st_ = st;
    }
  }
  return rc;
}

TEST_F(BatchTest, SeveralChunksInOneCallLandAsIfEachCameAlone) {
  ASSERT_EQ(0, Init()) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  std::vector<uint8_t> bytes;
  for (const Tensor &t : {T("a", 16, 1), T("b", 8, 2), T("c", 4, 3)})
    bytes.insert(bytes.end(), t.data.begin(), t.data.end());
  ASSERT_EQ(0, SendBatch(bytes, {{0, 40, {{"a", 16}}},
                                 {40, 96, {{"a", 16}, {"b", 8}}},
                                 {96, 112, {{"c", 4}}}}))
      << st_.message;
  ASSERT_EQ(0, Finish("v1")) << st_.message;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> now;
  EXPECT_EQ("v1", Published(&now));
  ASSERT_EQ(3u, now.size());
  EXPECT_EQ(T("a", 16, 1).data, now[0].second);
  EXPECT_EQ(T("b", 8, 2).data, now[1].second);
  EXPECT_EQ(T("c", 4, 3).data, now[2].second);
}

// A chunk of the call that fails ends the call and the update, named by
// its place (then[k]); what the chunks before it staged is discarded.
TEST_F(BatchTest, AChunkThatFailsInACallEndsTheUpdateNamingIt) {
  PublishV1();
  ASSERT_EQ(0, Start()) << st_.message;
  std::vector<uint8_t> bytes;
  for (const Tensor &t : {T("a", 16, 9), T("b", 8, 9)})
    bytes.insert(bytes.end(), t.data.begin(), t.data.end());
  EXPECT_NE(0, SendBatch(bytes, {{0, 40, {{"a", 16}}}, {40, 64, {{"a", 16}}},
                                 {64, 96, {{"b", 8}}}}, 2));
  EXPECT_EQ(GRPC_STATUS_DATA_LOSS, st_.code) << st_.message;
  EXPECT_NE(nullptr, strstr(st_.message, "then[1]: checksum mismatch for 'b'")) << st_.message;
  ExpectV1Intact();
  EXPECT_NE(0, Finish("v2"));  // the update ended with the call
  ExpectV1Intact();
}

// A trainer may send an update's next UpdateWeights before the answer to
// the one before (call_index): the worker takes them in that order
// whatever order they arrive in. Here the last arrives first and the one
// that continues a tensor arrives before that tensor's first chunk; the
// start says the worker takes such calls.
TEST_F(BatchTest, CallsSentAheadOfTheirTurnAreTakenInCallIndexOrder) {
  ASSERT_EQ(0, Init()) << st_.message;
  Wtx__V1__StartWeightUpdateRequest sreq = WTX__V1__START_WEIGHT_UPDATE_REQUEST__INIT;
  sreq.session_id = const_cast<char *>(session_.c_str());
  sreq.target = WTX__V1__UPDATE_TARGET__UPDATE_TARGET_MAIN;
  Wtx__V1__StartWeightUpdateResponse *sresp = nullptr;
  ASSERT_EQ(0, wtx__v1__weight_transfer__start_weight_update__call(ch_, &sreq, &sresp, nullptr,
                                                                    &st_)) << st_.message;
  EXPECT_TRUE(sresp->ordered_calls);
  update_ = sresp->update_id;
  protobuf_c_message_free_unpacked(&sresp->base, nullptr);
  std::vector<uint8_t> bytes;
  for (const Tensor &t : {T("a", 16, 1), T("b", 8, 2), T("c", 4, 3)})
    bytes.insert(bytes.end(), t.data.begin(), t.data.end());
  ASSERT_EQ(0, SendOrdered(bytes, {{0, 40, {{"a", 16}}},
                                   {40, 96, {{"a", 16}, {"b", 8}}},
                                   {96, 112, {{"c", 4}}}},
                           {2, 1, 0}))
      << st_.message;
  ASSERT_EQ(0, Finish("v1")) << st_.message;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> now;
  EXPECT_EQ("v1", Published(&now));
  ASSERT_EQ(3u, now.size());
  EXPECT_EQ("a", now[0].first);
  EXPECT_EQ(T("a", 16, 1).data, now[0].second);
  EXPECT_EQ("b", now[1].first);
  EXPECT_EQ(T("b", 8, 2).data, now[1].second);
  EXPECT_EQ("c", now[2].first);
  EXPECT_EQ(T("c", 4, 3).data, now[2].second);
}

// Each call index is taken once: a call naming one already taken is
// refused with the field named, and stages nothing.
TEST_F(BatchTest, ACallIndexAlreadyTakenIsRefused) {
  PublishV1();
  ASSERT_EQ(0, Start()) << st_.message;
  std::vector<uint8_t> bytes = T("a", 16, 7).data;
  ASSERT_EQ(0, SendOrdered(bytes, {{0, 64, {{"a", 16}}}}, {0})) << st_.message;
  EXPECT_NE(0, SendOrdered(bytes, {{0, 64, {{"b", 16}}}}, {0}));
  EXPECT_EQ(GRPC_STATUS_INVALID_ARGUMENT, st_.code) << st_.message;
  EXPECT_NE(nullptr, strstr(st_.message, "call_index: 1, but calls 1..1 of update"))
      << st_.message;
  Wtx__V1__PrepareWeightUpdateResponse *prep = nullptr;
  ASSERT_EQ(0, Prepare("v2", &prep)) << st_.message;
  EXPECT_EQ(1u, prep->num_params);  // a, from call 1: nothing of the refused call
  protobuf_c_message_free_unpacked(&prep->base, nullptr);
}

// A call waiting for its turn ends as soon as the update does (here an
// abort), not at the session's timeout, and the served version stays.
TEST_F(BatchTest, ACallWaitingForItsTurnEndsWhenTheUpdateIsAborted) {
  PublishV1();
  ASSERT_EQ(0, Start()) << st_.message;
  Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
  WaitLog log;
  wtx__rpc_pending *p = StartOrderedCall(ch_, session_, update_, &ui, 2);
  ASSERT_TRUE(log.Saw("call_index=2 for=1"));
  ASSERT_EQ(0, Abort()) << st_.message;
  EXPECT_EQ(1, wtx__rpc_unary_poll_within(p, 10000, nullptr));
  ProtobufCMessage *m = nullptr;
  wtx__rpc_status st;
  EXPECT_NE(0, wtx__rpc_unary_wait(p, &m, &st));
  EXPECT_EQ(GRPC_STATUS_FAILED_PRECONDITION, st.code) << st.message;
  EXPECT_NE(nullptr, strstr(st.message, "without an active update")) << st.message;
  ExpectV1Intact();
}

// A call whose turn never comes (the call before it was lost) ends within
// the session's timeout, naming the call it waited for.
TEST_F(BatchTest, ACallWhoseTurnNeverComesEndsAtTheSessionsTimeout) {
  ASSERT_EQ(0, Init("shm", 0, 300)) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
  wtx__rpc_pending *p = StartOrderedCall(ch_, session_, update_, &ui, 3);
  ProtobufCMessage *m = nullptr;
  wtx__rpc_status st;
  EXPECT_NE(0, wtx__rpc_unary_wait(p, &m, &st));
  EXPECT_EQ(GRPC_STATUS_DEADLINE_EXCEEDED, st.code) << st.message;
  EXPECT_NE(nullptr, strstr(st.message, "call_index: 3 waited 300 ms for call 1 of update"))
      << st.message;
}

// The table of the params an update sent, as the trainer computes it.
uint64_t TableOf(const std::vector<std::pair<std::string, uint64_t>> &floats) {
  std::vector<wtx_tensor_meta> m(floats.size());
  for (size_t i = 0; i < floats.size(); i++) {
    char err[128];
    uint64_t shape = floats[i].second;
    EXPECT_EQ(0, wtx_tensor_meta_set(&m[i], floats[i].first.c_str(), WTX_DTYPE_FLOAT32,
                                     &shape, 1, err, sizeof err));
  }
  return wtx__layout_xxh3(m.data(), m.size());
}

Wtx__V1__ParamRange Range(uint64_t table, uint32_t first, uint32_t count) {
  Wtx__V1__ParamRange r = WTX__V1__PARAM_RANGE__INIT;
  r.table_xxh3 = table;
  r.first = first;
  r.count = count;
  return r;
}

TEST_F(SessionTest, AnUpdateMayNameTheLastPublishedParamsByPosition) {
  ASSERT_EQ(0, Init()) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  EXPECT_EQ(0u, table_);  // nothing published yet
  ASSERT_EQ(0, Abort()) << st_.message;
  PublishV1();
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(TableOf({{"a", 16}, {"b", 8}}), table_);
  Wtx__V1__ParamRange r = Range(table_, 0, 2);
  std::vector<Tensor> v2 = {T("a", 16, 50), T("b", 8, 60)};
  ASSERT_EQ(0, Update(v2, false, &r)) << st_.message;
  ASSERT_EQ(0, Finish("v2")) << st_.message;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> now;
  EXPECT_EQ("v2", Published(&now));
  ASSERT_EQ(2u, now.size());
  EXPECT_EQ(v2[0].data, now[0].second);
  EXPECT_EQ(v2[1].data, now[1].second);
  // An update by position leaves the table as it was.
  ASSERT_EQ(0, Start()) << st_.message;
  EXPECT_EQ(TableOf({{"a", 16}, {"b", 8}}), table_);
}

TEST_F(SessionTest, ARangeOfAnotherTableOrOutOfStepIsRefusedAndKeepsOldWeights) {
  PublishV1();
  ASSERT_EQ(0, Start()) << st_.message;
  Wtx__V1__ParamRange wrong = Range(table_ ^ 1, 0, 2);
  EXPECT_NE(0, Update({T("a", 16, 9), T("b", 8, 9)}, false, &wrong));
  EXPECT_EQ(GRPC_STATUS_FAILED_PRECONDITION, st_.code);
  EXPECT_NE(std::string::npos, std::string(st_.message).find("is not this worker's table"))
      << st_.message;
  ExpectV1Intact();
  ASSERT_EQ(0, Start()) << st_.message;
  Wtx__V1__ParamRange skip = Range(table_, 1, 1);
  EXPECT_NE(0, Update({T("b", 8, 9)}, false, &skip));
  EXPECT_EQ(GRPC_STATUS_INVALID_ARGUMENT, st_.code);
  EXPECT_NE(std::string::npos, std::string(st_.message).find("must start at 0")) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  Wtx__V1__ParamRange past = Range(table_, 0, 3);
  EXPECT_NE(0, Update({T("a", 16, 9), T("b", 8, 9), T("c", 1, 9)}, false, &past));
  EXPECT_EQ(GRPC_STATUS_INVALID_ARGUMENT, st_.code);
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("a", 16, 9)})) << st_.message;
  Wtx__V1__ParamRange then = Range(table_, 1, 1);
  EXPECT_NE(0, Update({T("b", 8, 9)}, false, &then));
  EXPECT_EQ(GRPC_STATUS_INVALID_ARGUMENT, st_.code);
  EXPECT_NE(std::string::npos, std::string(st_.message).find("one way throughout"))
      << st_.message;
  ExpectV1Intact();
}

// A delta opens only on the version it names; what it does not send
// carries over from that version, and the table stays the full update's.
TEST_F(SessionTest, ADeltaOpensOnlyOnItsBaseVersionAndCarriesTheRestOver) {
  PublishV1();
  ASSERT_EQ(0, Start()) << st_.message;
  EXPECT_EQ("v1", serves_);
  const uint64_t v1_table = table_;
  EXPECT_NE(0u, v1_table);
  ASSERT_EQ(0, Abort()) << st_.message;

  EXPECT_NE(0, Start(WTX__V1__UPDATE_TARGET__UPDATE_TARGET_MAIN, 0, "v0"));
  EXPECT_EQ(GRPC_STATUS_FAILED_PRECONDITION, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "base_version")) << st_.message;
  EXPECT_NE(nullptr, strstr(st_.message, "'v0'")) << st_.message;
  EXPECT_NE(nullptr, strstr(st_.message, "'v1'")) << st_.message;
  ExpectV1Intact();

  ASSERT_EQ(0, Start(WTX__V1__UPDATE_TARGET__UPDATE_TARGET_MAIN, 0, "v1")) << st_.message;
  Tensor b2 = T("b", 8, 90);
  ASSERT_EQ(0, Update({b2})) << st_.message;
  ASSERT_EQ(0, Finish("v2")) << st_.message;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> now;
  EXPECT_EQ("v2", Published(&now));
  ASSERT_EQ(2u, now.size());
  EXPECT_EQ(v1_[0], now[0]);  // "a" carried over from v1
  EXPECT_EQ(std::make_pair(std::string("b"), b2.data), now[1]);

  // The next update may still name v1's whole table by position.
  ASSERT_EQ(0, Start()) << st_.message;
  EXPECT_EQ(v1_table, table_);
  EXPECT_EQ("v2", serves_);
  ASSERT_EQ(0, Abort()) << st_.message;
}

// One chunk with a patch of the FLOAT32 tensor `name` of `floats`
// elements: indices then values, as the wire has them; chunk_bytes and
// the index dtype may be bent to test refusals.
struct PatchChunk {
  std::string name;
  uint64_t floats;
  std::vector<uint32_t> idx;
  std::vector<float> vals;
  uint64_t result_xxh3 = 0;
  int index_dtype = WTX__V1__DTYPE__DTYPE_INT32;
  int dtype = WTX__V1__DTYPE__DTYPE_FLOAT32;
  int64_t bytes_delta = 0;  // added to chunk_bytes
  std::vector<uint8_t> Wire() const {
    std::vector<uint8_t> b(idx.size() * 4 + vals.size() * 4);
    memcpy(b.data(), idx.data(), idx.size() * 4);
    memcpy(b.data() + idx.size() * 4, vals.data(), vals.size() * 4);
    return b;
  }
};

// The v1 tensor "a" (16 floats) with the elements at idx set to vals.
std::vector<uint8_t> Patched(std::vector<uint8_t> a, const PatchChunk &p) {
  for (size_t k = 0; k < p.idx.size(); k++) memcpy(&a[p.idx[k] * 4], &p.vals[k], 4);
  return a;
}

class PatchTest : public SessionTest {
 protected:
  // UpdateWeights of one chunk holding patch p.
  int SendPatch(const PatchChunk &p) {
    std::vector<uint8_t> wire = p.Wire();
    Wtx__V1__Patch patch = WTX__V1__PATCH__INIT;
    patch.index_dtype = (Wtx__V1__DType)p.index_dtype;
    patch.count = p.idx.size();
    patch.result_xxh3 = p.result_xxh3;
    uint64_t sum = XXH3_64bits(wire.data(), wire.size());
    return SendPatchChunk(p.name, p.dtype, p.floats * 4 / wtx_dtype_size(p.dtype), &patch, wire,
                          0, wire.size() + p.bytes_delta, &sum);
  }
  // UpdateWeights of one chunk of the one tensor `name` (elements of
  // dtype), sent as patch: bytes [from, from + chunk.size()) of its wire
  // and the chunk_bytes given; sum (where not null): the wire's XXH3.
  int SendPatchChunk(const std::string &name, int dtype, uint64_t elements,
                     Wtx__V1__Patch *patch, const std::vector<uint8_t> &chunk, uint64_t from,
                     uint64_t chunk_bytes, uint64_t *sum) {
    Wtx__V1__ParamMeta pm = WTX__V1__PARAM_META__INIT;
    pm.name = const_cast<char *>(name.c_str());
    pm.dtype = (Wtx__V1__DType)dtype;
    pm.shape = &elements;
    pm.n_shape = 1;
    pm.patch = patch;
    Wtx__V1__ParamMeta *pmp = &pm;
    Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
    ui.params = &pmp;
    ui.n_params = 1;
    ui.first_param_offset = from;
    ui.chunk_bytes = chunk_bytes;
    ui.xxh3_64 = sum;
    ui.n_xxh3_64 = sum != nullptr;
    return SendShm(chunk, &ui);
  }
  int StartDelta() { return Start(WTX__V1__UPDATE_TARGET__UPDATE_TARGET_MAIN, 0, "v1"); }
  // v2 is published: "a" as a, "b" as v1 had it, and the worker reports
  // the whole patched tensor's checksum.
  void ExpectPublished(const std::vector<uint8_t> &a) {
    std::vector<std::pair<std::string, std::vector<uint8_t>>> now;
    EXPECT_EQ("v2", Published(&now));
    ASSERT_EQ(2u, now.size());
    EXPECT_EQ(a, now[0].second);
    EXPECT_EQ(v1_[1], now[1]);
    wtx_store_view v;
    ASSERT_EQ(0, wtx_store_acquire(wtx_worker_store(w_), WTX_TARGET_MAIN, &v));
    EXPECT_EQ(1, v.params[0].has_xxh3);
    EXPECT_EQ(XXH3_64bits(a.data(), a.size()), v.params[0].xxh3);
    wtx_store_release(wtx_worker_store(w_), &v);
  }
};

// A patch changes only its elements (a NaN among its values), the rest of
// the tensor and the other tensors carry over bit-exact, and the worker
// reports the whole patched tensor's checksum.
TEST_F(PatchTest, APatchInADeltaChangesOnlyItsElements) {
  PublishV1();
  ASSERT_EQ(0, StartDelta()) << st_.message;
  PatchChunk p{"a", 16, {0, 3, 15}, {std::numeric_limits<float>::quiet_NaN(), 1.5f, -0.0f}};
  std::vector<uint8_t> want = Patched(v1_[0].second, p);
  p.result_xxh3 = XXH3_64bits(want.data(), want.size());
  ASSERT_EQ(0, SendPatch(p)) << st_.message;
  ASSERT_EQ(0, Finish("v2")) << st_.message;
  ExpectPublished(want);
}

// The store's ops with a read (a delta's base) that blocks until the test
// releases it, or 20 s pass (g_read_done then).
std::mutex g_read_mu;
std::condition_variable g_read_cv;
bool g_in_read = false, g_read_release = false, g_read_done = false;
int BlockingRead(void *m, wtx_target t, const wtx_tensor_meta *meta, uint8_t *dst, char *e,
                 size_t n) {
  {
    std::unique_lock<std::mutex> lk(g_read_mu);
    g_in_read = true;
    g_read_cv.notify_all();
    g_read_cv.wait_for(lk, std::chrono::seconds(20), [] { return g_read_release; });
    g_read_done = true;
  }
  return wtx_store_model_ops.read(m, t, meta, dst, e, n);
}

// A patch's base is read, and the patch applied, outside the session's
// lock: inspection answers while the model's read takes its time, and the
// patch then lands.
TEST_F(PatchTest, InspectionAnswersWhileAPatchsBaseIsRead) {
  wtx_store *store = nullptr;
  ASSERT_EQ(0, wtx_store_create(&store));
  wtx_model_ops ops = wtx_store_model_ops;
  ops.read = BlockingRead;
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.model_ops = &ops;
  o.model = store;
  Restart(o);
  g_in_read = g_read_release = g_read_done = false;
  ASSERT_EQ(0, Init()) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("a", 16, 1), T("b", 8, 2)})) << st_.message;
  ASSERT_EQ(0, Finish("v1")) << st_.message;
  ASSERT_EQ(0, StartDelta()) << st_.message;
  PatchChunk p{"a", 16, {3}, {1.5f}};
  std::vector<uint8_t> want = Patched(T("a", 16, 1).data, p);
  p.result_xxh3 = XXH3_64bits(want.data(), want.size());
  int sent = -1;
  std::thread sender([&] { sent = SendPatch(p); });
  {
    std::unique_lock<std::mutex> lk(g_read_mu);
    ASSERT_TRUE(g_read_cv.wait_for(lk, std::chrono::seconds(20), [] { return g_in_read; }));
  }
  Wtx__V1__GetWeightInfoRequest req = WTX__V1__GET_WEIGHT_INFO_REQUEST__INIT;
  Wtx__V1__GetWeightInfoResponse *info = nullptr;
  wtx__rpc_status st;
  int rc = wtx__v1__weight_transfer__get_weight_info__call(ch_, &req, &info, nullptr, &st);
  bool reading;
  {
    std::lock_guard<std::mutex> lk(g_read_mu);
    reading = !g_read_done;
    g_read_release = true;
    g_read_cv.notify_all();
  }
  sender.join();
  EXPECT_EQ(0, rc) << st.message;
  EXPECT_TRUE(reading) << "inspection waited for the model's read";
  if (info != nullptr) {
    EXPECT_EQ(WTX__V1__SESSION_STATE__SESSION_STATE_UPDATING, info->state);
    EXPECT_STREQ("v1", info->weight_version);
    protobuf_c_message_free_unpacked(&info->base, nullptr);
  }
  EXPECT_EQ(0, sent) << st_.message;
  EXPECT_EQ(0, Finish("v2")) << st_.message;
  wtx_store_view v;
  ASSERT_EQ(0, wtx_store_acquire(store, WTX_TARGET_MAIN, &v));
  EXPECT_STREQ("v2", v.version);
  ASSERT_EQ(2u, v.n_params);
  EXPECT_EQ(want, std::vector<uint8_t>(v.params[0].data, v.params[0].data + want.size()));
  wtx_store_release(store, &v);
  Stop();
  wtx_store_destroy(store);
}

TEST_F(PatchTest, TheStartSaysWhetherAWorkerTakesPatches) {
  PublishV1();
  Wtx__V1__StartWeightUpdateRequest req = WTX__V1__START_WEIGHT_UPDATE_REQUEST__INIT;
  req.session_id = const_cast<char *>(session_.c_str());
  Wtx__V1__StartWeightUpdateResponse *resp = nullptr;
  ASSERT_EQ(0, wtx__v1__weight_transfer__start_weight_update__call(ch_, &req, &resp, nullptr,
                                                                    &st_));
  EXPECT_TRUE(resp->patches);  // the store reads its tensors back
  EXPECT_TRUE(resp->patch_spans);
  EXPECT_TRUE(resp->patch_boxes);
  EXPECT_TRUE(resp->chunk_batches);
  protobuf_c_message_free_unpacked(&resp->base, nullptr);
}

// Every malformed patch is refused, naming the tensor and what is wrong,
// and nothing of it is applied: the worker still serves v1, bit-exact.
TEST_F(PatchTest, MalformedPatchesAreRefusedWithNothingApplied) {
  PublishV1();
  struct Case {
    const char *what;
    PatchChunk p;
    int code;
    const char *says;
  } cases[] = {
      {"an index past the end", {"a", 16, {2, 16}, {1, 2}}, GRPC_STATUS_INVALID_ARGUMENT,
       "index 1 of 2 is past the tensor's elements"},
      {"an index twice", {"a", 16, {4, 4}, {1, 2}}, GRPC_STATUS_INVALID_ARGUMENT,
       "none repeats"},
      {"more values than elements", {"a", 16, std::vector<uint32_t>(17), std::vector<float>(17)},
       GRPC_STATUS_INVALID_ARGUMENT, "patch.count: 17 for 'a', must be 1..16"},
      {"bytes short of the patch", {"a", 16, {1, 2}, {1, 2}, 0, WTX__V1__DTYPE__DTYPE_INT32,
       WTX__V1__DTYPE__DTYPE_FLOAT32, -1}, GRPC_STATUS_INVALID_ARGUMENT,
       "the patch of 'a' continues past the chunk"},
      {"another dtype than the base's", {"a", 16, {1}, {1}, 0, WTX__V1__DTYPE__DTYPE_INT32,
       WTX__V1__DTYPE__DTYPE_INT32}, GRPC_STATUS_INVALID_ARGUMENT, "parameter 'a'"},
      {"16-bit indices", {"a", 16, {1}, {1}, 0, WTX__V1__DTYPE__DTYPE_INT16},
       GRPC_STATUS_INVALID_ARGUMENT, "patch.index_dtype: must be INT32 or INT64"},
      {"a result unlike the trainer's", {"a", 16, {1}, {7}, 0x1234}, GRPC_STATUS_DATA_LOSS,
       "'a' patched is not the trainer's tensor"},
      {"a tensor the base lacks", {"zz", 16, {1}, {7}}, GRPC_STATUS_NOT_FOUND, "'zz'"},
  };
  for (const Case &k : cases) {
    ASSERT_EQ(0, StartDelta()) << k.what << ": " << st_.message;
    EXPECT_NE(0, SendPatch(k.p)) << k.what;
    EXPECT_EQ(k.code, st_.code) << k.what << ": " << st_.message;
    EXPECT_NE(nullptr, strstr(st_.message, k.says)) << k.what << ": " << st_.message;
    ExpectV1Intact();
  }
  // A patch outside a delta has no base to apply to.
  ASSERT_EQ(0, Start()) << st_.message;
  EXPECT_NE(0, SendPatch({"a", 16, {1}, {7}}));
  EXPECT_EQ(GRPC_STATUS_INVALID_ARGUMENT, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "a patch applies only in a delta update")) << st_.message;
  ExpectV1Intact();
}

// A patch of spans (Patch.spans), as many trainer ranks send a tensor each
// owns a part of: spans of v1's "a" (16 floats), each a patch of its own
// elements, indices counted from its first.
struct Span {
  uint64_t first, elements;
  std::vector<uint32_t> idx;
  std::vector<float> vals;
  uint64_t result_xxh3 = 0;
};

class SpanTest : public PatchTest {
 protected:
  // The spans' patches, one after another, as the wire has them.
  static std::vector<uint8_t> Wire(const std::vector<Span> &spans) {
    std::vector<uint8_t> b;
    for (const Span &sp : spans) {
      const uint8_t *i = reinterpret_cast<const uint8_t *>(sp.idx.data());
      const uint8_t *v = reinterpret_cast<const uint8_t *>(sp.vals.data());
      b.insert(b.end(), i, i + sp.idx.size() * 4);
      b.insert(b.end(), v, v + sp.vals.size() * 4);
    }
    return b;
  }
  // v1's "a" with every span's elements set; each span's result_xxh3
  // (where 0) becomes the hash of its bytes there.
  std::vector<uint8_t> Apply(std::vector<Span> *spans) {
    std::vector<uint8_t> a = v1_[0].second;
    for (Span &sp : *spans) {
      for (size_t k = 0; k < sp.idx.size(); k++)
        memcpy(&a[(sp.first + sp.idx[k]) * 4], &sp.vals[k], 4);
      if (sp.result_xxh3 == 0) sp.result_xxh3 = XXH3_64bits(&a[sp.first * 4], sp.elements * 4);
    }
    return a;
  }
  // "a" patched by spans, its bytes in two chunks cut at byte cut (0: one
  // chunk); the second chunk names the spans of `then` where given.
  int SendSpans(const std::vector<Span> &spans, size_t cut,
                const std::vector<Span> *then = nullptr) {
    std::vector<uint8_t> wire = Wire(spans);
    size_t end = cut == 0 ? wire.size() : cut;
    int rc = SendSpanChunk(spans, wire, 0, end, wire.size());
    if (rc != 0 || end == wire.size()) return rc;
    return SendSpanChunk(then != nullptr ? *then : spans, wire, end, wire.size(), wire.size());
  }
  // One chunk of "a" as spans: bytes [from, to) of wire; the chunk that
  // completes it carries the whole wire's checksum.
  int SendSpanChunk(const std::vector<Span> &spans, const std::vector<uint8_t> &wire,
                    size_t from, size_t to, size_t total) {
    std::vector<Wtx__V1__PatchSpan> sp(spans.size());
    std::vector<Wtx__V1__PatchSpan *> spp;
    for (size_t j = 0; j < spans.size(); j++) {
      wtx__v1__patch_span__init(&sp[j]);
      sp[j].first = spans[j].first;
      sp[j].elements = spans[j].elements;
      sp[j].index_dtype = WTX__V1__DTYPE__DTYPE_INT32;
      sp[j].count = spans[j].idx.size();
      sp[j].result_xxh3 = spans[j].result_xxh3;
      spp.push_back(&sp[j]);
    }
    Wtx__V1__Patch patch = WTX__V1__PATCH__INIT;
    patch.spans = spp.data();
    patch.n_spans = spp.size();
    uint64_t sum = XXH3_64bits(wire.data(), wire.size());
    return SendPatchChunk("a", WTX__V1__DTYPE__DTYPE_FLOAT32, 16, &patch,
                          std::vector<uint8_t>(wire.begin() + from, wire.begin() + to), from,
                          to - from, to == total ? &sum : nullptr);
  }
};

// Two spans, each a patch of its own elements (a NaN among the values),
// in one chunk, in two chunks cut between them, and cut inside one: each
// applies once all bytes are in, and the elements outside every span
// stay the base's.
TEST_F(SpanTest, APatchOfSpansAppliesEachSpanOnceAllItsBytesAreIn) {
  PublishV1();
  for (size_t cut : {0, 16, 10}) {
    std::vector<Span> spans = {{0, 8, {1, 7}, {std::numeric_limits<float>::quiet_NaN(), 2.5f}},
                               {8, 8, {0, 7}, {-1.0f, 3.0f}}};
    std::vector<uint8_t> want = Apply(&spans);
    ASSERT_EQ(0, StartDelta()) << st_.message;
    ASSERT_EQ(0, SendSpans(spans, cut)) << "cut " << cut << ": " << st_.message;
    ASSERT_EQ(0, Finish("v2")) << st_.message;
    ExpectPublished(want);
    ASSERT_EQ(0, Start()) << st_.message;  // v1 again, for the next cut
    ASSERT_EQ(0, Update({T("a", 16, 1), T("b", 8, 2)})) << st_.message;
    ASSERT_EQ(0, Finish("v1")) << st_.message;
  }
  // One span of the second half: the first half is the base's.
  std::vector<Span> one = {{12, 4, {3}, {9.0f}}};
  std::vector<uint8_t> want = Apply(&one);
  ASSERT_EQ(0, StartDelta()) << st_.message;
  ASSERT_EQ(0, SendSpans(one, 0)) << st_.message;
  ASSERT_EQ(0, Finish("v2")) << st_.message;
  ExpectPublished(want);
}

// A patch of spans whose first chunk is in when the update is aborted (a
// trainer rank gone mid-delta): v1 stays, bit-exact, and the next delta
// applies in full.
TEST_F(SpanTest, AnAbortMidPatchOfSpansKeepsTheServedVersion) {
  PublishV1();
  std::vector<Span> spans = {{0, 8, {2}, {4.0f}}, {8, 8, {5}, {8.0f}}};
  std::vector<uint8_t> want = Apply(&spans), wire = Wire(spans);
  ASSERT_EQ(0, StartDelta()) << st_.message;
  ASSERT_EQ(0, SendSpanChunk(spans, wire, 0, 8, wire.size())) << st_.message;
  ASSERT_EQ(0, Abort()) << st_.message;
  ExpectV1Intact();
  ASSERT_EQ(0, StartDelta()) << st_.message;
  ASSERT_EQ(0, SendSpans(spans, 8)) << st_.message;
  ASSERT_EQ(0, Finish("v2")) << st_.message;
  ExpectPublished(want);
}

// Every malformed patch of spans is refused, naming the span and what is
// wrong, and nothing of it is applied: the worker still serves v1.
TEST_F(SpanTest, MalformedSpansAreRefusedWithNothingApplied) {
  PublishV1();
  std::vector<Span> other = {{0, 8, {1}, {5.0f}}, {8, 8, {0}, {6.0f}}};
  struct Case {
    const char *what;
    std::vector<Span> spans;
    size_t cut;
    int code;
    const char *says;
  } cases[] = {
      {"spans that overlap", {{0, 8, {1}, {1}}, {4, 8, {1}, {2}}}, 0,
       GRPC_STATUS_INVALID_ARGUMENT,
       "patch.spans[1]: [4, +8) must lie within the 16 elements of 'a', after the span before"},
      {"a span past the tensor", {{12, 8, {1}, {1}, 1}}, 0, GRPC_STATUS_INVALID_ARGUMENT,
       "patch.spans[0]: [12, +8) must lie within the 16 elements of 'a'"},
      {"an empty span", {{0, 0, {}, {}}}, 0, GRPC_STATUS_INVALID_ARGUMENT,
       "patch.spans[0]: [0, +0)"},
      {"an index past its span", {{0, 8, {1}, {1}}, {8, 4, {4}, {2}}}, 0,
       GRPC_STATUS_INVALID_ARGUMENT, "patch.spans[1]: patch of 'a': index 0 of 1 is past"},
      {"an index twice", {{0, 8, {3, 3}, {1, 2}}}, 0, GRPC_STATUS_INVALID_ARGUMENT,
       "patch.spans[0]: patch of 'a': index 1 of 2 is not above the one before"},
      {"a span's result unlike the trainer's", {{0, 8, {1}, {1}}, {8, 8, {1}, {2}, 0x1234}}, 0,
       GRPC_STATUS_DATA_LOSS, "span 1 of 'a' patched is not the trainer's span"},
      {"a chunk that goes on with other spans", {{0, 8, {1, 2}, {1, 2}}, {8, 8, {1}, {2}}}, 16,
       GRPC_STATUS_INVALID_ARGUMENT,
       "'a' continues the chunk before, which began a patch of other bytes"},
  };
  for (Case &k : cases) {
    ASSERT_EQ(0, StartDelta()) << k.what << ": " << st_.message;
    std::vector<uint8_t> ignored = Apply(&k.spans);
    EXPECT_NE(0, SendSpans(k.spans, k.cut, &other)) << k.what;
    EXPECT_EQ(k.code, st_.code) << k.what << ": " << st_.message;
    EXPECT_NE(nullptr, strstr(st_.message, k.says)) << k.what << ": " << st_.message;
    ExpectV1Intact();
  }
}

// Tensors sent in boxes (UpdateInfo.box), as many senders send a piece
// that is not one run of what a worker keeps: a float32 4x6 tensor "m".
class BoxTest : public SessionTest {
 protected:
  struct Box {
    uint64_t lo[2], len[2];
  };
  static std::vector<uint8_t> Full(uint8_t fill) { return T("m", 24, fill).data; }
  // One chunk: box b of "m" (its bytes gathered from full), named by
  // params, or by position when range is given; n_params 2 names "m" and
  // "b"; chunk_bytes 0 says the box's own.
  int SendBox(const std::vector<uint8_t> &full, Box b, const Wtx__V1__ParamRange *range = nullptr,
              size_t n_params = 1, uint64_t chunk_bytes = 0) {
    std::vector<uint8_t> bytes;
    for (uint64_t i = b.lo[0]; i < b.lo[0] + b.len[0]; i++)
      for (uint64_t j = b.lo[1]; j < b.lo[1] + b.len[1]; j++)
        if (i < 4 && j < 6) bytes.insert(bytes.end(), &full[(i * 6 + j) * 4], &full[(i * 6 + j) * 4 + 4]);
    uint64_t sum = XXH3_64bits(bytes.data(), bytes.size());
    uint64_t shape[2] = {4, 6}, bshape = 8;
    Wtx__V1__ParamMeta pm[2];
    Wtx__V1__ParamMeta *pmp[2] = {&pm[0], &pm[1]};
    for (Wtx__V1__ParamMeta &p : pm) {
      wtx__v1__param_meta__init(&p);
      p.dtype = WTX__V1__DTYPE__DTYPE_FLOAT32;
    }
    pm[0].name = const_cast<char *>("m");
    pm[0].shape = shape;
    pm[0].n_shape = 2;
    pm[1].name = const_cast<char *>("b");
    pm[1].shape = &bshape;
    pm[1].n_shape = 1;
    Wtx__V1__Box box = WTX__V1__BOX__INIT;
    box.offset = b.lo;
    box.n_offset = 2;
    box.shape = b.len;
    box.n_shape = 2;
    Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
    ui.box = &box;
    ui.chunk_bytes = chunk_bytes;
    ui.xxh3_64 = &sum;
    ui.n_xxh3_64 = 1;
    if (range != nullptr) {
      ui.layout = const_cast<Wtx__V1__ParamRange *>(range);
    } else {
      ui.params = pmp;
      ui.n_params = n_params;
    }
    return SendShm(bytes, &ui);
  }
  // "m" in three boxes (a column band, then the rest in two row bands),
  // then "b" whole.
  void SendInBoxes(const std::vector<uint8_t> &full, uint64_t table = 0) {
    const Box boxes[] = {{{0, 0}, {4, 2}}, {{0, 2}, {2, 4}}, {{2, 2}, {2, 4}}};
    Wtx__V1__ParamRange r = Range(table, 0, 1);
    for (const Box &b : boxes) ASSERT_EQ(0, SendBox(full, b, table ? &r : nullptr)) << st_.message;
    Wtx__V1__ParamRange rb = Range(table, 1, 1);
    ASSERT_EQ(0, Update({T("b", 8, 9)}, false, table ? &rb : nullptr)) << st_.message;
  }
  void ExpectServes(const std::vector<uint8_t> &full, const char *version) {
    std::vector<std::pair<std::string, std::vector<uint8_t>>> now;
    ASSERT_EQ(version, Published(&now));
    ASSERT_EQ(2u, now.size());
    EXPECT_EQ("m", now[0].first);
    EXPECT_EQ(full, now[0].second);
    EXPECT_EQ(T("b", 8, 9).data, now[1].second);
    wtx_store_view v;
    wtx_store_acquire(wtx_worker_store(w_), WTX_TARGET_MAIN, &v);
    EXPECT_EQ(XXH3_64bits(full.data(), full.size()), v.params[0].xxh3) << "its whole checksum";
    wtx_store_release(wtx_worker_store(w_), &v);
  }
};

TEST_F(BoxTest, ATensorSentInBoxesIsScatteredIntoPlaceByParamsAndByPosition) {
  ASSERT_EQ(0, Init()) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  SendInBoxes(Full(1));
  ASSERT_EQ(0, Finish("v1")) << st_.message;
  ExpectServes(Full(1), "v1");
  // The next update names the tensors by position, each box of "m" again.
  ASSERT_EQ(0, Start()) << st_.message;
  SendInBoxes(Full(50), table_);
  ASSERT_EQ(0, Finish("v2")) << st_.message;
  ExpectServes(Full(50), "v2");
}

TEST_F(BoxTest, BoxesThatOverlapStrayOrLeaveAHoleAreRefusedAndKeepTheOldWeights) {
  ASSERT_EQ(0, Init()) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  SendInBoxes(Full(1));
  ASSERT_EQ(0, Finish("v1")) << st_.message;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> v1;
  Published(&v1);
  std::vector<uint8_t> full = Full(50);
  auto expect_refused = [&](const char *what, int code, const char *says) {
    EXPECT_EQ(code, st_.code) << what << ": " << st_.message;
    EXPECT_NE(nullptr, strstr(st_.message, says)) << what << ": " << st_.message;
    std::vector<std::pair<std::string, std::vector<uint8_t>>> now;
    EXPECT_EQ("v1", Published(&now)) << what;
    EXPECT_EQ(v1, now) << what;
  };
  struct Case {
    const char *what;
    Box b;
    size_t n_params;
    uint64_t chunk_bytes;
    const char *says;
  } cases[] = {
      {"past the tensor", {{2, 4}, {2, 3}}, 1, 0, "update_info.box: dim 1 [4, +3) is not within 'm''s 6"},
      {"empty", {{0, 0}, {0, 6}}, 1, 0, "update_info.box: dim 0 [0, +0)"},
      {"two tensors", {{0, 0}, {4, 2}}, 2, 0, "a box chunk carries one tensor"},
      {"bytes other than the box's", {{0, 0}, {4, 2}}, 1, 16, "update_info.chunk_bytes: 16"},
  };
  for (const Case &k : cases) {
    ASSERT_EQ(0, Start()) << st_.message;
    EXPECT_NE(0, SendBox(full, k.b, nullptr, k.n_params, k.chunk_bytes)) << k.what;
    expect_refused(k.what, GRPC_STATUS_INVALID_ARGUMENT, k.says);
  }
  // A box over one sent before.
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, SendBox(full, {{0, 0}, {4, 2}})) << st_.message;
  EXPECT_NE(0, SendBox(full, {{1, 1}, {2, 3}}));
  expect_refused("an overlap", GRPC_STATUS_INVALID_ARGUMENT, "overlaps a box of 'm' sent before");
  // Another tensor before "m"'s boxes cover it.
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, SendBox(full, {{0, 0}, {4, 2}})) << st_.message;
  EXPECT_NE(0, Update({T("b", 8, 9)}));
  expect_refused("a stray tensor", GRPC_STATUS_INVALID_ARGUMENT,
                 "'m' came in boxes, 32 of its 96 bytes so far");
  // A hole at prepare.
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, SendBox(full, {{0, 0}, {4, 2}})) << st_.message;
  ASSERT_EQ(0, SendBox(full, {{0, 2}, {2, 4}})) << st_.message;
  EXPECT_NE(0, Finish("v2"));
  expect_refused("a hole", GRPC_STATUS_FAILED_PRECONDITION,
                 "tensor 'm' is incomplete: 64 of 96 bytes");
}

// A patch of spans that are boxes (PatchSpan.box), as a row-parallel
// trainer's ranks send a tensor each owns columns of: "m" (4x6) served as
// v1, then a delta patching a 4x2 column band and a 2x3 box, each read as
// a tensor of its own (row-major within the box).
struct BoxSpan {
  uint64_t lo[2], len[2];
  std::vector<uint32_t> idx;
  std::vector<float> vals;
  uint64_t result_xxh3 = 0;
  bool flat = false;  // a flat span of the box's elements instead (first lo[0])
};

class BoxSpanTest : public BoxTest {
 protected:
  // full with each box's elements set; a box's result_xxh3 (where 0)
  // becomes the hash of its packed elements so patched. A flat span, or a
  // box past "m", is left as it is (a refusal's).
  static std::vector<uint8_t> Apply(std::vector<uint8_t> full, std::vector<BoxSpan> *spans) {
    for (BoxSpan &sp : *spans) {
      if (sp.flat || sp.lo[0] + sp.len[0] > 4 || sp.lo[1] + sp.len[1] > 6) continue;
      std::vector<uint8_t> packed;
      for (size_t k = 0; k < sp.idx.size(); k++) {
        uint64_t r = sp.lo[0] + sp.idx[k] / sp.len[1], c = sp.lo[1] + sp.idx[k] % sp.len[1];
        memcpy(&full[(r * 6 + c) * 4], &sp.vals[k], 4);
      }
      for (uint64_t r = sp.lo[0]; r < sp.lo[0] + sp.len[0]; r++)
        packed.insert(packed.end(), &full[(r * 6 + sp.lo[1]) * 4],
                      &full[(r * 6 + sp.lo[1] + sp.len[1]) * 4]);
      if (sp.result_xxh3 == 0) sp.result_xxh3 = XXH3_64bits(packed.data(), packed.size());
    }
    return full;
  }
  // One chunk: "m" as the patch of spans.
  int SendBoxSpans(const std::vector<BoxSpan> &spans) {
    std::vector<uint8_t> wire;
    std::vector<Wtx__V1__PatchSpan> sp(spans.size());
    std::vector<Wtx__V1__Box> bx(spans.size());
    std::vector<Wtx__V1__PatchSpan *> spp;
    for (size_t j = 0; j < spans.size(); j++) {
      const BoxSpan &b = spans[j];
      const uint8_t *i = reinterpret_cast<const uint8_t *>(b.idx.data());
      const uint8_t *v = reinterpret_cast<const uint8_t *>(b.vals.data());
      wire.insert(wire.end(), i, i + b.idx.size() * 4);
      wire.insert(wire.end(), v, v + b.vals.size() * 4);
      wtx__v1__patch_span__init(&sp[j]);
      wtx__v1__box__init(&bx[j]);
      bx[j].offset = const_cast<uint64_t *>(b.lo);
      bx[j].shape = const_cast<uint64_t *>(b.len);
      bx[j].n_offset = bx[j].n_shape = 2;
      sp[j].box = b.flat ? nullptr : &bx[j];
      sp[j].first = b.flat ? b.lo[0] : 0;
      sp[j].elements = b.len[0] * b.len[1];
      sp[j].index_dtype = WTX__V1__DTYPE__DTYPE_INT32;
      sp[j].count = b.idx.size();
      sp[j].result_xxh3 = b.result_xxh3;
      spp.push_back(&sp[j]);
    }
    Wtx__V1__Patch patch = WTX__V1__PATCH__INIT;
    patch.spans = spp.data();
    patch.n_spans = spp.size();
    uint64_t shape[2] = {4, 6};
    Wtx__V1__ParamMeta pm = WTX__V1__PARAM_META__INIT;
    pm.name = const_cast<char *>("m");
    pm.dtype = WTX__V1__DTYPE__DTYPE_FLOAT32;
    pm.shape = shape;
    pm.n_shape = 2;
    pm.patch = &patch;
    Wtx__V1__ParamMeta *pmp = &pm;
    uint64_t sum = XXH3_64bits(wire.data(), wire.size());
    Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
    ui.params = &pmp;
    ui.n_params = 1;
    ui.chunk_bytes = wire.size();
    ui.xxh3_64 = &sum;
    ui.n_xxh3_64 = 1;
    return SendShm(wire, &ui);
  }
  void PublishV1() {
    ASSERT_EQ(0, Init()) << st_.message;
    ASSERT_EQ(0, Start()) << st_.message;
    SendInBoxes(Full(1));
    ASSERT_EQ(0, Finish("v1")) << st_.message;
  }
};

TEST_F(BoxSpanTest, EachBoxIsPatchedWhereItLiesAndTheRestIsTheBase) {
  PublishV1();
  // The column band's element (2, 1) (a NaN) and (3, 0); the 2x3 box at
  // (1, 3)'s first and last elements: (1, 3) and (2, 5).
  std::vector<BoxSpan> spans = {
      {{0, 0}, {4, 2}, {5, 6}, {std::numeric_limits<float>::quiet_NaN(), 7.5f}},
      {{1, 3}, {2, 3}, {0, 5}, {-2.0f, 4.0f}}};
  std::vector<uint8_t> want = Apply(Full(1), &spans);
  ASSERT_EQ(0, Start(WTX__V1__UPDATE_TARGET__UPDATE_TARGET_MAIN, 0, "v1")) << st_.message;
  ASSERT_EQ(0, SendBoxSpans(spans)) << st_.message;
  ASSERT_EQ(0, Finish("v2")) << st_.message;
  ExpectServes(want, "v2");
}

TEST_F(BoxSpanTest, MalformedBoxSpansAreRefusedWithNothingApplied) {
  PublishV1();
  struct Case {
    const char *what;
    std::vector<BoxSpan> spans;
    int code;
    const char *says;
  } cases[] = {
      {"boxes that overlap", {{{0, 0}, {4, 2}, {0}, {1}}, {{1, 1}, {2, 3}, {0}, {2}}},
       GRPC_STATUS_INVALID_ARGUMENT, "patch.spans[1].box: overlaps a box before it in 'm'"},
      {"a box past the tensor", {{{3, 0}, {2, 2}, {0}, {1}}}, GRPC_STATUS_INVALID_ARGUMENT,
       "patch.spans[0].box: must lie within 'm'"},
      {"a box and a flat span", {{{0, 0}, {4, 2}, {0}, {1}}, {{20, 0}, {1, 4}, {0}, {2}, 0, true}},
       GRPC_STATUS_INVALID_ARGUMENT, "patch.spans[1]: a patch's spans are all boxes or none"},
      {"an index past its box", {{{1, 3}, {2, 3}, {6}, {1}}}, GRPC_STATUS_INVALID_ARGUMENT,
       "patch.spans[0]: patch of 'm': index 0 of 1 is past"},
      {"a box's result unlike the trainer's",
       {{{0, 0}, {4, 2}, {1}, {1}}, {{1, 3}, {2, 3}, {1}, {2}, 0x1234}}, GRPC_STATUS_DATA_LOSS,
       "span 1 of 'm' patched is not the trainer's span"},
  };
  std::vector<uint8_t> v1 = Full(1);
  for (Case &k : cases) {
    ASSERT_EQ(0, Start(WTX__V1__UPDATE_TARGET__UPDATE_TARGET_MAIN, 0, "v1"))
        << k.what << ": " << st_.message;
    Apply(v1, &k.spans);
    EXPECT_NE(0, SendBoxSpans(k.spans)) << k.what;
    EXPECT_EQ(k.code, st_.code) << k.what << ": " << st_.message;
    EXPECT_NE(nullptr, strstr(st_.message, k.says)) << k.what << ": " << st_.message;
    ExpectServes(v1, "v1");
  }
}

TEST_F(SessionTest, ADeltaToAWorkerServingNothingIsRefused) {
  ASSERT_EQ(0, Init()) << st_.message;
  EXPECT_NE(0, Start(WTX__V1__UPDATE_TARGET__UPDATE_TARGET_MAIN, 0, "v1"));
  EXPECT_EQ(GRPC_STATUS_FAILED_PRECONDITION, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "serves no version yet")) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;  // nothing was left open
}

TEST_F(SessionTest, CallsBeforeInitAreFailedPrecondition) {
  EXPECT_EQ(WTX_ESTATE, Start());
  EXPECT_EQ(GRPC_STATUS_FAILED_PRECONDITION, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "InitWeightTransferEngine first"));
  // A session id from before a restart: unknown, so NOT_FOUND (the
  // trainer's cue to initialize again), not out of order.
  session_ = std::string(32, 'a');
  EXPECT_EQ(WTX_ENOENT, Start());
  EXPECT_EQ(GRPC_STATUS_NOT_FOUND, st_.code);
}

TEST_F(SessionTest, NoBackendListsTheRegisteredOnes) {
  EXPECT_EQ(WTX_EINVAL, Init("none"));
  EXPECT_EQ(GRPC_STATUS_INVALID_ARGUMENT, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "init_info.backend: no backend set; this worker "
                                         "serves: shm, tcp, nccl, cuda_ipc"))
      << st_.message;
}

TEST_F(SessionTest, AGpuBackendWithoutItsLibraryIsUnavailableAndSaysWhy) {
  setenv("WTX_CUDART_LIB", "/nonexistent/libcudart.so", 1);
  EXPECT_EQ(WTX_EUNAVAIL, Init("cuda_ipc"));
  unsetenv("WTX_CUDART_LIB");
  EXPECT_EQ(GRPC_STATUS_UNAVAILABLE, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "WTX_CUDART_LIB=/nonexistent/libcudart.so"))
      << st_.message;
}

TEST_F(SessionTest, UpdateAndFinishWithoutStartAreRefused) {
  ASSERT_EQ(0, Init());
  EXPECT_EQ(WTX_ESTATE, Update({T("a", 4, 0)}));
  EXPECT_EQ(GRPC_STATUS_FAILED_PRECONDITION, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "StartWeightUpdate first"));
  EXPECT_EQ(WTX_ESTATE, Finish());
  EXPECT_NE(nullptr, strstr(st_.message, "FinishWeightUpdate without an active update"));
}

TEST_F(SessionTest, SecondStartAndReinitDuringUpdateAreRefused) {
  ASSERT_EQ(0, Init());
  ASSERT_EQ(0, Start());
  std::string sid = session_;
  EXPECT_EQ(WTX_ESTATE, Start());
  EXPECT_NE(nullptr, strstr(st_.message, "already active"));
  EXPECT_EQ(WTX_ESTATE, Init());
  EXPECT_NE(nullptr, strstr(st_.message, "before re-initializing"));
  session_ = "0123";
  EXPECT_EQ(WTX_ENOENT, Finish());
  EXPECT_EQ(GRPC_STATUS_NOT_FOUND, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "session_id"));
}

TEST_F(SessionTest, DuplicateNameInAnUpdateAbortsItAndKeepsOldWeights) {
  PublishV1();
  ASSERT_EQ(0, Start());
  ASSERT_EQ(0, Update({T("a", 16, 9)}));
  EXPECT_EQ(WTX_EINVAL, Update({T("a", 16, 9)}));
  EXPECT_NE(nullptr, strstr(st_.message, "'a' appears twice"));
  ExpectV1Intact();
  EXPECT_EQ(WTX_ESTATE, Finish());  // the update is gone
}

TEST_F(SessionTest, ShapeOrNameOutsideTheLayoutIsRejectedBeforeBytesMove) {
  PublishV1();
  ASSERT_EQ(0, Start());
  EXPECT_EQ(WTX_EINVAL, Update({T("a", 15, 0)}));
  EXPECT_NE(nullptr, strstr(st_.message, "the model holds shape [16]"));
  ASSERT_EQ(0, Start());
  EXPECT_EQ(WTX_ENOENT, Update({T("zzz", 4, 0)}));
  EXPECT_EQ(GRPC_STATUS_NOT_FOUND, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "'zzz' is not in the model"));
  ExpectV1Intact();
}

TEST_F(SessionTest, CorruptedByteIsDataLossAndKeepsOldWeights) {
  PublishV1();
  ASSERT_EQ(0, Start());
  EXPECT_EQ(WTX_ECHECKSUM, Update({T("a", 16, 7), T("b", 8, 7)}, /*corrupt=*/true));
  EXPECT_EQ(GRPC_STATUS_DATA_LOSS, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "checksum mismatch for 'a': the bytes received do "
                                         "not hash to the sender's xxh3"))
      << st_.message;
  // No hash of what arrived is echoed (it would tell of bytes the caller
  // may not own): the message holds no 16-digit hex number.
  for (const char *p = st_.message; *p; p++)
    ASSERT_FALSE(strspn(p, "0123456789abcdef") >= 16) << st_.message;
  ExpectV1Intact();
}

TEST_F(SessionTest, WithoutChecksumsNoHashIsReported) {
  ASSERT_EQ(0, Init("shm", WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE)) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("a", 16, 1)})) << st_.message;
  ASSERT_EQ(0, Finish("plain")) << st_.message;
  Wtx__V1__GetWeightInfoRequest req = WTX__V1__GET_WEIGHT_INFO_REQUEST__INIT;
  req.include_params = 1;
  Wtx__V1__GetWeightInfoResponse *info = nullptr;
  ASSERT_EQ(0, wtx__v1__weight_transfer__get_weight_info__call(ch_, &req, &info, nullptr, &st_));
  ASSERT_EQ(1u, info->n_params);
  EXPECT_FALSE(info->params[0]->has_xxh3_64);  // never the XXH3 of empty input
  EXPECT_EQ(0u, info->params[0]->xxh3_64);
  protobuf_c_message_free_unpacked(&info->base, nullptr);
  // With checksums, the published hash is the bytes' own.
  ASSERT_EQ(0, Init("shm")) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  Tensor a = T("a", 16, 2);
  ASSERT_EQ(0, Update({a})) << st_.message;
  ASSERT_EQ(0, Finish("hashed")) << st_.message;
  ASSERT_EQ(0, wtx__v1__weight_transfer__get_weight_info__call(ch_, &req, &info, nullptr, &st_));
  ASSERT_EQ(1u, info->n_params);
  EXPECT_TRUE(info->params[0]->has_xxh3_64);
  EXPECT_EQ(XXH3_64bits(a.data.data(), a.data.size()), info->params[0]->xxh3_64);
  protobuf_c_message_free_unpacked(&info->base, nullptr);
}

TEST_F(SessionTest, AbortDiscardsStagedWeightsAndANewUpdateCanStart) {
  PublishV1();
  ASSERT_EQ(0, Start());
  ASSERT_EQ(0, Update({T("a", 16, 42)}));
  ASSERT_EQ(0, Abort());
  ExpectV1Intact();
  ASSERT_EQ(0, Start());
  ASSERT_EQ(0, Update({T("b", 8, 77)}));
  ASSERT_EQ(0, Finish());
  std::vector<std::pair<std::string, std::vector<uint8_t>>> now;
  EXPECT_EQ("1", Published(&now));  // numbered by the worker
  ASSERT_EQ(2u, now.size());
  EXPECT_EQ(v1_[0], now[0]);               // untouched tensor carried over
  EXPECT_EQ(T("b", 8, 77).data, now[1].second);  // updated tensor replaced
}

// A trainer whose Finish failed on another replica undoes the update
// here: the worker serves again the version it replaced, bytes and label,
// and the table the update sent is forgotten, so the next update sends its params. Repeating the undo
// changes nothing; the undone update cannot be finished again.
TEST_F(SessionTest, AnAbortNamingThePublishedUpdateServesTheVersionItReplaced) {
  PublishV1();
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("a", 16, 90), T("b", 8, 91)})) << st_.message;
  ASSERT_EQ(0, Finish("v2")) << st_.message;
  const uint64_t v2 = update_;
  bool reverted = false;
  std::string version;
  ASSERT_EQ(0, AbortNamed(v2, &reverted, &version)) << st_.message;
  EXPECT_TRUE(reverted);
  EXPECT_EQ("v1", version);
  ExpectV1Intact();
  ASSERT_EQ(0, AbortNamed(v2, &reverted, &version)) << st_.message;
  EXPECT_FALSE(reverted);
  EXPECT_EQ("v1", version);
  ExpectV1Intact();
  EXPECT_NE(0, Finish("v2"));
  EXPECT_EQ(GRPC_STATUS_FAILED_PRECONDITION, st_.code) << st_.message;
  ExpectV1Intact();
  ASSERT_EQ(0, Start()) << st_.message;
  EXPECT_EQ(0u, table_);
  ASSERT_EQ(0, Update({T("b", 8, 33)})) << st_.message;
  ASSERT_EQ(0, Finish("v3")) << st_.message;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> now;
  EXPECT_EQ("v3", Published(&now));
  ASSERT_EQ(2u, now.size());
  EXPECT_EQ(v1_[0], now[0]);
  EXPECT_EQ(T("b", 8, 33).data, now[1].second);
}

// A prepared update named by the undo is discarded as any abort; a
// published one that an update or a session followed can no longer be
// undone, and the answer says so by the field, changing nothing.
TEST_F(SessionTest, AnUndoAfterTheNextUpdateBeganIsRefusedAndChangesNothing) {
  PublishV1();
  const uint64_t v1 = update_;
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("a", 16, 7)})) << st_.message;
  ASSERT_EQ(0, Prepare("v2")) << st_.message;
  bool reverted = true;
  std::string version;
  ASSERT_EQ(0, AbortNamed(update_, &reverted, &version)) << st_.message;
  EXPECT_FALSE(reverted);
  EXPECT_EQ("v1", version);
  ExpectV1Intact();
  EXPECT_NE(0, AbortNamed(v1));
  EXPECT_EQ(GRPC_STATUS_FAILED_PRECONDITION, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "update_id: update 1 is published and can no longer "
                                         "be undone here: an update or a session began since"))
      << st_.message;
  ExpectV1Intact();
}

TEST_F(SessionTest, WatchdogAbortsAnIdleUpdate) {
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.watchdog_ms = 100;
  Restart(o);
  PublishV1();
  ASSERT_EQ(0, Start());
  ASSERT_EQ(0, Update({T("a", 16, 3)}));
  std::this_thread::sleep_for(std::chrono::milliseconds(250));
  EXPECT_EQ(1, wtx_worker_watchdog(w_));
  EXPECT_EQ(WTX_ESTATE, Finish());
  ExpectV1Intact();
}

TEST_F(SessionTest, InspectionCallsAnswer) {
  PublishV1();
  Wtx__V1__GetWeightInfoRequest req = WTX__V1__GET_WEIGHT_INFO_REQUEST__INIT;
  req.include_params = 1;
  Wtx__V1__GetWeightInfoResponse *info = nullptr;
  ASSERT_EQ(0, wtx__v1__weight_transfer__get_weight_info__call(ch_, &req, &info,
                                                                nullptr, &st_));
  EXPECT_STREQ("v1", info->weight_version);
  EXPECT_EQ(2u, info->num_params);
  EXPECT_EQ(96u, info->total_bytes);
  ASSERT_EQ(2u, info->n_params);
  EXPECT_STREQ("b", info->params[1]->meta->name);
  EXPECT_EQ(XXH3_64bits(T("b", 8, 2).data.data(), 32), info->params[1]->xxh3_64);
  EXPECT_EQ(WTX__V1__SESSION_STATE__SESSION_STATE_READY, info->state);
  protobuf_c_message_free_unpacked(&info->base, nullptr);

  Wtx__V1__UpdateWeightVersionRequest vr = WTX__V1__UPDATE_WEIGHT_VERSION_REQUEST__INIT;
  vr.weight_version = const_cast<char *>("v1-relabelled");
  Wtx__V1__UpdateWeightVersionResponse *vresp = nullptr;
  ASSERT_EQ(0, wtx__v1__weight_transfer__update_weight_version__call(ch_, &vr, &vresp,
                                                                      nullptr, &st_));
  EXPECT_STREQ("v1", vresp->previous_version);
  protobuf_c_message_free_unpacked(&vresp->base, nullptr);

  Wtx__V1__PauseRequest pr = WTX__V1__PAUSE_REQUEST__INIT;
  Wtx__V1__PauseResponse *presp = nullptr;
  ASSERT_EQ(0, wtx__v1__weight_transfer__pause__call(ch_, &pr, &presp, nullptr, &st_));
  EXPECT_TRUE(presp->paused);
  EXPECT_TRUE(wtx_worker_paused(w_));
  protobuf_c_message_free_unpacked(&presp->base, nullptr);
  Wtx__V1__GetWorldSizeRequest wr = WTX__V1__GET_WORLD_SIZE_REQUEST__INIT;
  Wtx__V1__GetWorldSizeResponse *wresp = nullptr;
  ASSERT_EQ(0, wtx__v1__weight_transfer__get_world_size__call(ch_, &wr, &wresp,
                                                               nullptr, &st_));
  EXPECT_EQ(1u, wresp->world_size);
  protobuf_c_message_free_unpacked(&wresp->base, nullptr);
}

// A TEST DOUBLE of a slow data plane, registered under its own name
// ("slow") for InitInfo's nccl member; a worker that names it in its
// backends serves nccl with it. receive blocks until released, then
// delivers zeros (one tensor); like a real backend it can be cancelled
// from another thread, which ends the receive at once.
std::mutex g_mu;
std::condition_variable g_cv;
bool g_in_receive = false, g_release = false, g_cancelled = false;

int SlowInit(const Wtx__V1__InitInfo *, const wtx_wire_params *, const wtx_worker_env *,
             void **self, char *, size_t) {
  *self = nullptr;
  return 0;
}

int SlowReceive(void *, const Wtx__V1__UpdateInfo *, wtx_rx *rx) {
  std::unique_lock<std::mutex> lk(g_mu);
  g_in_receive = true;
  g_cv.notify_all();
  g_cv.wait(lk, [] { return g_release || g_cancelled; });
  if (g_cancelled) {
    wtx_rx_errorf(rx, "slow: cancelled");
    return WTX_ECANCELED;
  }
  std::vector<uint8_t> zeros(wtx_rx_remaining(rx));
  return wtx_rx_bytes(rx, zeros.data(), zeros.size());
}

void SlowCancel(void *) {
  std::lock_guard<std::mutex> lk(g_mu);
  g_cancelled = true;
  g_cv.notify_all();
}

void SlowDestroy(void *) {}

const wtx_worker_transport kSlowDouble = {
    .name = "slow",
    .init_case = WTX__V1__INIT_INFO__BACKEND_NCCL,
    .update_case = WTX__V1__UPDATE_INFO__BACKEND_NCCL,
    .default_checksum = WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64,
    .supports_draft = 0,
    .init = SlowInit,
    .connect = nullptr,
    .receive = SlowReceive,
    .cancel = SlowCancel,
    .reset = nullptr,
    .destroy = SlowDestroy,
    .device = nullptr,
    .region = nullptr,
    .put_box = nullptr,
};

// The store, counting aborts.
struct CountingModel {
  wtx_store *store;
  int aborts = 0;
};
int CmCheck(void *m, wtx_target t, const wtx_tensor_meta *meta, char *e, size_t n) {
  return wtx_store_model_ops.check(static_cast<CountingModel *>(m)->store, t, meta, e, n);
}
int CmBegin(void *m, wtx_target t) {
  return wtx_store_model_ops.begin(static_cast<CountingModel *>(m)->store, t);
}
int CmStage(void *m, const wtx_tensor_meta *meta, uint8_t **dst) {
  return wtx_store_model_ops.stage(static_cast<CountingModel *>(m)->store, meta, dst);
}
int CmLoaded(void *m, const wtx_tensor_meta *meta, const uint64_t *h) {
  return wtx_store_model_ops.loaded(static_cast<CountingModel *>(m)->store, meta, h);
}
int CmCommit(void *m, const char *v) {
  return wtx_store_model_ops.commit(static_cast<CountingModel *>(m)->store, v);
}
void CmAbort(void *m) {
  static_cast<CountingModel *>(m)->aborts++;
  wtx_store_model_ops.abort(static_cast<CountingModel *>(m)->store);
}
int CmPrepare(void *m, const char *v, char *e, size_t n) {
  return wtx_store_model_ops.prepare(static_cast<CountingModel *>(m)->store, v, e, n);
}
const wtx_model_ops kCounting = {WTX_MODEL_OPS_VERSION, CmCheck, CmBegin, CmStage, CmLoaded, CmPrepare, CmCommit,
                                 CmAbort, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                 nullptr, nullptr, nullptr};

TEST_F(SessionTest, DrainDuringAReceiveAbortsTheUpdateOnceItReturns) {
  // Replace the fixture's worker by one over a counting model.
  CountingModel cm;
  ASSERT_EQ(0, wtx_store_create(&cm.store));
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  UseSlowDouble(&o);
  o.model_ops = &kCounting;
  o.model = &cm;
  Restart(o);
  ASSERT_EQ(0, Init("nccl")) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  wtx__rpc_pending *p = StartSlowUpdate();
  std::thread drainer([&] { wtx_worker_drain(w_, 10000); });
  {  // the drain reached the running receive: it cancels it
    std::unique_lock<std::mutex> lk(g_mu);
    EXPECT_TRUE(g_cv.wait_for(lk, std::chrono::seconds(10), [] { return g_cancelled; }));
  }
  ReleaseSlowReceive();
  Wtx__V1__UpdateWeightsResponse *resp = nullptr;
  EXPECT_NE(0, wtx__v1__weight_transfer__update_weights__wait(p, &resp, &st_));
  drainer.join();
  EXPECT_EQ(1, cm.aborts);  // the staged tensor was discarded exactly once
  wtx_store_view v;
  wtx_store_acquire(cm.store, WTX_TARGET_MAIN, &v);
  EXPECT_EQ(0u, v.n_params);  // nothing was published
  wtx_store_release(cm.store, &v);
  Stop();  // before the model on this stack goes
  wtx_store_destroy(cm.store);
}

// An UpdateWeights of one 16-byte tensor over the slow double, left in
// flight once the worker is inside receive.
wtx__rpc_pending *SessionTest::StartSlowUpdate() {
  {
    std::lock_guard<std::mutex> lk(g_mu);
    g_in_receive = g_release = g_cancelled = false;
  }
  {
    std::lock_guard<std::mutex> lk(g_mu);
    g_in_receive = g_release = false;
  }
  Wtx__V1__ParamMeta pm = WTX__V1__PARAM_META__INIT;
  pm.name = const_cast<char *>("a");
  pm.dtype = WTX__V1__DTYPE__DTYPE_UINT8;
  uint64_t shape = 16;
  pm.shape = &shape;
  pm.n_shape = 1;
  Wtx__V1__ParamMeta *pmp = &pm;
  Wtx__V1__NcclUpdateInfo tu = WTX__V1__NCCL_UPDATE_INFO__INIT;
  Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
  ui.params = &pmp;
  ui.n_params = 1;
  static const uint8_t zeros[16] = {0};
  static uint64_t sum;  // the double delivers zeros
  sum = XXH3_64bits(zeros, sizeof zeros);
  ui.xxh3_64 = &sum;
  ui.n_xxh3_64 = 1;
  ui.backend_case = WTX__V1__UPDATE_INFO__BACKEND_NCCL;
  ui.nccl = &tu;
  wtx__rpc_pending *p = StartUpdateCall(ch_, session_, update_, &ui);
  std::unique_lock<std::mutex> lk(g_mu);
  EXPECT_TRUE(g_cv.wait_for(lk, std::chrono::seconds(10), [] { return g_in_receive; }));
  return p;
}

void ReleaseSlowReceive() {
  std::lock_guard<std::mutex> lk(g_mu);
  g_release = true;
  g_cv.notify_all();
}

const char *const kSlowBackends[] = {"shm", "slow"};

void UseSlowDouble(wtx_worker_options *o) {
  static const int registered = wtx_worker_transport_register(&kSlowDouble);
  ASSERT_EQ(0, registered);
  o->backends = kSlowBackends;
  o->n_backends = 2;
}

void SessionTest::InitOnSlowDouble() {
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  UseSlowDouble(&o);
  Restart(o);
  ASSERT_EQ(0, Init("nccl")) << st_.message;
}

TEST_F(SessionTest, InspectionIsAnsweredWhileAnUpdateIsReceiving) {
  ASSERT_NO_FATAL_FAILURE(InitOnSlowDouble());
  ASSERT_EQ(0, Start()) << st_.message;
  wtx__rpc_pending *p = StartSlowUpdate();
  Wtx__V1__GetWeightInfoResponse *info = nullptr;
  ASSERT_EQ(0, Info(&info)) << st_.message;
  EXPECT_EQ(WTX__V1__SESSION_STATE__SESSION_STATE_UPDATING, info->state);
  EXPECT_EQ(WTX__V1__UPDATE_TARGET__UPDATE_TARGET_MAIN, info->active_target);
  EXPECT_STREQ("slow", info->backend);
  protobuf_c_message_free_unpacked(&info->base, nullptr);
  ReleaseSlowReceive();
  Wtx__V1__UpdateWeightsResponse *resp = nullptr;
  ASSERT_EQ(0, wtx__v1__weight_transfer__update_weights__wait(p, &resp, &st_)) << st_.message;
  EXPECT_EQ(16u, resp->staged_bytes);
  protobuf_c_message_free_unpacked(&resp->base, nullptr);
  ASSERT_EQ(0, Finish("after")) << st_.message;
}

TEST_F(SessionTest, DraftTargetPublishesBesideTheMainWeights) {
  PublishV1();
  ASSERT_EQ(0, Start(WTX__V1__UPDATE_TARGET__UPDATE_TARGET_DRAFT)) << st_.message;
  ASSERT_EQ(0, Update({T("draft.w", 4, 5)})) << st_.message;
  ASSERT_EQ(0, Finish("d1")) << st_.message;
  ExpectV1Intact();
  wtx_store_view d;
  wtx_store_acquire(wtx_worker_store(w_), WTX_TARGET_DRAFT, &d);
  ASSERT_EQ(1u, d.n_params);
  EXPECT_STREQ("draft.w", d.params[0].meta.name);
  EXPECT_EQ(0, memcmp(T("draft.w", 4, 5).data.data(), d.params[0].data, 16));
  wtx_store_release(wtx_worker_store(w_), &d);
  Wtx__V1__GetWeightInfoResponse *info = nullptr;
  ASSERT_EQ(0, Info(&info));
  EXPECT_EQ(1u, info->draft_num_params);
  EXPECT_EQ(16u, info->draft_total_bytes);
  EXPECT_STREQ("v1", info->weight_version);
  protobuf_c_message_free_unpacked(&info->base, nullptr);
}

TEST_F(SessionTest, DraftTargetOnAnEngineWithoutItIsRefused) {
  ASSERT_NO_FATAL_FAILURE(InitOnSlowDouble());
  EXPECT_EQ(WTX_ESTATE, Start(WTX__V1__UPDATE_TARGET__UPDATE_TARGET_DRAFT));
  EXPECT_EQ(GRPC_STATUS_FAILED_PRECONDITION, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "draft")) << st_.message;
  EXPECT_NE(nullptr, strstr(st_.message, "the slow engine")) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;  // the main target still works
}

TEST_F(SessionTest, HealthGoesNotServingOnDemandAndWhenDraining) {
  auto check = [&](int *status) {
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = const_cast<char *>("wtx.v1.WeightTransfer");
    Grpc__Health__V1__HealthCheckResponse *resp = nullptr;
    int rc = grpc__health__v1__health__check__call(ch_, &req, &resp, nullptr, &st_);
    if (rc == 0) {
      *status = resp->status;
      protobuf_c_message_free_unpacked(&resp->base, nullptr);
    }
    return rc;
  };
  int status = -1;
  ASSERT_EQ(0, check(&status)) << st_.message;
  EXPECT_EQ(GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING, status);
  wtx_worker_set_serving(w_, 0);  // e.g. the host's engine is not ready
  ASSERT_EQ(0, check(&status));
  EXPECT_EQ(GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING, status);
  wtx_worker_set_serving(w_, 1);

  wtx__rpc_stream *s = nullptr;
  ASSERT_EQ(0, grpc__health__v1__health__watch__open(ch_, nullptr, &s));
  Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  ASSERT_EQ(0, grpc__health__v1__health__watch__send(s, &req));
  Grpc__Health__V1__HealthCheckResponse *m = nullptr;
  ASSERT_EQ(1, grpc__health__v1__health__watch__recv(s, &m));
  EXPECT_EQ(GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING, m->status);
  protobuf_c_message_free_unpacked(&m->base, nullptr);
  std::thread drainer([&] { wtx_worker_drain(w_, 5000); });
  ASSERT_EQ(1, grpc__health__v1__health__watch__recv(s, &m));
  EXPECT_EQ(GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING, m->status);
  protobuf_c_message_free_unpacked(&m->base, nullptr);
  EXPECT_EQ(0, grpc__health__v1__health__watch__recv(s, &m));  // the watch ends
  wtx__rpc_status st;
  EXPECT_EQ(0, wtx__rpc_stream_finish(s, &st)) << st.message;
  drainer.join();
}

// A host's own model (the embedding API): tensors land in its memory through
// its callbacks, and Pause/Resume reach the host.
struct HostModel {
  std::map<std::string, std::vector<uint8_t>> staged, live;
  std::map<std::string, uint64_t> sums;
  std::string version;
  int begins = 0, aborts = 0, pauses = 0, resumes = 0, last_wait = -1;
  int commit_rc = 0;  // what commit answers; not 0: it fails before any change
};
int HmBegin(void *m, wtx_target) {
  static_cast<HostModel *>(m)->begins++;
  return 0;
}
int HmStage(void *m, const wtx_tensor_meta *meta, uint8_t **dst) {
  auto &buf = static_cast<HostModel *>(m)->staged[meta->name];
  buf.resize(meta->nbytes);
  *dst = buf.data();
  return 0;
}
int HmLoaded(void *m, const wtx_tensor_meta *meta, const uint64_t *h) {
  static_cast<HostModel *>(m)->sums[meta->name] = h != nullptr ? *h : 0;
  return 0;
}
int HmCommit(void *m, const char *v) {
  auto *hm = static_cast<HostModel *>(m);
  if (hm->commit_rc != 0) return hm->commit_rc;
  for (auto &kv : hm->staged) hm->live[kv.first] = kv.second;
  hm->staged.clear();
  hm->version = v;
  return 0;
}
void HmAbort(void *m) {
  static_cast<HostModel *>(m)->aborts++;
  static_cast<HostModel *>(m)->staged.clear();
}
void HmPause(void *h, int wait) {
  static_cast<HostModel *>(h)->pauses++;
  static_cast<HostModel *>(h)->last_wait = wait;
}
void HmResume(void *h) { static_cast<HostModel *>(h)->resumes++; }
// No prepare: commit does it all (a host model that cannot fail there).
const wtx_model_ops kHost = {WTX_MODEL_OPS_VERSION, nullptr, HmBegin, HmStage, HmLoaded, nullptr, HmCommit,
                             HmAbort, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                             nullptr, nullptr, nullptr};

TEST_F(SessionTest, EmbeddedHostModelReceivesTensorsAndPauseCallbacks) {
  HostModel hm;
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.model_ops = &kHost;
  o.model = &hm;
  o.on_pause = HmPause;
  o.on_resume = HmResume;
  o.host = &hm;
  Restart(o);
  EXPECT_EQ(nullptr, wtx_worker_store(w_));
  ASSERT_EQ(0, Init()) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("x", 8, 3), T("y", 2, 9)})) << st_.message;
  ASSERT_EQ(0, Finish("host-1")) << st_.message;
  EXPECT_EQ("host-1", hm.version);
  EXPECT_EQ(1, hm.begins);
  EXPECT_EQ(T("x", 8, 3).data, hm.live["x"]);
  EXPECT_EQ(T("y", 2, 9).data, hm.live["y"]);
  EXPECT_EQ(XXH3_64bits(hm.live["y"].data(), 8), hm.sums["y"]);

  Wtx__V1__PauseRequest pr = WTX__V1__PAUSE_REQUEST__INIT;
  pr.wait_for_inflight = 1;
  Wtx__V1__PauseResponse *presp = nullptr;
  ASSERT_EQ(0, wtx__v1__weight_transfer__pause__call(ch_, &pr, &presp, nullptr, &st_));
  protobuf_c_message_free_unpacked(&presp->base, nullptr);
  EXPECT_EQ(1, hm.pauses);
  EXPECT_EQ(1, hm.last_wait);
  EXPECT_TRUE(wtx_worker_paused(w_));
  Wtx__V1__ResumeRequest rr = WTX__V1__RESUME_REQUEST__INIT;
  Wtx__V1__ResumeResponse *rresp = nullptr;
  ASSERT_EQ(0, wtx__v1__weight_transfer__resume__call(ch_, &rr, &rresp, nullptr, &st_));
  protobuf_c_message_free_unpacked(&rresp->base, nullptr);
  EXPECT_EQ(1, hm.resumes);
  EXPECT_FALSE(wtx_worker_paused(w_));

  // A failed update reaches the host as an abort; its live weights stay.
  ASSERT_EQ(0, Start());
  EXPECT_EQ(WTX_ECHECKSUM, Update({T("x", 8, 1)}, /*corrupt=*/true));
  EXPECT_EQ(1, hm.aborts);
  EXPECT_EQ(T("x", 8, 3).data, hm.live["x"]);

  // Relabelling belongs to the host's model, not to the worker.
  Wtx__V1__UpdateWeightVersionRequest vr = WTX__V1__UPDATE_WEIGHT_VERSION_REQUEST__INIT;
  vr.weight_version = const_cast<char *>("x");
  Wtx__V1__UpdateWeightVersionResponse *vresp = nullptr;
  EXPECT_EQ(WTX_ENOTSUP, wtx__v1__weight_transfer__update_weight_version__call(
                             ch_, &vr, &vresp, nullptr, &st_));
  EXPECT_EQ(GRPC_STATUS_UNIMPLEMENTED, st_.code);
  Stop();  // before the model on this stack goes
}

// A host model without revert cannot undo what it published: the trainer
// is told so, naming the op, and the host's weights stay as published.
TEST_F(SessionTest, AnUndoOnAModelThatCannotRevertSaysSoAndKeepsItsWeights) {
  HostModel hm;
  Serve(&kHost, &hm);
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("x", 8, 3)})) << st_.message;
  ASSERT_EQ(0, Finish("h1")) << st_.message;
  EXPECT_NE(0, AbortNamed(update_));
  EXPECT_EQ(GRPC_STATUS_FAILED_PRECONDITION, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "wtx_model_ops.revert")) << st_.message;
  EXPECT_EQ("h1", hm.version);
  EXPECT_EQ(T("x", 8, 3).data, hm.live["x"]);
  Stop();  // before the model on this stack goes
}

// A host model whose commit fails (a Python host's load_weights raising
// answers WTX_EIO) ends the update with a status no client retries: a
// retried Finish would find no update and answer that instead of the cause.
// A host model's ops must say their version: 0 (unset) or one past this
// library's stops the worker from starting, naming the field.
TEST_F(SessionTest, HostModelOpsOfNoVersionOrALaterOneAreRefused) {
  for (unsigned v : {0u, WTX_MODEL_OPS_VERSION + 1}) {
    wtx_model_ops ops = kHost;
    ops.version = v;
    wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
    o.listen = "127.0.0.1:0";
    o.model_ops = &ops;
    HostModel model;
    o.model = &model;
    wtx_worker *w = nullptr;
    char err[256] = "";
    EXPECT_EQ(WTX_EINVAL, wtx_worker_start(&o, &w, err, sizeof err)) << v;
    EXPECT_NE(nullptr, strstr(err, "model_ops.version")) << err;
    EXPECT_EQ(nullptr, w);
  }
}

TEST_F(SessionTest, AModelsFailedCommitIsInternalAndKeepsThePublishedWeights) {
  HostModel hm;
  Serve(&kHost, &hm);
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("x", 8, 3)})) << st_.message;
  ASSERT_EQ(0, Finish("good")) << st_.message;
  hm.commit_rc = WTX_EIO;
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("x", 8, 4)})) << st_.message;
  EXPECT_NE(0, Finish("bad"));
  EXPECT_EQ(GRPC_STATUS_INTERNAL, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "commit failed (update aborted")) << st_.message;
  EXPECT_EQ(1, hm.aborts);
  EXPECT_EQ("good", hm.version);
  EXPECT_EQ(T("x", 8, 3).data, hm.live["x"]);
  hm.commit_rc = 0;  // the next update publishes
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("x", 8, 5)})) << st_.message;
  ASSERT_EQ(0, Finish("next")) << st_.message;
  EXPECT_EQ(T("x", 8, 5).data, hm.live["x"]);
  Stop();  // before the model on this stack goes
}

// A host's model keeps no version of its own: GetWeightInfo names the one
// the session last published there (a new trainer's delta or patches name
// it as their base), and a failed commit leaves it as it was.
TEST_F(SessionTest, AHostModelsWeightInfoNamesTheVersionItLastPublished) {
  HostModel hm;
  Serve(&kHost, &hm);
  auto version = [&] {
    Wtx__V1__GetWeightInfoResponse *info = nullptr;
    EXPECT_EQ(0, Info(&info)) << st_.message;
    std::string v = info != nullptr ? info->weight_version : "?";
    if (info != nullptr) protobuf_c_message_free_unpacked(&info->base, nullptr);
    return v;
  };
  EXPECT_EQ("", version());
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("x", 8, 3)})) << st_.message;
  ASSERT_EQ(0, Finish("good")) << st_.message;
  EXPECT_EQ("good", version());
  hm.commit_rc = WTX_EIO;
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("x", 8, 4)})) << st_.message;
  EXPECT_NE(0, Finish("bad"));
  EXPECT_EQ("good", version());
  Stop();  // before the model on this stack goes
}

// A host model with the per-chunk ops (as the Python binding has): one call
// of each per chunk over the chunk's tensors, never the per-tensor ones.
struct ChunkModel : HostModel {
  std::vector<size_t> checked, staged_n, loaded_n;
  int per_tensor = 0;
  std::string refuse; // a name check_chunk refuses
  int loaded_rc = 0;  // what loaded_chunk answers (a Python host raising: WTX_EIO)
  int check_rc = 0;   // what check_chunk answers, when not 0
};
int CkPerTensorCheck(void *m, wtx_target, const wtx_tensor_meta *, char *, size_t) {
  static_cast<ChunkModel *>(m)->per_tensor++;
  return WTX_EIO;
}
int CkPerTensorStage(void *m, const wtx_tensor_meta *, uint8_t **) {
  static_cast<ChunkModel *>(m)->per_tensor++;
  return WTX_EIO;
}
int CkPerTensorLoaded(void *m, const wtx_tensor_meta *, const uint64_t *) {
  static_cast<ChunkModel *>(m)->per_tensor++;
  return WTX_EIO;
}
int CkCheckChunk(void *m, wtx_target, const wtx_tensor_meta *metas, size_t n, size_t *bad,
                 char *err, size_t errlen) {
  auto *cm = static_cast<ChunkModel *>(m);
  if (cm->check_rc != 0) return cm->check_rc;
  cm->checked.push_back(n);
  for (size_t i = 0; i < n; i++)
    if (cm->refuse == metas[i].name) {
      *bad = i;
      snprintf(err, errlen, "parameter '%s' is not in the module", metas[i].name);
      return WTX_ENOENT;
    }
  return 0;
}
int CkStageChunk(void *m, const wtx_tensor_meta *metas, size_t n, uint8_t **dst) {
  static_cast<ChunkModel *>(m)->staged_n.push_back(n);
  for (size_t i = 0; i < n; i++) HmStage(m, &metas[i], &dst[i]);
  return 0;
}
int CkLoadedChunk(void *m, const wtx_tensor_meta *metas, size_t n, const uint64_t *h) {
  if (static_cast<ChunkModel *>(m)->loaded_rc != 0) return static_cast<ChunkModel *>(m)->loaded_rc;
  static_cast<ChunkModel *>(m)->loaded_n.push_back(n);
  for (size_t i = 0; i < n; i++) HmLoaded(m, &metas[i], h != nullptr ? &h[i] : nullptr);
  return 0;
}
// The per-tensor ops fail and count: the session must not call them.
const wtx_model_ops kChunkHost = {WTX_MODEL_OPS_VERSION, CkPerTensorCheck, HmBegin,      CkPerTensorStage,
                                  CkPerTensorLoaded, nullptr,     HmCommit,
                                  HmAbort,          nullptr,      nullptr,
                                  CkCheckChunk,     CkStageChunk, CkLoadedChunk, nullptr,
                                  nullptr,          nullptr, nullptr};

TEST_F(SessionTest, AModelsPerChunkOpsAreCalledOncePerChunkInsteadOfPerTensor) {
  ChunkModel cm;
  Serve(&kChunkHost, &cm);
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("x", 8, 3), T("y", 2, 9), T("z", 4, 1)})) << st_.message;
  ASSERT_EQ(0, Update({T("w", 8, 5)})) << st_.message;
  ASSERT_EQ(0, Finish("c1")) << st_.message;
  EXPECT_EQ(0, cm.per_tensor);
  EXPECT_EQ((std::vector<size_t>{3, 1}), cm.checked);
  EXPECT_EQ((std::vector<size_t>{3, 1}), cm.staged_n);
  EXPECT_EQ((std::vector<size_t>{3, 1}), cm.loaded_n);
  EXPECT_EQ(T("y", 2, 9).data, cm.live["y"]);
  EXPECT_EQ(T("w", 8, 5).data, cm.live["w"]);
  EXPECT_EQ(XXH3_64bits(cm.live["z"].data(), 16), cm.sums["z"]);

  // Steady state: the same tensors by position in the table.
  Wtx__V1__ParamRange r = WTX__V1__PARAM_RANGE__INIT;
  ASSERT_EQ(0, Start()) << st_.message;
  r.table_xxh3 = table_;
  r.count = 3;
  ASSERT_EQ(0, Update({T("x", 8, 4), T("y", 2, 4), T("z", 4, 4)}, false, &r)) << st_.message;
  r.first = 3;
  r.count = 1;
  ASSERT_EQ(0, Update({T("w", 8, 4)}, false, &r)) << st_.message;
  ASSERT_EQ(0, Finish("c2")) << st_.message;
  EXPECT_EQ(0, cm.per_tensor);
  EXPECT_EQ((std::vector<size_t>{3, 1, 3, 1}), cm.checked);
  EXPECT_EQ(T("x", 8, 4).data, cm.live["x"]);

  // A tensor check_chunk refuses fails the chunk by name before any byte
  // moves, and the published weights stay.
  cm.refuse = "y";
  ASSERT_EQ(0, Start()) << st_.message;
  EXPECT_EQ(WTX_ENOENT, Update({T("x", 8, 7), T("y", 2, 7)}));
  EXPECT_NE(std::string::npos, std::string(st_.message).find("'y' is not in the module"))
      << st_.message;
  EXPECT_EQ((std::vector<size_t>{3, 1, 3, 1}), cm.staged_n);  // nothing staged
  EXPECT_EQ(1, cm.aborts);
  EXPECT_EQ(T("x", 8, 4).data, cm.live["x"]);
  EXPECT_EQ("c2", cm.version);

  // The model failing to take a chunk it staged (an I/O error of its own)
  // is INTERNAL, which no client takes as the network's, and names it.
  cm.refuse.clear();
  cm.loaded_rc = WTX_EIO;
  ASSERT_EQ(0, Start()) << st_.message;
  EXPECT_NE(0, Update({T("x", 8, 8)}));
  EXPECT_EQ(GRPC_STATUS_INTERNAL, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "model: cannot load the chunk's 1 tensors (from 'x')"))
      << st_.message;
  EXPECT_EQ(2, cm.aborts);
  EXPECT_EQ(T("x", 8, 4).data, cm.live["x"]);
  // So is its check failing so (any step but the receive).
  cm.loaded_rc = 0;
  cm.check_rc = WTX_EIO;
  ASSERT_EQ(0, Start()) << st_.message;
  EXPECT_NE(0, Update({T("x", 8, 9)}));
  EXPECT_EQ(GRPC_STATUS_INTERNAL, st_.code) << st_.message;
  EXPECT_EQ(3, cm.aborts);
  EXPECT_EQ(T("x", 8, 4).data, cm.live["x"]);
  Stop();  // before the model on this stack goes
}

// A host model with check_range: a chunk named by position is checked by
// one call naming the session's table and the positions, never by
// check_chunk or check; each table the session keeps has its own id.
struct RangeModel : ChunkModel {
  std::vector<std::tuple<uint64_t, size_t, size_t, std::string>> ranges; // id, first, n, [0]
};
int RmCheckRange(void *m, wtx_target, uint64_t table, size_t first,
                 const wtx_tensor_meta *metas, size_t n, size_t *bad, char *err,
                 size_t errlen) {
  auto *rm = static_cast<RangeModel *>(m);
  rm->ranges.emplace_back(table, first, n, metas[0].name);
  for (size_t i = 0; i < n; i++)
    if (rm->refuse == metas[i].name) {
      *bad = i;
      snprintf(err, errlen, "parameter '%s' is not in the module", metas[i].name);
      return WTX_ENOENT;
    }
  return 0;
}
const wtx_model_ops kRangeHost = {WTX_MODEL_OPS_VERSION, CkPerTensorCheck,  HmBegin,      CkPerTensorStage,
                                  CkPerTensorLoaded, nullptr,      HmCommit,
                                  HmAbort,           nullptr,      nullptr,
                                  CkCheckChunk,      CkStageChunk, CkLoadedChunk,
                                  RmCheckRange,      nullptr,      nullptr, nullptr};

TEST_F(SessionTest, ARangeIsCheckedByOneCallNamingTheTableAndItsPositions) {
  RangeModel rm;
  Serve(&kRangeHost, &rm);
  auto by_params = [&](const char *version, std::vector<std::vector<Tensor>> chunks) {
    ASSERT_EQ(0, Start()) << st_.message;
    for (auto &c : chunks) ASSERT_EQ(0, Update(c)) << st_.message;
    ASSERT_EQ(0, Finish(version)) << st_.message;
  };
  // Two chunks by position: [0, 3) and [3, 4) of the table.
  auto by_range = [&](const char *version, int fill) {
    Wtx__V1__ParamRange r = WTX__V1__PARAM_RANGE__INIT;
    ASSERT_EQ(0, Start()) << st_.message;
    r.table_xxh3 = table_;
    r.count = 3;
    ASSERT_EQ(0, Update({T("x", 8, fill), T("y", 2, fill), T("z", 4, fill)}, false, &r))
        << st_.message;
    r.first = 3;
    r.count = 1;
    ASSERT_EQ(0, Update({T("w", 8, fill)}, false, &r)) << st_.message;
    ASSERT_EQ(0, Finish(version)) << st_.message;
  };
  by_params("c1", {{T("x", 8, 3), T("y", 2, 9), T("z", 4, 1)}, {T("w", 8, 5)}});
  EXPECT_TRUE(rm.ranges.empty());  // params are checked by check_chunk
  by_range("c2", 4);
  by_range("c3", 6);
  ASSERT_EQ(4u, rm.ranges.size());
  uint64_t a = std::get<0>(rm.ranges[0]);
  EXPECT_NE(0u, a);
  using R = std::tuple<uint64_t, size_t, size_t, std::string>;
  EXPECT_EQ(R(a, 0, 3, "x"), rm.ranges[0]);
  EXPECT_EQ(R(a, 3, 1, "w"), rm.ranges[1]);
  EXPECT_EQ(R(a, 0, 3, "x"), rm.ranges[2]);  // the same table, the same id
  EXPECT_EQ(R(a, 3, 1, "w"), rm.ranges[3]);
  EXPECT_EQ((std::vector<size_t>{3, 1}), rm.checked);
  EXPECT_EQ(0, rm.per_tensor);
  EXPECT_EQ(T("y", 2, 6).data, rm.live["y"]);

  // Params sent again make a new table, with a new id.
  by_params("c4", {{T("x", 8, 1), T("y", 2, 1), T("z", 4, 1)}, {T("w", 8, 1)}});
  by_range("c5", 7);
  ASSERT_EQ(6u, rm.ranges.size());
  EXPECT_NE(a, std::get<0>(rm.ranges[4]));
  EXPECT_EQ(std::get<0>(rm.ranges[4]), std::get<0>(rm.ranges[5]));

  // A refusal fails the chunk by name before any byte moves; weights stay.
  rm.refuse = "z";
  Wtx__V1__ParamRange r = WTX__V1__PARAM_RANGE__INIT;
  ASSERT_EQ(0, Start()) << st_.message;
  r.table_xxh3 = table_;
  r.count = 3;
  size_t staged = rm.staged_n.size();
  EXPECT_EQ(WTX_ENOENT, Update({T("x", 8, 8), T("y", 2, 8), T("z", 4, 8)}, false, &r));
  EXPECT_NE(std::string::npos, std::string(st_.message).find("'z' is not in the module"))
      << st_.message;
  EXPECT_EQ(staged, rm.staged_n.size());
  EXPECT_EQ(1, rm.aborts);
  EXPECT_EQ(T("y", 2, 7).data, rm.live["y"]);
  EXPECT_EQ("c5", rm.version);
  Stop();  // before the model on this stack goes
}

// A scratch directory removed at the end of the test.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/wtx-session-XXXXXX";
    path = mkdtemp(tmpl);
  }
  ~TempDir() { EXPECT_EQ(0, std::system(("rm -rf " + path).c_str())); }
  std::set<std::string> Files() const {
    std::set<std::string> out;
    DIR *d = opendir(path.c_str());
    while (struct dirent *e = readdir(d))
      if (e->d_name[0] != '.') out.insert(e->d_name);
    closedir(d);
    return out;
  }
};

TEST_F(SessionTest, ModelSpecDeclaresTheLayoutBeforeAnyUpdate) {
  TempDir dir;
  std::string spec = dir.path + "/spec.safetensors";
  std::vector<uint8_t> a(64), b(32);
  wtx_st_tensor ts[2] = {{{"a", WTX_DTYPE_FLOAT32, {16}, 1, 64}, a.data()},
                         {{"b", WTX_DTYPE_FLOAT32, {8}, 1, 32}, b.data()}};
  char err[512] = "";
  ASSERT_EQ(0, wtx_st_write(spec.c_str(), ts, 2, nullptr, 0, err, sizeof err)) << err;
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.model_spec = spec.c_str();
  Restart(o);
  ASSERT_EQ(0, Init());
  ASSERT_EQ(0, Start());
  // The very first update is already checked against the declared layout.
  EXPECT_EQ(WTX_EINVAL, Update({T("a", 15, 0)}));
  EXPECT_NE(nullptr, strstr(st_.message, "the model holds shape [16]")) << st_.message;
  ASSERT_EQ(0, Start());
  EXPECT_EQ(WTX_ENOENT, Update({T("c", 4, 0)}));
  EXPECT_NE(nullptr, strstr(st_.message, "'c' is not in the model")) << st_.message;
  ASSERT_EQ(0, Start());
  ASSERT_EQ(0, Update({T("a", 16, 1), T("b", 8, 2)})) << st_.message;
  ASSERT_EQ(0, Finish()) << st_.message;

  // A spec that is not a safetensors file stops the worker from starting.
  std::string bad = dir.path + "/bad.safetensors";
  std::ofstream(bad) << "not a model";
  wtx_worker *w2 = nullptr;
  o.model_spec = bad.c_str();
  o.listen = "127.0.0.1:0";
  EXPECT_EQ(WTX_EINVAL, wtx_worker_start(&o, &w2, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "bad.safetensors")) << err;
  EXPECT_EQ(nullptr, w2);
}

TEST_F(SessionTest, PublishDirHoldsTheNewestVersionsAsSafetensors) {
  TempDir dir;
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.publish_dir = dir.path.c_str();
  o.publish_keep = 2;
  Restart(o);
  ASSERT_EQ(0, Init());
  auto latest = [&] {
    std::ifstream f(dir.path + "/LATEST");
    std::string s;
    std::getline(f, s);
    return s;
  };
  for (int i = 1; i <= 3; i++) {
    std::string v = "v" + std::to_string(i) + "/step";  // '/' is made safe
    ASSERT_EQ(0, Start());
    ASSERT_EQ(0, Update({T("a", 16, (uint8_t)i), T("b", 8, 2)})) << st_.message;
    ASSERT_EQ(0, Finish(v.c_str())) << st_.message;
    std::string want = "v" + std::to_string(i) + "_step.safetensors";
    ASSERT_TRUE(wtxtest::WaitLatest(dir.path, want)) << latest();
  }
  // The oldest file goes once LATEST names the newest (a reader of LATEST
  // always finds its file), so it may still be there a moment.
  const std::set<std::string> kept = {"LATEST", "v2_step.safetensors", "v3_step.safetensors"};
  wtxtest::WaitInDir(dir.path, [&] { return dir.Files() == kept; });
  EXPECT_EQ(kept, dir.Files());
  wtx_st_file *f = nullptr;
  char err[512] = "";
  ASSERT_EQ(0, wtx_st_open((dir.path + "/v3_step.safetensors").c_str(), &f, err, sizeof err))
      << err;
  EXPECT_STREQ("v3/step", wtx_st_metadata(f, "wtx_version"));
  ASSERT_EQ(2u, wtx_st_count(f));
  EXPECT_STREQ("a", wtx_st_tensor_at(f, 0)->meta.name);
  EXPECT_EQ(0, memcmp(T("a", 16, 3).data.data(), wtx_st_tensor_at(f, 0)->data, 64));
  EXPECT_EQ(0, memcmp(T("b", 8, 2).data.data(), wtx_st_tensor_at(f, 1)->data, 32));
  wtx_st_close(f);
}

}  // namespace

TEST_F(SessionTest, AWorkerServesOnlyTheBackendsItNames) {
  const char *const only_tcp[] = {"tcp"};
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.backends = only_tcp;
  o.n_backends = 1;
  Restart(o);
  EXPECT_EQ(WTX_EINVAL, Init("shm"));
  EXPECT_NE(nullptr, strstr(st_.message, "init_info.backend: 'shm' is not served by this "
                                         "worker; it serves: tcp"))
      << st_.message;
  // A name nobody registered, or two backends for one member, fail at start.
  const char *const unknown[] = {"shm", "nope"};
  const char *const twice[] = {"shm", "shm"};
  wtx_worker *w = nullptr;
  char err[512] = "";
  o.listen = "127.0.0.1:0";
  o.backends = unknown;
  o.n_backends = 2;
  EXPECT_EQ(WTX_EINVAL, wtx_worker_start(&o, &w, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "backends: 'nope' is not registered")) << err;
  o.backends = twice;
  EXPECT_EQ(WTX_EINVAL, wtx_worker_start(&o, &w, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "both serve init_info.shm")) << err;
  EXPECT_EQ(nullptr, w);
}

TEST_F(SessionTest, AChunkForAnotherBackendIsRefusedByName) {
  ASSERT_EQ(0, Init("shm")) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  Wtx__V1__ParamMeta pm = WTX__V1__PARAM_META__INIT, *pmp = &pm;
  pm.name = const_cast<char *>("a");
  pm.dtype = WTX__V1__DTYPE__DTYPE_UINT8;
  Wtx__V1__TcpUpdateInfo tu = WTX__V1__TCP_UPDATE_INFO__INIT;
  Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
  ui.params = &pmp;
  ui.n_params = 1;
  ui.backend_case = WTX__V1__UPDATE_INFO__BACKEND_TCP;  // a shm session
  ui.tcp = &tu;
  EXPECT_EQ(WTX_EINVAL, SendUpdate(&ui));
  EXPECT_NE(nullptr, strstr(st_.message, "update_info.shm: missing (the session's backend "
                                         "is shm)"))
      << st_.message;
}

TEST_F(SessionTest, AnUpdateBeyondTheWorkersLimitsIsResourceExhausted) {
  PublishV1();
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.max_params = 2;
  o.max_model_bytes = 96;  // a and b of PublishV1: 16 + 8 floats
  Restart(o);
  ASSERT_EQ(0, Init()) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  EXPECT_EQ(WTX_ETOOBIG, Update({T("a", 16, 1), T("b", 8, 2), T("c", 4, 3)}));
  EXPECT_EQ(GRPC_STATUS_RESOURCE_EXHAUSTED, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "3 parameters, this worker takes at most 2 "
                                         "(--max-params)")) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  EXPECT_EQ(WTX_ETOOBIG, Update({T("a", 16, 1), T("b", 12, 2)}));
  EXPECT_NE(nullptr, strstr(st_.message, "112 bytes, this worker takes at most 96 "
                                         "(--max-model-bytes)")) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("a", 16, 1), T("b", 8, 2)})) << st_.message;  // at the limits
  ASSERT_EQ(0, Finish("fits")) << st_.message;
  // A start that says how many tensors come is refused at once past the
  // limit, and opens no update.
  const auto main = WTX__V1__UPDATE_TARGET__UPDATE_TARGET_MAIN;
  EXPECT_EQ(WTX_ETOOBIG, Start(main, 3));
  EXPECT_EQ(GRPC_STATUS_RESOURCE_EXHAUSTED, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "expected_params: the update would hold 3 "
                                         "parameters, this worker takes at most 2 "
                                         "(--max-params)")) << st_.message;
  ASSERT_EQ(0, Start(main, 1)) << st_.message;  // a hint, not a limit of its own
  ASSERT_EQ(0, Update({T("a", 16, 4), T("b", 8, 5)})) << st_.message;
  ASSERT_EQ(0, Finish("fits again")) << st_.message;
}

// A tensor-parallel rank (wtx_worker_options.shard_rules) takes exactly
// its parts, announces its rules, and refuses anything else by name before
// any byte moves, keeping what it published.
struct Part {
  uint64_t full, offset;
  Wtx__V1__TensorPart msg;
  Part(uint64_t f, uint64_t o) : full(f), offset(o) {
    wtx__v1__tensor_part__init(&msg);
    msg.n_full_shape = msg.n_offset = 1;
    msg.full_shape = &full;
    msg.offset = &offset;
  }
};

TEST_F(SessionTest, ATensorParallelRankTakesExactlyItsPartsAndAnnouncesItsRules) {
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.shard_rules = "w dim 0\n# experts, in blocks\n*.experts.* expert 4\ns skip\n";
  o.tp_rank = 1;
  o.tp_size = 2;
  Restart(o);
  Wtx__V1__GetWeightInfoResponse *info = nullptr;
  ASSERT_EQ(0, Info(&info)) << st_.message;
  ASSERT_NE(nullptr, info->shard);
  EXPECT_EQ(1u, info->shard->tp_rank);
  EXPECT_EQ(2u, info->shard->tp_size);
  ASSERT_EQ(3u, info->shard->n_rules);
  EXPECT_STREQ("w", info->shard->rules[0]->pattern);
  EXPECT_EQ(WTX__V1__SHARD_KIND__SHARD_KIND_DIM, info->shard->rules[0]->kind);
  EXPECT_EQ(4u, info->shard->rules[1]->unit);
  protobuf_c_message_free_unpacked(&info->base, nullptr);
  // "a" matches no rule (whole); "w" is cut in two, rank 1 holding floats
  // [8, 16); experts 2-3 of 4 are rank 1's, whole.
  ASSERT_EQ(0, Init()) << st_.message;
  Part mine(16, 8), theirs(16, 0), past(16, 12);
  std::vector<Wtx__V1__TensorPart *> p = {nullptr, &mine.msg, nullptr};
  ASSERT_EQ(0, Start());
  ASSERT_EQ(0, Update({T("a", 4, 1), T("w", 8, 3), T("m.experts.3.w", 4, 5)}, false, nullptr, &p))
      << st_.message;
  ASSERT_EQ(0, Finish("v2")) << st_.message;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> now;
  EXPECT_EQ("v2", Published(&now));
  ASSERT_EQ(3u, now.size());
  EXPECT_EQ("w", now[1].first);
  EXPECT_EQ(T("w", 8, 3).data, now[1].second);  // 8 of the 16 floats
  v1_ = now;
  struct Case {
    Tensor t;
    Wtx__V1__TensorPart *part;
    const char *says;
  } cases[] = {
      {T("w", 16, 1), nullptr, "'w' on tensor-parallel rank 1 of 2 is [8, +8) of dim 0, not [0, +16)"},
      {T("w", 8, 1), &theirs.msg, "is [8, +8) of dim 0, not [0, +8)"},
      {T("w", 8, 1), &past.msg, "part: dim 0 [12, +8) is past the full shape's 16"},
      {T("s", 4, 1), nullptr, "'s' is not held by tensor-parallel rank 1 of 2"},
      {T("m.experts.0.w", 4, 1), nullptr, "'m.experts.0.w' is not held"},
      {T("m.experts.9.w", 4, 1), nullptr, "expert 9 of 4 experts"},
  };
  for (const Case &c : cases) {
    ASSERT_EQ(0, Start());
    std::vector<Wtx__V1__TensorPart *> one = {c.part};
    EXPECT_NE(0, Update({c.t}, false, nullptr, &one)) << c.says;
    EXPECT_EQ(GRPC_STATUS_INVALID_ARGUMENT, st_.code) << c.says;
    EXPECT_NE(std::string::npos, std::string(st_.message).find(c.says)) << st_.message;
    Abort();
    std::vector<std::pair<std::string, std::vector<uint8_t>>> after;
    EXPECT_EQ("v2", Published(&after));
    EXPECT_EQ(v1_, after);
  }
}

TEST_F(SessionTest, AWorkerWithoutShardRulesRefusesParts) {
  PublishV1();
  Part half(16, 0);
  std::vector<Wtx__V1__TensorPart *> p = {&half.msg};
  ASSERT_EQ(0, Start());
  EXPECT_NE(0, Update({T("a", 8, 1)}, false, nullptr, &p));
  EXPECT_EQ(GRPC_STATUS_INVALID_ARGUMENT, st_.code);
  EXPECT_NE(std::string::npos, std::string(st_.message).find("holds whole tensors")) << st_.message;
  Abort();
  ExpectV1Intact();
}

TEST_F(SessionTest, ShardRulesAreCheckedWhenTheWorkerStarts) {
  struct Case {
    const char *rules;
    uint32_t rank, size;
    const char *model_spec;
    const char *says;
  } cases[] = {
      {"*.experts.* expert\n", 0, 2, nullptr, "needs the model's expert count"},
      {"w dim 0\n", 2, 2, nullptr, "tp_rank 2 is not below tp_size 2"},
      {"w dims 0\n", 0, 2, nullptr, "shard rules line 1"},
      {"w dim 0\n", 0, 2, "/nonexistent.safetensors", "not with a model spec"},
  };
  for (const Case &c : cases) {
    wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
    o.listen = "127.0.0.1:0";
    o.shard_rules = c.rules;
    o.tp_rank = c.rank;
    o.tp_size = c.size;
    o.model_spec = c.model_spec;
    wtx_worker *w = nullptr;
    char err[512] = "";
    EXPECT_EQ(WTX_EINVAL, wtx_worker_start(&o, &w, err, sizeof err)) << c.rules;
    EXPECT_NE(nullptr, strstr(err, c.says)) << err;
    EXPECT_EQ(nullptr, w);
  }
}

TEST_F(SessionTest, NamesAndVersionsMustBeUtf8) {
  PublishV1();
  ASSERT_EQ(0, Start());
  EXPECT_EQ(WTX_EINVAL, Update({T("bad\xff", 16, 1)}));
  EXPECT_NE(nullptr, strstr(st_.message, "update_info.params[0].name: not valid UTF-8"))
      << st_.message;
  ExpectV1Intact();
  ASSERT_EQ(0, Start());
  ASSERT_EQ(0, Update({T("a", 16, 5)}));
  EXPECT_EQ(WTX_EINVAL, Finish("v\xc3"));  // a cut two-byte character
  EXPECT_NE(nullptr, strstr(st_.message, "weight_version: not valid UTF-8")) << st_.message;
  ASSERT_EQ(0, Finish("v2-\xc3\xa9t\xc3\xa9")) << st_.message;  // "v2-été"
}

TEST_F(SessionTest, TheParameterListingComesInPages) {
  PublishV1();  // a, b
  Wtx__V1__GetWeightInfoRequest req = WTX__V1__GET_WEIGHT_INFO_REQUEST__INIT;
  req.include_params = 1;
  req.params_limit = 1;
  std::vector<std::string> names;
  for (int page = 0; page < 3; page++) {
    Wtx__V1__GetWeightInfoResponse *info = nullptr;
    ASSERT_EQ(0, wtx__v1__weight_transfer__get_weight_info__call(ch_, &req, &info, nullptr, &st_));
    ASSERT_EQ(1u, info->n_params);
    names.push_back(info->params[0]->meta->name);
    req.params_offset = info->next_params_offset;
    protobuf_c_message_free_unpacked(&info->base, nullptr);
    if (req.params_offset == 0) break;
  }
  EXPECT_EQ((std::vector<std::string>{"a", "b"}), names);
  req.params_offset = 3;  // past the end
  Wtx__V1__GetWeightInfoResponse *info = nullptr;
  EXPECT_EQ(WTX_ERANGE, wtx__v1__weight_transfer__get_weight_info__call(ch_, &req, &info,
                                                                        nullptr, &st_));
  EXPECT_NE(nullptr, strstr(st_.message, "params_offset: 3, the model has 2 parameters"));
}

TEST_F(SessionTest, AnAbortCancelsABlockedReceiveAtOnce) {
  ASSERT_NO_FATAL_FAILURE(InitOnSlowDouble());
  ASSERT_EQ(0, Start()) << st_.message;
  wtx__rpc_pending *p = StartSlowUpdate();
  // The operator's abort: answered at once (nothing waits on the session
  // lock) and the receive it cancels returns without being released.
  auto t0 = std::chrono::steady_clock::now();
  Wtx__V1__AbortWeightUpdateRequest req = WTX__V1__ABORT_WEIGHT_UPDATE_REQUEST__INIT;
  Wtx__V1__AbortWeightUpdateResponse *resp = nullptr;
  ASSERT_EQ(0, wtx__v1__weight_transfer__abort_weight_update__call(ch_, &req, &resp, nullptr,
                                                                    &st_));
  EXPECT_TRUE(resp->aborted);
  protobuf_c_message_free_unpacked(&resp->base, nullptr);
  Wtx__V1__UpdateWeightsResponse *uresp = nullptr;
  EXPECT_EQ(WTX_ECANCELED, wtx__v1__weight_transfer__update_weights__wait(p, &uresp, &st_));
  EXPECT_NE(nullptr, strstr(st_.message, "slow: cancelled")) << st_.message;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  Wtx__V1__GetWeightInfoResponse *info = nullptr;
  ASSERT_EQ(0, Info(&info)) << st_.message;
  EXPECT_EQ(WTX__V1__SESSION_STATE__SESSION_STATE_READY, info->state);  // aborted, ready
  EXPECT_EQ(0u, info->num_params);
  protobuf_c_message_free_unpacked(&info->base, nullptr);
}

// The tcp backend's upstream, played by the test: a listening socket the
// worker connects to, the hello it reads, and chunks it writes by hand.
class FakeUpstream {
 public:
  FakeUpstream() {
    lfd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(0, bind(lfd_, reinterpret_cast<sockaddr *>(&a), sizeof a));
    EXPECT_EQ(0, listen(lfd_, 4));
    socklen_t len = sizeof a;
    getsockname(lfd_, reinterpret_cast<sockaddr *>(&a), &len);
    addr_ = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  }
  ~FakeUpstream() {
    if (fd_ >= 0) close(fd_);
    close(lfd_);
  }
  // Accepts the worker and checks its hello carries the token.
  void Accept() {
    fd_ = accept(lfd_, nullptr, nullptr);
    ASSERT_GE(fd_, 0);
    uint8_t h[WTX__TCP_HELLO_BYTES];
    ASSERT_EQ(static_cast<ssize_t>(sizeof h), recv(fd_, h, sizeof h, MSG_WAITALL));
    ASSERT_EQ(0, wtx__tcp_hello_check(h, token_, sizeof token_));
  }
  void Header(uint64_t seq, uint64_t bytes) {
    uint8_t f[WTX__TCP_FRAME_BYTES];
    wtx__tcp_frame fr = {seq, 0, bytes};
    wtx__tcp_frame_encode(f, &fr);
    ASSERT_EQ(static_cast<ssize_t>(sizeof f), send(fd_, f, sizeof f, MSG_NOSIGNAL));
  }
  void Send(const void *p, size_t n) { send(fd_, p, n, MSG_NOSIGNAL); }
  // The checksum trailer of chunk seq.
  std::vector<uint8_t> Trailer(uint64_t seq, const std::vector<uint64_t> &sums) {
    std::vector<uint8_t> t(WTX__TCP_TRAILER_HEAD_BYTES + 8 * sums.size());
    wtx__tcp_trailer_encode(t.data(), seq, static_cast<uint32_t>(sums.size()));
    wtx__tcp_trailer_put_sums(t.data() + WTX__TCP_TRAILER_HEAD_BYTES, sums.data(), sums.size());
    Send(t.data(), t.size());
    return t;
  }
  // The init info: this upstream, its token, a relay or not.
  Wtx__V1__TcpInitInfo Info(bool relay) {
    Wtx__V1__TcpInitInfo ti = WTX__V1__TCP_INIT_INFO__INIT;
    ti.upstream_address = const_cast<char *>(addr_.c_str());
    ti.relay = relay;
    ti.data_token.data = const_cast<uint8_t *>(token_);
    ti.data_token.len = sizeof token_;
    return ti;
  }
  const uint8_t token_[16] = {9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 1, 2, 3, 4, 5, 6};
  std::string addr_;
  int lfd_ = -1, fd_ = -1;
};

// Init over tcp with ti and the given timeout; the data address answered.
std::string InitTcp(wtx__rpc_channel *ch, Wtx__V1__TcpInitInfo *ti, uint32_t timeout_ms,
                    std::string *session, wtx__rpc_status *st,
                    Wtx__V1__ChecksumAlgorithm checksum =
                        WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE) {
  Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
  ii.backend_case = WTX__V1__INIT_INFO__BACKEND_TCP;
  ii.tcp = ti;
  ii.timeout_ms = timeout_ms;
  ii.checksum = checksum;
  Wtx__V1__InitWeightTransferEngineRequest req = WTX__V1__INIT_WEIGHT_TRANSFER_ENGINE_REQUEST__INIT;
  req.init_info = &ii;
  Wtx__V1__InitWeightTransferEngineResponse *resp = nullptr;
  EXPECT_EQ(0, wtx__v1__weight_transfer__init_weight_transfer_engine__call(ch, &req, &resp,
                                                                           nullptr, st))
      << st->message;
  if (resp == nullptr) return "";
  *session = resp->session_id;
  std::string addr = resp->data_address;
  protobuf_c_message_free_unpacked(&resp->base, nullptr);
  return addr;
}

// UpdateWeights of one UINT8 tensor of n bytes over tcp, started; with
// its checksum in UpdateInfo when xxh3 is given.
wtx__rpc_pending *StartTcpUpdate(wtx__rpc_channel *ch, const std::string &session,
                                uint64_t update, uint64_t n, uint64_t *xxh3 = nullptr) {
  static uint64_t shape;
  shape = n;
  static Wtx__V1__ParamMeta pm;
  static Wtx__V1__ParamMeta *pmp = &pm;
  wtx__v1__param_meta__init(&pm);
  pm.name = const_cast<char *>("w");
  pm.dtype = WTX__V1__DTYPE__DTYPE_UINT8;
  pm.shape = &shape;
  pm.n_shape = 1;
  static Wtx__V1__TcpUpdateInfo tu = WTX__V1__TCP_UPDATE_INFO__INIT;
  Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
  ui.params = &pmp;
  ui.n_params = 1;
  ui.backend_case = WTX__V1__UPDATE_INFO__BACKEND_TCP;
  ui.tcp = &tu;
  ui.xxh3_64 = xxh3;
  ui.n_xxh3_64 = xxh3 != nullptr;
  return StartUpdateCall(ch, session, update, &ui);
}

TEST_F(SessionTest, ATricklingUpstreamFailsWithinOneChunkTimeout) {
  FakeUpstream up;
  Wtx__V1__TcpInitInfo ti = up.Info(false);
  InitTcp(ch_, &ti, 1000, &session_, &st_);
  up.Accept();
  ASSERT_EQ(0, Start()) << st_.message;
  auto t0 = std::chrono::steady_clock::now();
  wtx__rpc_pending *p = StartTcpUpdate(ch_, session_, update_, 64);
  up.Header(0, 64);
  // One byte every 200 ms: every gap is short, the chunk is not.
  for (int i = 0; i < 10; i++) {
    uint8_t b = 1;
    up.Send(&b, 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  Wtx__V1__UpdateWeightsResponse *resp = nullptr;
  EXPECT_EQ(WTX_ETIMEDOUT, wtx__v1__weight_transfer__update_weights__wait(p, &resp, &st_));
  EXPECT_NE(nullptr, strstr(st_.message, "not all data within the timeout")) << st_.message;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
}

TEST_F(SessionTest, ASilentPeerOnTheRelayPortIsDroppedAndTheChainGoesOn) {
  FakeUpstream up;
  Wtx__V1__TcpInitInfo ti = up.Info(true);
  std::string relay = InitTcp(ch_, &ti, 10000, &session_, &st_);
  ASSERT_FALSE(relay.empty());
  up.Accept();
  ASSERT_EQ(0, Start()) << st_.message;
  auto connect_to = [&](bool hello) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(std::stoi(relay.substr(relay.rfind(':') + 1))));
    EXPECT_EQ(0, connect(fd, reinterpret_cast<sockaddr *>(&a), sizeof a));
    if (hello) {
      uint8_t h[WTX__TCP_HELLO_BYTES];
      wtx__tcp_hello_encode(h, up.token_, sizeof up.token_);
      send(fd, h, sizeof h, MSG_NOSIGNAL);
    }
    return fd;
  };
  int squatter = connect_to(false);  // connects first and says nothing
  int down = connect_to(true);
  wtx__rpc_pending *p = StartTcpUpdate(ch_, session_, update_, 64);
  up.Header(0, 64);
  std::vector<uint8_t> bytes(64, 7);
  up.Send(bytes.data(), bytes.size());
  Wtx__V1__UpdateWeightsResponse *resp = nullptr;
  ASSERT_EQ(0, wtx__v1__weight_transfer__update_weights__wait(p, &resp, &st_)) << st_.message;
  protobuf_c_message_free_unpacked(&resp->base, nullptr);
  uint8_t got[WTX__TCP_FRAME_BYTES + 64];
  ASSERT_EQ(static_cast<ssize_t>(sizeof got), recv(down, got, sizeof got, MSG_WAITALL));
  EXPECT_EQ(0, memcmp(got + WTX__TCP_FRAME_BYTES, bytes.data(), 64));  // relayed
  // And the squatter was not only passed over but closed (after the 2 s a
  // peer has for its hello): its end reads EOF.
  pollfd pf = {squatter, POLLIN, 0};
  ASSERT_EQ(1, poll(&pf, 1, 10000)) << "the silent peer's connection is still open";
  char b;
  EXPECT_EQ(0, recv(squatter, &b, 1, 0));
  close(squatter);
  close(down);
}

// With checksum_trailer the checksums come after the bytes on the stream:
// a right one publishes (and a relay forwards it as it came), a wrong one
// is DATA_LOSS naming the tensor, and checksums in UpdateInfo as well are
// refused by field.
TEST_F(SessionTest, ChecksumsAfterTheBytesAreCheckedAndRelayed) {
  std::vector<uint8_t> bytes(64);
  for (size_t i = 0; i < bytes.size(); i++) bytes[i] = static_cast<uint8_t>(i * 3);
  const uint64_t sum = XXH3_64bits(bytes.data(), bytes.size());
  const auto xxh3 = WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64;
  for (int c = 0; c < 3; c++) {
    SCOPED_TRACE(c);
    FakeUpstream up;
    Wtx__V1__TcpInitInfo ti = up.Info(c == 0);
    ti.checksum_trailer = true;
    std::string relay = InitTcp(ch_, &ti, 5000, &session_, &st_, xxh3);
    up.Accept();
    ASSERT_EQ(0, Start()) << st_.message;
    int down = -1;
    if (c == 0) {  // a downstream worker on the relay
      down = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<uint16_t>(std::stoi(relay.substr(relay.rfind(':') + 1))));
      ASSERT_EQ(0, connect(down, reinterpret_cast<sockaddr *>(&a), sizeof a));
      uint8_t h[WTX__TCP_HELLO_BYTES];
      wtx__tcp_hello_encode(h, up.token_, sizeof up.token_);
      send(down, h, sizeof h, MSG_NOSIGNAL);
    }
    uint64_t in_info = sum;
    wtx__rpc_pending *p = StartTcpUpdate(ch_, session_, update_, 64, c == 2 ? &in_info : nullptr);
    up.Header(0, 64);
    up.Send(bytes.data(), bytes.size());
    std::vector<uint8_t> trailer = up.Trailer(0, {c == 1 ? sum ^ 1 : sum});
    Wtx__V1__UpdateWeightsResponse *resp = nullptr;
    int rc = wtx__v1__weight_transfer__update_weights__wait(p, &resp, &st_);
    if (resp != nullptr) protobuf_c_message_free_unpacked(&resp->base, nullptr);
    if (c == 0) {
      ASSERT_EQ(0, rc) << st_.message;
      ASSERT_EQ(0, Finish("trailer")) << st_.message;
      std::vector<std::pair<std::string, std::vector<uint8_t>>> now;
      EXPECT_EQ("trailer", Published(&now));
      ASSERT_EQ(1u, now.size());
      EXPECT_EQ(bytes, now[0].second);
      std::vector<uint8_t> got(WTX__TCP_FRAME_BYTES + 64 + trailer.size());
      ASSERT_EQ(static_cast<ssize_t>(got.size()), recv(down, got.data(), got.size(), MSG_WAITALL));
      EXPECT_EQ(0, memcmp(got.data() + WTX__TCP_FRAME_BYTES + 64, trailer.data(), trailer.size()));
      close(down);
    } else if (c == 1) {
      EXPECT_EQ(WTX_ECHECKSUM, rc);
      EXPECT_EQ(GRPC_STATUS_DATA_LOSS, st_.code);
      EXPECT_NE(nullptr, strstr(st_.message, "checksum mismatch for 'w'")) << st_.message;
    } else {
      EXPECT_EQ(WTX_EINVAL, rc);
      EXPECT_EQ(GRPC_STATUS_INVALID_ARGUMENT, st_.code);
      EXPECT_NE(nullptr, strstr(st_.message, "update_info.xxh3_64: must be empty")) << st_.message;
    }
  }
}

TEST_F(SessionTest, APreparedUpdateTakesOnlyFinishOrAbortAndFinishMayBeRepeated) {
  PublishV1();
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("a", 16, 9)})) << st_.message;
  Wtx__V1__PrepareWeightUpdateResponse *presp = nullptr;
  ASSERT_EQ(0, Prepare("v2", &presp)) << st_.message;
  EXPECT_STREQ("v2", presp->weight_version);
  EXPECT_EQ(1u, presp->num_params);
  protobuf_c_message_free_unpacked(&presp->base, nullptr);
  Wtx__V1__GetWeightInfoResponse *info = nullptr;
  ASSERT_EQ(0, Info(&info));
  EXPECT_EQ(WTX__V1__SESSION_STATE__SESSION_STATE_PREPARED, info->state);
  EXPECT_STREQ("v1", info->weight_version);  // nothing published yet
  protobuf_c_message_free_unpacked(&info->base, nullptr);
  // No more chunks; no other label.
  EXPECT_EQ(WTX_ESTATE, Update({T("b", 8, 9)}));
  EXPECT_NE(nullptr, strstr(st_.message, "is prepared; finish or abort it")) << st_.message;
  EXPECT_EQ(WTX_EINVAL, Finish("other"));
  ASSERT_EQ(0, Finish("")) << st_.message;  // the prepared label
  std::vector<std::pair<std::string, std::vector<uint8_t>>> now;
  EXPECT_EQ("v2", Published(&now));
  // A Finish whose answer was lost, asked again: the same answer.
  ASSERT_EQ(0, Finish("")) << st_.message;
  EXPECT_EQ("v2", Published(&now));
}

TEST_F(SessionTest, AbortingAPreparedUpdateKeepsThePublishedWeights) {
  PublishV1();
  ASSERT_EQ(0, Start()) << st_.message;
  ASSERT_EQ(0, Update({T("a", 16, 9)})) << st_.message;
  ASSERT_EQ(0, Prepare("")) << st_.message;
  ASSERT_EQ(0, Abort()) << st_.message;
  ExpectV1Intact();
  ASSERT_EQ(0, Start()) << st_.message;  // and the next update goes
}

TEST_F(SessionTest, AWorkerConnectsOnlyWhereAllowUpstreamSays) {
  FakeUpstream up;  // on 127.0.0.1
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.allow_upstream = "10.0.0.0/8";
  Restart(o);
  Wtx__V1__TcpInitInfo ti = up.Info(false);
  Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
  ii.backend_case = WTX__V1__INIT_INFO__BACKEND_TCP;
  ii.tcp = &ti;
  Wtx__V1__InitWeightTransferEngineRequest req = WTX__V1__INIT_WEIGHT_TRANSFER_ENGINE_REQUEST__INIT;
  req.init_info = &ii;
  Wtx__V1__InitWeightTransferEngineResponse *resp = nullptr;
  EXPECT_EQ(WTX_EPERM, wtx__v1__weight_transfer__init_weight_transfer_engine__call(
                           ch_, &req, &resp, nullptr, &st_));
  EXPECT_EQ(GRPC_STATUS_PERMISSION_DENIED, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "is outside this worker's --allow-upstream"))
      << st_.message;
  o.allow_upstream = "127.0.0.0/8";
  Restart(o);
  std::string session;
  InitTcp(ch_, &ti, 5000, &session, &st_);
  EXPECT_FALSE(session.empty()) << st_.message;
}


// Pause and Resume answer whether generation is paused once they return,
// and a sidecar's answer is vLLM's: a trainer that sees paused=false after
// Pause knows vLLM is still generating. GetWeightInfo says the same.
TEST_F(SessionTest, PauseAndResumeSayWhetherVllmIsPausedNow) {
  wtxtest::VllmStandIn vllm;
  TempDir dir;
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  std::string url = vllm.url();
  o.vllm_url = url.c_str();
  o.vllm_dir = dir.path.c_str();
  o.vllm_timeout_ms = 5000;
  Restart(o);
  auto pause = [&](int wait) {
    Wtx__V1__PauseRequest req = WTX__V1__PAUSE_REQUEST__INIT;
    req.wait_for_inflight = wait;
    Wtx__V1__PauseResponse *resp = nullptr;
    EXPECT_EQ(0, wtx__v1__weight_transfer__pause__call(ch_, &req, &resp, nullptr, &st_))
        << st_.message;
    int paused = resp != nullptr ? resp->paused : -1;
    if (resp != nullptr) protobuf_c_message_free_unpacked(&resp->base, nullptr);
    return paused;
  };
  auto resume = [&] {
    Wtx__V1__ResumeRequest req = WTX__V1__RESUME_REQUEST__INIT;
    Wtx__V1__ResumeResponse *resp = nullptr;
    EXPECT_EQ(0, wtx__v1__weight_transfer__resume__call(ch_, &req, &resp, nullptr, &st_))
        << st_.message;
    int paused = resp != nullptr ? resp->paused : -1;
    if (resp != nullptr) protobuf_c_message_free_unpacked(&resp->base, nullptr);
    return paused;
  };
  auto info_paused = [&] {
    Wtx__V1__GetWeightInfoResponse *info = nullptr;
    EXPECT_EQ(0, Info(&info)) << st_.message;
    int paused = info != nullptr ? info->paused : -1;
    if (info != nullptr) protobuf_c_message_free_unpacked(&info->base, nullptr);
    return paused;
  };

  // vLLM refuses to pause and says it is not paused: generation goes on.
  vllm.Answer("/pause", 500, "{\"error\": \"Failed to pause generation\"}");
  vllm.Answer("/is_paused", 200, "{\"is_paused\": false}");
  EXPECT_EQ(0, pause(1));
  EXPECT_EQ(0, info_paused());
  EXPECT_FALSE(wtx_worker_paused(w_));

  vllm.Answer("/pause", 200, "{\"status\": \"paused\"}");
  EXPECT_EQ(1, pause(0));
  EXPECT_EQ(1, info_paused());
  EXPECT_TRUE(wtx_worker_paused(w_));

  // vLLM refuses to resume and says it is still paused.
  vllm.Answer("/resume", 500, "{\"error\": \"Failed to resume generation\"}");
  vllm.Answer("/is_paused", 200, "{\"is_paused\": true}");
  EXPECT_EQ(1, resume());
  EXPECT_EQ(1, info_paused());

  vllm.Answer("/resume", 200, "{\"status\": \"resumed\"}");
  EXPECT_EQ(0, resume());
  EXPECT_EQ(0, info_paused());
  EXPECT_FALSE(wtx_worker_paused(w_));
  EXPECT_EQ((std::vector<std::string>{"POST /pause?mode=wait", "GET /is_paused",
                                      "POST /pause?mode=abort", "POST /resume",
                                      "GET /is_paused", "POST /resume"}),
            vllm.Requests());

  // vLLM down: nothing says otherwise, so the state stays what it was.
  EXPECT_EQ(1, pause(1));
  vllm.Stop();
  EXPECT_EQ(1, resume());
  EXPECT_TRUE(wtx_worker_paused(w_));
  Stop();
}
