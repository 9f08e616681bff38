// The worker's session state machine over real loopback gRPC and the shm
// backend: every refusal with its code and message, and the guarantee that a
// failed or aborted update leaves the published weights bit-exact.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "server/worker.h"
#include "transport/transport.h"
#include "wtx/v1/weight_transfer.grpc-c.h"

namespace {

struct Tensor {
  std::string name;
  std::vector<uint8_t> data;  // FLOAT32, shape {n/4}
};

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
    o.listen = "127.0.0.1:0";
    o.watchdog_ms = watchdog_ms_;
    char err[256] = "";
    ASSERT_EQ(0, wtx_worker_start(&o, &w_, err, sizeof err)) << err;
    std::string t = "127.0.0.1:" + std::to_string(wtx_worker_port(w_));
    ASSERT_EQ(0, wtx_rpc_channel_create(t.c_str(), nullptr, &ch_));
    region_ = "/wtx-test-" + std::to_string(getpid());
  }
  void TearDown() override {
    if (ch_ != nullptr) wtx_rpc_channel_destroy(ch_);
    wtx_worker_destroy(w_);
    shm_unlink(region_.c_str());
  }

  int Init(const char *backend = "shm", uint32_t checksum = 0) {
    Wtx__V1__PackingParams pk = WTX__V1__PACKING_PARAMS__INIT;
    Wtx__V1__ShmInitInfo shm = WTX__V1__SHM_INIT_INFO__INIT;
    shm.packing = &pk;
    shm.checksum = (Wtx__V1__ChecksumAlgorithm)checksum;
    Wtx__V1__TcpInitInfo tcp = WTX__V1__TCP_INIT_INFO__INIT;
    Wtx__V1__NcclInitInfo nccl = WTX__V1__NCCL_INIT_INFO__INIT;
    Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
    if (std::string(backend) == "shm") {
      ii.backend_case = WTX__V1__INIT_INFO__BACKEND_SHM;
      ii.shm = &shm;
    } else if (std::string(backend) == "tcp") {
      ii.backend_case = WTX__V1__INIT_INFO__BACKEND_TCP;
      ii.tcp = &tcp;
    } else if (std::string(backend) == "nccl") {
      ii.backend_case = WTX__V1__INIT_INFO__BACKEND_NCCL;
      ii.nccl = &nccl;
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

  int Start(Wtx__V1__UpdateTarget target = WTX__V1__UPDATE_TARGET__UPDATE_TARGET_MAIN) {
    Wtx__V1__StartWeightUpdateRequest req = WTX__V1__START_WEIGHT_UPDATE_REQUEST__INIT;
    req.session_id = const_cast<char *>(session_.c_str());
    req.target = target;
    Wtx__V1__StartWeightUpdateResponse *resp = nullptr;
    int rc = wtx__v1__weight_transfer__start_weight_update__call(ch_, &req, &resp,
                                                                  nullptr, &st_);
    if (rc == 0) {
      update_ = resp->update_id;
      protobuf_c_message_free_unpacked(&resp->base, nullptr);
    }
    return rc;
  }

  // One chunk holding whole tensors; corrupt flips a byte after hashing.
  int Update(const std::vector<Tensor> &ts, bool corrupt = false) {
    size_t total = 0;
    for (auto &t : ts) total += t.data.size();
    int fd = shm_open(region_.c_str(), O_RDWR | O_CREAT, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(0, ftruncate(fd, (off_t)(total ? total : 1)));
    auto *buf = static_cast<uint8_t *>(
        mmap(nullptr, total ? total : 1, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0));
    std::vector<uint64_t> sums;
    std::vector<Wtx__V1__ParamMeta> pm(ts.size());
    std::vector<Wtx__V1__ParamMeta *> pmp(ts.size());
    std::vector<uint64_t> shapes(ts.size());
    size_t off = 0;
    for (size_t i = 0; i < ts.size(); i++) {
      memcpy(buf + off, ts[i].data.data(), ts[i].data.size());
      sums.push_back(XXH3_64bits(ts[i].data.data(), ts[i].data.size()));
      off += ts[i].data.size();
      wtx__v1__param_meta__init(&pm[i]);
      pm[i].name = const_cast<char *>(ts[i].name.c_str());
      pm[i].dtype = WTX__V1__DTYPE__DTYPE_FLOAT32;
      shapes[i] = ts[i].data.size() / 4;
      pm[i].shape = &shapes[i];
      pm[i].n_shape = 1;
      pmp[i] = &pm[i];
    }
    if (corrupt && total > 0) buf[total / 2] ^= 0x40;
    Wtx__V1__ShmUpdateInfo su = WTX__V1__SHM_UPDATE_INFO__INIT;
    su.region = const_cast<char *>(region_.c_str());
    su.length = total;
    su.xxh3_64 = sums.data();
    su.n_xxh3_64 = sums.size();
    Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
    ui.params = pmp.data();
    ui.n_params = pmp.size();
    ui.backend_case = WTX__V1__UPDATE_INFO__BACKEND_SHM;
    ui.shm = &su;
    Wtx__V1__UpdateWeightsRequest req = WTX__V1__UPDATE_WEIGHTS_REQUEST__INIT;
    req.session_id = const_cast<char *>(session_.c_str());
    req.update_id = update_;
    req.update_info = &ui;
    Wtx__V1__UpdateWeightsResponse *resp = nullptr;
    int rc = wtx__v1__weight_transfer__update_weights__call(ch_, &req, &resp,
                                                             nullptr, &st_);
    if (resp) protobuf_c_message_free_unpacked(&resp->base, nullptr);
    munmap(buf, total ? total : 1);
    close(fd);
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

  int64_t watchdog_ms_ = 0;
  wtx_worker *w_ = nullptr;
  wtx_rpc_channel *ch_ = nullptr;
  wtx_rpc_status st_;
  std::string session_, region_;
  uint64_t update_ = 0;
  std::vector<std::pair<std::string, std::vector<uint8_t>>> v1_;
  std::string v1_version_;
};

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

TEST_F(SessionTest, CallsBeforeInitAreFailedPrecondition) {
  EXPECT_EQ(WTX_ESTATE, Start());
  EXPECT_EQ(GRPC_STATUS_FAILED_PRECONDITION, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "InitWeightTransferEngine first"));
}

TEST_F(SessionTest, UnknownBackendListsTheRegisteredOnes) {
  EXPECT_EQ(WTX_EINVAL, Init("nccl"));
  EXPECT_EQ(GRPC_STATUS_INVALID_ARGUMENT, st_.code);
  EXPECT_NE(nullptr, strstr(st_.message, "'nccl' is not available"));
  EXPECT_NE(nullptr, strstr(st_.message, "registered: shm"));
  EXPECT_EQ(WTX_EINVAL, Init("none"));
  EXPECT_NE(nullptr, strstr(st_.message, "no backend set"));
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
  EXPECT_NE(nullptr, strstr(st_.message, "shape [15], the model holds [16]"));
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
  EXPECT_NE(nullptr, strstr(st_.message, "checksum mismatch"));
  ExpectV1Intact();
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

TEST_F(SessionTest, WatchdogAbortsAnIdleUpdate) {
  TearDown();
  watchdog_ms_ = 100;
  SetUp();
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

// A test double for a slow data plane, registered as "tcp" (not built in
// yet): receive blocks until released, then delivers zeros.
std::mutex g_mu;
std::condition_variable g_cv;
bool g_in_receive = false, g_release = false;

int SlowInit(const Wtx__V1__InitInfo *, const wtx_wire_params *, void **self,
             char *addr, size_t addrlen, char *, size_t) {
  *self = nullptr;
  if (addrlen > 0) addr[0] = '\0';
  return 0;
}

int SlowReceive(void *, const Wtx__V1__UpdateInfo *, wtx_rx *rx) {
  std::unique_lock<std::mutex> lk(g_mu);
  g_in_receive = true;
  g_cv.notify_all();
  g_cv.wait(lk, [] { return g_release; });
  std::vector<uint8_t> zeros(wtx_rx_remaining(rx));
  return wtx_rx_bytes(rx, zeros.data(), zeros.size());
}

void SlowDestroy(void *) {}

const wtx_worker_transport kSlowTcp = {
    .name = "tcp",
    .supports_draft = 0,
    .init = SlowInit,
    .receive = SlowReceive,
    .destroy = SlowDestroy,
};

// The store, counting aborts.
struct CountingModel {
  wtx_store *store;
  int aborts = 0;
};
int CmCheck(void *m, int t, const wtx_tensor_meta *meta, char *e, size_t n) {
  return wtx_store_model_ops.check(static_cast<CountingModel *>(m)->store, t, meta, e, n);
}
int CmBegin(void *m, int t) {
  return wtx_store_model_ops.begin(static_cast<CountingModel *>(m)->store, t);
}
int CmStage(void *m, const wtx_tensor_meta *meta, uint8_t **dst) {
  return wtx_store_model_ops.stage(static_cast<CountingModel *>(m)->store, meta, dst);
}
int CmLoaded(void *m, const wtx_tensor_meta *meta, uint64_t h) {
  return wtx_store_model_ops.loaded(static_cast<CountingModel *>(m)->store, meta, h);
}
int CmCommit(void *m, const char *v) {
  return wtx_store_model_ops.commit(static_cast<CountingModel *>(m)->store, v);
}
void CmAbort(void *m) {
  static_cast<CountingModel *>(m)->aborts++;
  wtx_store_model_ops.abort(static_cast<CountingModel *>(m)->store);
}
const wtx_model_ops kCounting = {CmCheck, CmBegin, CmStage, CmLoaded, CmCommit, CmAbort};

TEST_F(SessionTest, DrainDuringAReceiveAbortsTheUpdateOnceItReturns) {
  // Replace the fixture's worker by one over a counting model.
  wtx_rpc_channel_destroy(ch_);
  wtx_worker_destroy(w_);
  CountingModel cm;
  ASSERT_EQ(0, wtx_store_create(&cm.store));
  wtx_transports_register_builtin();
  int reg = wtx_worker_transport_register(&kSlowTcp);
  ASSERT_TRUE(reg == 0 || reg == WTX_EEXIST);
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.listen = "127.0.0.1:0";
  o.model_ops = &kCounting;
  o.model = &cm;
  char err[256] = "";
  ASSERT_EQ(0, wtx_worker_start(&o, &w_, err, sizeof err)) << err;
  std::string t = "127.0.0.1:" + std::to_string(wtx_worker_port(w_));
  ASSERT_EQ(0, wtx_rpc_channel_create(t.c_str(), nullptr, &ch_));

  ASSERT_EQ(0, Init("tcp")) << st_.message;
  ASSERT_EQ(0, Start()) << st_.message;
  Wtx__V1__ParamMeta pm = WTX__V1__PARAM_META__INIT;
  pm.name = const_cast<char *>("a");
  pm.dtype = WTX__V1__DTYPE__DTYPE_UINT8;
  uint64_t shape = 16;
  pm.shape = &shape;
  pm.n_shape = 1;
  Wtx__V1__ParamMeta *pmp = &pm;
  Wtx__V1__TcpUpdateInfo tu = WTX__V1__TCP_UPDATE_INFO__INIT;
  Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
  ui.params = &pmp;
  ui.n_params = 1;
  ui.backend_case = WTX__V1__UPDATE_INFO__BACKEND_TCP;
  ui.tcp = &tu;
  Wtx__V1__UpdateWeightsRequest req = WTX__V1__UPDATE_WEIGHTS_REQUEST__INIT;
  req.session_id = const_cast<char *>(session_.c_str());
  req.update_id = update_;
  req.update_info = &ui;
  wtx_rpc_pending *p = nullptr;
  ASSERT_EQ(0, wtx__v1__weight_transfer__update_weights__start(ch_, &req, nullptr, &p));
  {
    std::unique_lock<std::mutex> lk(g_mu);
    ASSERT_TRUE(g_cv.wait_for(lk, std::chrono::seconds(10), [] { return g_in_receive; }));
  }
  std::thread drainer([&] { wtx_worker_drain(w_, 10000); });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  {
    std::lock_guard<std::mutex> lk(g_mu);
    g_release = true;
    g_cv.notify_all();
  }
  Wtx__V1__UpdateWeightsResponse *resp = nullptr;
  EXPECT_NE(0, wtx__v1__weight_transfer__update_weights__wait(p, &resp, &st_));
  drainer.join();
  EXPECT_EQ(1, cm.aborts);  // the staged tensor was discarded exactly once
  wtx_store_view v;
  wtx_store_acquire(cm.store, WTX_TARGET_MAIN, &v);
  EXPECT_EQ(0u, v.n_params);  // nothing was published
  wtx_store_release(cm.store, &v);
  wtx_rpc_channel_destroy(ch_);
  ch_ = nullptr;
  wtx_worker_destroy(w_);
  w_ = nullptr;
  wtx_store_destroy(cm.store);
}

}  // namespace
