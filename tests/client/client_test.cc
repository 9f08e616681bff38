// The sync client's call rules against a scripted WeightTransfer server:
// retries only for idempotent calls, the bearer token on every call, TLS
// with a CA the client trusts, and failures that name the replica.
#include <grpc/grpc_security.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "client/fanout.h"
#include "wtx/client.h"
#include "wtx/v1/weight_transfer.grpc-c.h"

namespace {

struct Script {
  std::atomic<int> world_calls{0}, start_calls{0};
  int fail_first = 0;  // calls answered UNAVAILABLE before succeeding
  std::string token;   // required bearer token ("" accepts any)
};

grpc_status_code World(wtx__rpc_ctx *ctx, const Wtx__V1__GetWorldSizeRequest *,
                       Wtx__V1__GetWorldSizeResponse *resp) {
  auto *s = static_cast<Script *>(wtx__rpc_ctx_user(ctx));
  if (++s->world_calls <= s->fail_first)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_UNAVAILABLE, "warming up");
  resp->world_size = 1;
  return GRPC_STATUS_OK;
}

grpc_status_code Start(wtx__rpc_ctx *ctx, const Wtx__V1__StartWeightUpdateRequest *,
                       Wtx__V1__StartWeightUpdateResponse *) {
  auto *s = static_cast<Script *>(wtx__rpc_ctx_user(ctx));
  s->start_calls++;
  return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_UNAVAILABLE, "busy");
}

grpc_status_code Authorize(void *data, wtx__rpc_ctx *ctx) {
  auto *s = static_cast<Script *>(data);
  const char *auth = wtx__rpc_ctx_metadata(ctx, "authorization");
  if (!s->token.empty() && (auth == nullptr || "Bearer " + s->token != auth))
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_UNAUTHENTICATED, "bad or missing token");
  return GRPC_STATUS_OK;
}

Wtx__V1__WeightTransfer_Handlers Handlers() {
  Wtx__V1__WeightTransfer_Handlers h;
  memset(&h, 0, sizeof h);
  h.get_world_size = World;
  h.start_weight_update = Start;
  return h;
}
const Wtx__V1__WeightTransfer_Handlers kHandlers = Handlers();

// A WeightTransfer server of handlers h (their user data `user`) on a port
// of loopback (*port).
void StartServer(const wtx__rpc_server_options &o, const Wtx__V1__WeightTransfer_Handlers *h,
                 void *user, wtx__rpc_server **srv, int *port) {
  ASSERT_EQ(0, wtx__rpc_server_create(&o, srv));
  ASSERT_EQ(0, wtx__rpc_server_add_service(*srv, &wtx__v1__weight_transfer__grpc, h, user));
  ASSERT_EQ(0, wtx__rpc_server_start(*srv, "127.0.0.1:0", port));
}

class ClientTest : public ::testing::Test {
 protected:
  void Serve(grpc_server_credentials *creds = nullptr) {
    wtx__rpc_server_options o = WTX__RPC_SERVER_OPTIONS_INIT;
    o.credentials = creds;
    o.authorize = Authorize;
    o.auth_data = &script_;
    StartServer(o, &kHandlers, &script_, &srv_, &port_);
  }
  void TearDown() override {
    if (c_ != nullptr) wtx_client_destroy(c_);
    if (srv_ != nullptr) wtx__rpc_server_destroy(srv_);
  }
  void Connect(wtx_client_options o, const std::string &host = "127.0.0.1") {
    std::string t = host + ":" + std::to_string(port_);
    const char *targets[] = {t.c_str()};
    char err[600] = "";
    ASSERT_EQ(0, wtx_client_create(targets, 1, &o, &c_, err, sizeof err)) << err;
  }
  Script script_;
  wtx__rpc_server *srv_ = nullptr;
  wtx_client *c_ = nullptr;
  int port_ = 0;
};

TEST_F(ClientTest, IdempotentCallsAreRetriedAndUpdateCallsAreNot) {
  script_.fail_first = 2;
  Serve();
  wtx_client_options o = WTX_CLIENT_OPTIONS_INIT;
  o.retries = 2;
  Connect(o);
  uint32_t ws = 0;
  EXPECT_EQ(0, wtx_client_world_size(c_, 0, &ws)) << wtx_client_last_error(c_);
  EXPECT_EQ(1u, ws);
  EXPECT_EQ(3, script_.world_calls.load());
  EXPECT_EQ(WTX_EUNAVAIL, wtx__client_start(c_, 0));
  EXPECT_EQ(1, script_.start_calls.load());  // never repeated
  EXPECT_NE(std::string::npos,
            std::string(wtx_client_last_error(c_)).find("worker 0 (127.0.0.1:"));
  EXPECT_EQ(0, wtx_client_last_replica(c_));
  EXPECT_EQ(GRPC_STATUS_UNAVAILABLE, wtx_client_last_status(c_));
  // A call the server does not implement: UNIMPLEMENTED, named.
  Wtx__V1__InitInfo ii = WTX__V1__INIT_INFO__INIT;
  EXPECT_EQ(WTX_ENOTSUP, wtx__client_init_one(c_, 0, &ii, nullptr));
  EXPECT_NE(std::string::npos, std::string(wtx_client_last_error(c_))
                                   .find("InitWeightTransferEngine: UNIMPLEMENTED"))
      << wtx_client_last_error(c_);
}

TEST_F(ClientTest, RetriesStopAtTheirLimit) {
  script_.fail_first = 10;
  Serve();
  wtx_client_options o = WTX_CLIENT_OPTIONS_INIT;
  o.retries = 1;
  Connect(o);
  uint32_t ws = 0;
  EXPECT_EQ(WTX_EUNAVAIL, wtx_client_world_size(c_, 0, &ws));
  EXPECT_EQ(2, script_.world_calls.load());
  EXPECT_NE(std::string::npos, std::string(wtx_client_last_error(c_)).find("warming up"));
}

TEST_F(ClientTest, TheBearerTokenGoesWithEveryCall) {
  script_.token = "s3cret";
  Serve();
  wtx_client_options o = WTX_CLIENT_OPTIONS_INIT;
  o.token = "s3cret";
  Connect(o);
  uint32_t ws = 0;
  EXPECT_EQ(0, wtx_client_world_size(c_, 0, &ws)) << wtx_client_last_error(c_);
  wtx_client_destroy(c_);
  c_ = nullptr;
  o.token = "wrong";
  Connect(o);
  EXPECT_EQ(WTX_EAUTH, wtx_client_world_size(c_, 0, &ws));
  EXPECT_EQ(GRPC_STATUS_UNAUTHENTICATED, wtx_client_last_status(c_));
}

std::string Slurp(const std::string &path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

TEST_F(ClientTest, TlsWithATrustedCaConnectsAndPlaintextDoesNot) {
  char tmpl[] = "/tmp/wtx-tls-XXXXXX";
  ASSERT_NE(nullptr, mkdtemp(tmpl));
  std::string dir = tmpl;
  std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
                    "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " +
                    dir + "/key.pem -out " + dir + "/cert.pem 2>/dev/null";
  ASSERT_EQ(0, std::system(cmd.c_str())) << "openssl is needed for this test";
  std::string cert = Slurp(dir + "/cert.pem"), key = Slurp(dir + "/key.pem");
  grpc_ssl_pem_key_cert_pair pair = {key.c_str(), cert.c_str()};
  grpc_server_credentials *creds =
      grpc_ssl_server_credentials_create(nullptr, &pair, 1, 0, nullptr);
  Serve(creds);
  grpc_server_credentials_release(creds);

  wtx_client_options o = WTX_CLIENT_OPTIONS_INIT;
  o.tls_ca_pem = cert.c_str();  // self-signed: its own CA
  Connect(o, "127.0.0.1");  // the certificate names the IP too
  uint32_t ws = 0;
  EXPECT_EQ(0, wtx_client_world_size(c_, 0, &ws)) << wtx_client_last_error(c_);
  EXPECT_EQ(1u, ws);
  wtx_client_destroy(c_);
  c_ = nullptr;

  wtx_client_options plain = WTX_CLIENT_OPTIONS_INIT;
  plain.timeout_ms = 2000;
  Connect(plain, "127.0.0.1");
  EXPECT_NE(0, wtx_client_world_size(c_, 0, &ws));
  EXPECT_EQ(0, std::system(("rm -rf " + dir).c_str()));
}

TEST(ClientCreateTest, MoreWorkersThanTheLimitIsAnErrorNotADrop) {
  std::vector<std::string> addrs(WTX_MAX_WORKERS + 1, "127.0.0.1:1");
  std::vector<const char *> t;
  for (auto &a : addrs) t.push_back(a.c_str());
  wtx_client *c = nullptr;
  char err[600] = "";
  EXPECT_EQ(WTX_EINVAL, wtx_client_create(t.data(), t.size(), nullptr, &c, err, sizeof err));
  EXPECT_EQ(nullptr, c);
  EXPECT_STREQ("workers: 257 given, must be 1..256", err);
  ASSERT_EQ(0, wtx_client_create(t.data(), WTX_MAX_WORKERS, nullptr, &c, err, sizeof err));
  EXPECT_EQ(size_t{WTX_MAX_WORKERS}, wtx_client_size(c));
  wtx_client_destroy(c);
}

TEST(ClientCreateTest, TlsOptionsThatCannotBuildCredentialsAreErrors) {
  const char *t[] = {"127.0.0.1:1"};
  wtx_client *c = nullptr;
  char err[600] = "";
  wtx_client_options o = WTX_CLIENT_OPTIONS_INIT;
  o.tls_cert_pem = "-----BEGIN CERTIFICATE-----";  // a certificate without its key
  o.tls_ca_pem = "-----BEGIN CERTIFICATE-----";
  EXPECT_EQ(WTX_EINVAL, wtx_client_create(t, 1, &o, &c, err, sizeof err));
  EXPECT_STREQ("tls: tls_cert_pem and tls_key_pem go together", err);
  o = WTX_CLIENT_OPTIONS_INIT;
  o.tls_key_pem = "key";  // client credentials without a CA: never plaintext
  EXPECT_EQ(WTX_EINVAL, wtx_client_create(t, 1, &o, &c, err, sizeof err));
  EXPECT_STREQ("tls: a client certificate needs tls_ca_pem too", err);
  EXPECT_EQ(nullptr, c);
}

// Three replicas, each its own server, for the fan-outs of one update.
// Every call of a kind waits (at most 5 s) until all three replicas have
// it: calls made one replica after the other never get past the first.
struct Together {
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, int> arrived;
  // Waits for `want` calls of kind; false when they do not all come.
  bool Wait(const std::string &kind, int want) {
    std::unique_lock<std::mutex> l(mu);
    arrived[kind]++;
    cv.notify_all();
    return cv.wait_for(l, std::chrono::seconds(5), [&] { return arrived[kind] >= want; });
  }
};

struct Replica {
  Together *together;
  std::atomic<int> starts{0}, prepares{0}, finishes{0};
  int fail_start = 0;   // Start answers UNAVAILABLE
  int fail_finish = 0;  // Finishes answered UNAVAILABLE before one succeeds
};

grpc_status_code Arrive(wtx__rpc_ctx *ctx, Replica *r, const char *kind) {
  if (!r->together->Wait(kind, 3))
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_ABORTED, "%s: the replicas were asked "
                              "one after the other", kind);
  return GRPC_STATUS_OK;
}

grpc_status_code TStart(wtx__rpc_ctx *ctx, const Wtx__V1__StartWeightUpdateRequest *,
                        Wtx__V1__StartWeightUpdateResponse *resp) {
  auto *r = static_cast<Replica *>(wtx__rpc_ctx_user(ctx));
  r->starts++;
  grpc_status_code code = Arrive(ctx, r, "start");
  if (code == GRPC_STATUS_OK && r->fail_start)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_UNAVAILABLE, "busy");
  resp->update_id = 7;
  return code;
}

grpc_status_code TPrepare(wtx__rpc_ctx *ctx, const Wtx__V1__PrepareWeightUpdateRequest *,
                          Wtx__V1__PrepareWeightUpdateResponse *) {
  auto *r = static_cast<Replica *>(wtx__rpc_ctx_user(ctx));
  r->prepares++;
  return Arrive(ctx, r, "prepare");
}

grpc_status_code TFinish(wtx__rpc_ctx *ctx, const Wtx__V1__FinishWeightUpdateRequest *req,
                         Wtx__V1__FinishWeightUpdateResponse *resp) {
  auto *r = static_cast<Replica *>(wtx__rpc_ctx_user(ctx));
  if (++r->finishes == 1) {  // a retried call comes after the others
    grpc_status_code code = Arrive(ctx, r, "finish");
    if (code != GRPC_STATUS_OK) return code;
  }
  if (r->finishes <= r->fail_finish)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_UNAVAILABLE, "answer lost");
  resp->weight_version = req->update_id == 7 ? (char *)"v7" : (char *)"wrong update";
  return GRPC_STATUS_OK;
}

Wtx__V1__WeightTransfer_Handlers PhaseHandlers() {
  Wtx__V1__WeightTransfer_Handlers h;
  memset(&h, 0, sizeof h);
  h.start_weight_update = TStart;
  h.prepare_weight_update = TPrepare;
  h.finish_weight_update = TFinish;
  return h;
}
const Wtx__V1__WeightTransfer_Handlers kPhaseHandlers = PhaseHandlers();

class FanoutTest : public ::testing::Test {
 protected:
  void Serve() {
    std::vector<std::string> t;
    for (int i = 0; i < 3; i++) {
      reps_[i].together = &together_;
      int port = 0;
      StartServer(WTX__RPC_SERVER_OPTIONS_INIT, &kPhaseHandlers, &reps_[i], &srv_[i], &port);
      ASSERT_FALSE(HasFatalFailure());
      t.push_back("127.0.0.1:" + std::to_string(port));
    }
    const char *targets[] = {t[0].c_str(), t[1].c_str(), t[2].c_str()};
    char err[600] = "";
    ASSERT_EQ(0, wtx_client_create(targets, 3, nullptr, &c_, err, sizeof err)) << err;
  }
  void TearDown() override {
    if (c_ != nullptr) wtx_client_destroy(c_);
    for (auto *s : srv_)
      if (s != nullptr) wtx__rpc_server_destroy(s);
  }
  Together together_;
  Replica reps_[3];
  wtx__rpc_server *srv_[3] = {};
  wtx_client *c_ = nullptr;
};

TEST_F(FanoutTest, EveryReplicaIsAskedAtOnceInEachPhase) {
  Serve();
  ASSERT_EQ(0, wtx__client_start(c_, 0)) << wtx_client_last_error(c_);
  char published[64] = "";
  ASSERT_EQ(0, wtx__client_finish(c_, nullptr, published, sizeof published))
      << wtx_client_last_error(c_);
  EXPECT_STREQ("v7", published);  // each replica's finish names the update its start gave
  for (auto &r : reps_) {
    EXPECT_EQ(1, r.starts.load());
    EXPECT_EQ(1, r.prepares.load());
    EXPECT_EQ(1, r.finishes.load());
  }
}

TEST_F(FanoutTest, AStartInFlightMeanwhileAndRetriesStayOnTheirReplica) {
  reps_[1].fail_finish = 1;  // its first answer is lost: asked again, alone
  reps_[2].fail_start = 1;
  Serve();
  wtx__client_start_begin(c_, 0, 3);  // returns with every call in flight
  EXPECT_EQ(WTX_EUNAVAIL, wtx__client_start_end(c_));
  EXPECT_EQ(2, wtx_client_last_replica(c_));  // start is never retried
  EXPECT_NE(std::string::npos, std::string(wtx_client_last_error(c_)).find("busy"));
  for (auto &r : reps_) EXPECT_EQ(1, r.starts.load());
  reps_[2].fail_start = 0;
  together_.arrived.clear();
  ASSERT_EQ(0, wtx__client_start(c_, 0)) << wtx_client_last_error(c_);
  ASSERT_EQ(0, wtx__client_finish(c_, "", nullptr, 0)) << wtx_client_last_error(c_);
  EXPECT_EQ(1, reps_[0].finishes.load());
  EXPECT_EQ(2, reps_[1].finishes.load());
  EXPECT_EQ(1, reps_[2].finishes.load());
}

}  // namespace
