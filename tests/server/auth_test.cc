// Who may call a worker: the bearer token on every call but health (and
// open reflection), rotation by replacing the token file, TLS and mutual
// TLS, and the cap on concurrent calls.
#include "server/auth.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "grpc/health/v1/health.grpc-c.h"
#include "grpc/reflection/v1/reflection.grpc-c.h"
#include "wtx/client.h"

namespace {

TEST(AuthEqual, ComparesWholeStrings) {
  EXPECT_TRUE(wtx__auth_equal("s3cret", 6, "s3cret", 6));
  EXPECT_FALSE(wtx__auth_equal("s3cret", 6, "s3cres", 6));
  EXPECT_FALSE(wtx__auth_equal("s3cret", 6, "s3cre", 5));    // a prefix
  EXPECT_FALSE(wtx__auth_equal("s3cret", 6, "s3crets", 7));  // longer
  EXPECT_FALSE(wtx__auth_equal("s3cret", 6, "", 0));
  EXPECT_FALSE(wtx__auth_equal("", 0, "x", 1));
}

std::string Slurp(const std::string &path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/wtx-auth-XXXXXX";
    ASSERT_NE(nullptr, mkdtemp(tmpl));
    dir_ = tmpl;
    token_file_ = dir_ + "/token";
    Write(token_file_, "t0ken-one\n");
  }
  void TearDown() override {
    if (ch_ != nullptr) wtx__rpc_channel_destroy(ch_);
    wtx_worker_destroy(w_);
    EXPECT_EQ(0, std::system(("rm -rf " + dir_).c_str()));
  }
  static void Write(const std::string &path, const std::string &text) {
    std::string tmp = path + ".new";
    std::ofstream(tmp) << text;
    ASSERT_EQ(0, rename(tmp.c_str(), path.c_str()));  // as an operator rotates it
  }
  void Start(wtx_worker_options o) {
    o.listen = "127.0.0.1:0";
    char err[512] = "";
    ASSERT_EQ(0, wtx_worker_start(&o, &w_, err, sizeof err)) << err;
    addr_ = "127.0.0.1:" + std::to_string(wtx_worker_port(w_));
    ASSERT_EQ(0, wtx__rpc_channel_create(addr_.c_str(), nullptr, &ch_));
  }
  // GetWorldSize through the public client with token (may be NULL).
  int World(const char *token, wtx_client_options o = WTX_CLIENT_OPTIONS_INIT) {
    o.token = token;
    o.timeout_ms = 5000;
    const char *t[] = {addr_.c_str()};
    wtx_client *c = nullptr;
    char err[256];
    EXPECT_EQ(0, wtx_client_create(t, 1, &o, &c, err, sizeof err)) << err;
    uint32_t ws = 0;
    int rc = wtx_client_world_size(c, 0, &ws);
    status_ = wtx_client_last_status(c);
    message_ = wtx_client_last_error(c);
    wtx_client_destroy(c);
    return rc;
  }
  int Health() {
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    Grpc__Health__V1__HealthCheckResponse *resp = nullptr;
    wtx__rpc_status st;
    int rc = grpc__health__v1__health__check__call(ch_, &req, &resp, nullptr, &st);
    if (resp) protobuf_c_message_free_unpacked(&resp->base, nullptr);
    return rc;
  }
  // One reflection round trip (list services): 0, or the failure.
  int ListServices() {
    wtx__rpc_stream *s = nullptr;
    EXPECT_EQ(0, grpc__reflection__v1__server_reflection__server_reflection_info__open(
                     ch_, nullptr, &s));
    Grpc__Reflection__V1__ServerReflectionRequest req =
        GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__INIT;
    req.message_request_case =
        GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_LIST_SERVICES;
    req.list_services = const_cast<char *>("");
    grpc__reflection__v1__server_reflection__server_reflection_info__send(s, &req);
    Grpc__Reflection__V1__ServerReflectionResponse *m = nullptr;
    int got = grpc__reflection__v1__server_reflection__server_reflection_info__recv(s, &m);
    if (m) protobuf_c_message_free_unpacked(&m->base, nullptr);
    wtx__rpc_status st;
    int rc = wtx__rpc_stream_finish(s, &st);
    return got == 1 ? 0 : rc;
  }
  std::string dir_, token_file_, addr_, message_;
  int status_ = 0;
  wtx_worker *w_ = nullptr;
  wtx__rpc_channel *ch_ = nullptr;
};

TEST_F(AuthTest, EveryCallButHealthAndOpenReflectionNeedsTheToken) {
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.token_file = token_file_.c_str();
  Start(o);
  EXPECT_EQ(WTX_EAUTH, World(nullptr));
  EXPECT_EQ(GRPC_STATUS_UNAUTHENTICATED, status_);
  EXPECT_EQ(WTX_EAUTH, World("t0ken-on"));  // a prefix
  EXPECT_EQ(std::string::npos, message_.find("t0ken-on")) << "never echoes what was sent";
  EXPECT_EQ(0, World("t0ken-one")) << message_;
  EXPECT_EQ(0, Health());         // probes carry no credentials
  EXPECT_EQ(0, ListServices());   // reflection is open by default
}

TEST_F(AuthTest, ReplacingTheTokenFileRotatesTheToken) {
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.token_file = token_file_.c_str();
  Start(o);
  ASSERT_EQ(0, World("t0ken-one"));
  Write(token_file_, "t0ken-two\n");
  EXPECT_EQ(0, World("t0ken-two")) << message_;
  EXPECT_EQ(WTX_EAUTH, World("t0ken-one"));
  // A file that cannot be read keeps the last good token.
  ASSERT_EQ(0, unlink(token_file_.c_str()));
  EXPECT_EQ(0, World("t0ken-two")) << message_;
}

// A Kubernetes Secret volume: kubelet writes each version into a new
// timestamped directory, points a new "..data" symlink at it and renames
// that over the old one; the token file the worker is given is a symlink
// through ..data, so the path never changes, only what it resolves to.
TEST_F(AuthTest, AKubernetesSecretSwapRotatesTheToken) {
  std::string vol = dir_ + "/secret";
  ASSERT_EQ(0, mkdir(vol.c_str(), 0755));
  ASSERT_EQ(0, mkdir((vol + "/..2026_12_05_07_00_00.1").c_str(), 0755));
  Write(vol + "/..2026_12_05_07_00_00.1/token", "t0ken-one\n");
  ASSERT_EQ(0, symlink("..2026_12_05_07_00_00.1", (vol + "/..data").c_str()));
  ASSERT_EQ(0, symlink("..data/token", (vol + "/token").c_str()));
  std::string path = vol + "/token";
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.token_file = path.c_str();
  Start(o);
  ASSERT_EQ(0, World("t0ken-one")) << message_;

  // kubelet's swap; the token has the same length, as generated ones do.
  ASSERT_EQ(0, mkdir((vol + "/..2026_12_05_08_00_00.2").c_str(), 0755));
  Write(vol + "/..2026_12_05_08_00_00.2/token", "t0ken-two\n");
  ASSERT_EQ(0, symlink("..2026_12_05_08_00_00.2", (vol + "/..data_tmp").c_str()));
  ASSERT_EQ(0, rename((vol + "/..data_tmp").c_str(), (vol + "/..data").c_str()));
  ASSERT_EQ(0, std::system(("rm -rf " + vol + "/..2026_12_05_07_00_00.1").c_str()));
  EXPECT_EQ(0, World("t0ken-two")) << message_;
  EXPECT_EQ(WTX_EAUTH, World("t0ken-one"));
}

// An operator (or a tool) rewriting the file in place with a token of the
// same length: same inode, same size, and an mtime that need not move, as
// the filesystem's clock ticks coarsely (a jiffy; 1 s on ext3, 2 s on FAT).
// The test sets the old mtime back so the clock's tick cannot decide it.
TEST_F(AuthTest, AnInPlaceRewriteWithinTheClocksTickRotatesTheToken) {
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.token_file = token_file_.c_str();
  Start(o);
  ASSERT_EQ(0, World("t0ken-one")) << message_;
  struct stat before, after;
  ASSERT_EQ(0, stat(token_file_.c_str(), &before));
  {
    std::ofstream f(token_file_, std::ios::trunc);  // the same file, opened O_TRUNC
    f << "t0ken-two\n";
  }
  struct timespec times[2] = {before.st_atim, before.st_mtim};
  ASSERT_EQ(0, utimensat(AT_FDCWD, token_file_.c_str(), times, 0));
  ASSERT_EQ(0, stat(token_file_.c_str(), &after));
  ASSERT_EQ(before.st_ino, after.st_ino);
  ASSERT_EQ(before.st_size, after.st_size);
  ASSERT_EQ(before.st_mtim.tv_nsec, after.st_mtim.tv_nsec);
  EXPECT_EQ(0, World("t0ken-two")) << message_;
  EXPECT_EQ(WTX_EAUTH, World("t0ken-one"));
}

// Whatever the token file is replaced by, a worker that cannot read a token
// from it keeps admitting the last good one (and nothing else), and takes
// the next good file. Tests run as root, who can read any file: what root
// cannot read a token from is a directory, a dangling symlink, a missing
// file or an empty first line.
TEST_F(AuthTest, AnUnreadableReplacementKeepsTheLastGoodToken) {
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.token_file = token_file_.c_str();
  Start(o);
  ASSERT_EQ(0, World("t0ken-one")) << message_;
  std::string tmp = token_file_ + ".new";

  ASSERT_EQ(0, symlink("no-such-file", tmp.c_str()));  // a dangling symlink
  ASSERT_EQ(0, rename(tmp.c_str(), token_file_.c_str()));
  EXPECT_EQ(0, World("t0ken-one")) << "dangling symlink: " << message_;
  EXPECT_EQ(WTX_EAUTH, World("no-such-file"));

  ASSERT_EQ(0, unlink(token_file_.c_str()));  // a directory
  ASSERT_EQ(0, mkdir(token_file_.c_str(), 0755));
  EXPECT_EQ(0, World("t0ken-one")) << "directory: " << message_;
  ASSERT_EQ(0, rmdir(token_file_.c_str()));

  ASSERT_EQ(0, mkfifo(token_file_.c_str(), 0600));  // a FIFO nobody writes: no hang
  EXPECT_EQ(0, World("t0ken-one")) << "fifo: " << message_;
  ASSERT_EQ(0, unlink(token_file_.c_str()));

  Write(token_file_, "\nt0ken-two\n");  // the token is the first line
  EXPECT_EQ(0, World("t0ken-one")) << "empty first line: " << message_;
  EXPECT_EQ(WTX_EAUTH, World("t0ken-two"));

  Write(token_file_, "t0ken-3\n");  // and a good file is taken again
  EXPECT_EQ(0, World("t0ken-3")) << message_;
  EXPECT_EQ(WTX_EAUTH, World("t0ken-one"));
}

TEST_F(AuthTest, ReflectionCanBeClosedOrRequireTheToken) {
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.token_file = token_file_.c_str();
  o.reflection = WTX_REFLECTION_TOKEN;
  Start(o);
  EXPECT_EQ(WTX_EAUTH, ListServices());
  wtx__rpc_channel_destroy(ch_);
  ch_ = nullptr;
  wtx_worker_destroy(w_);
  w_ = nullptr;
  o.reflection = WTX_REFLECTION_OFF;
  Start(o);
  EXPECT_EQ(WTX_ENOTSUP, ListServices());  // UNIMPLEMENTED: not served
  EXPECT_EQ(0, Health());
}

TEST_F(AuthTest, AnUnreadableOrEmptyTokenFileIsRefusedAtStart) {
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.listen = "127.0.0.1:0";
  std::string missing = dir_ + "/missing";
  o.token_file = missing.c_str();
  char err[512] = "";
  EXPECT_EQ(WTX_EINVAL, wtx_worker_start(&o, &w_, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "token_file: cannot read")) << err;
  Write(token_file_, "\n");
  o.token_file = token_file_.c_str();
  EXPECT_EQ(WTX_EINVAL, wtx_worker_start(&o, &w_, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "first line must hold the token")) << err;
}

// openssl makes a CA, a server certificate for 127.0.0.1 and a client
// certificate, both signed by the CA.
class TlsTest : public AuthTest {
 protected:
  void SetUp() override {
    AuthTest::SetUp();
    std::string d = dir_;
    std::string cmd =
        "cd " + d + " && "
        "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=wtx-ca "
        "-keyout ca.key -out ca.pem && "
        "openssl req -newkey rsa:2048 -nodes -subj /CN=localhost -keyout srv.key -out srv.csr && "
        "printf 'subjectAltName=IP:127.0.0.1,DNS:localhost' > san.ext && "
        "openssl x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 "
        "-extfile san.ext -out srv.pem && "
        "openssl req -newkey rsa:2048 -nodes -subj /CN=trainer -keyout cli.key -out cli.csr && "
        "openssl x509 -req -in cli.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 1 "
        "-out cli.pem";
    ASSERT_EQ(0, std::system((cmd + " 2>/dev/null >/dev/null").c_str()))
        << "openssl is needed for this test";
    ca_ = Slurp(d + "/ca.pem");
    srv_cert_ = Slurp(d + "/srv.pem");
    srv_key_ = Slurp(d + "/srv.key");
    cli_cert_ = Slurp(d + "/cli.pem");
    cli_key_ = Slurp(d + "/cli.key");
  }
  std::string ca_, srv_cert_, srv_key_, cli_cert_, cli_key_;
};

TEST_F(TlsTest, TlsAdmitsClientsThatTrustTheCaAndMutualTlsOnlyThoseItSigned) {
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.tls_cert_pem = srv_cert_.c_str();
  o.tls_key_pem = srv_key_.c_str();
  Start(o);
  wtx_client_options tls = WTX_CLIENT_OPTIONS_INIT;
  tls.tls_ca_pem = ca_.c_str();
  EXPECT_EQ(0, World(nullptr, tls)) << message_;
  EXPECT_NE(0, World(nullptr));  // plaintext does not get in
  wtx__rpc_channel_destroy(ch_);
  ch_ = nullptr;
  wtx_worker_destroy(w_);
  w_ = nullptr;

  o.tls_client_ca_pem = ca_.c_str();
  o.token_file = token_file_.c_str();  // both gates at once
  Start(o);
  EXPECT_NE(0, World("t0ken-one", tls));  // no client certificate
  wtx_client_options mtls = tls;
  mtls.tls_cert_pem = cli_cert_.c_str();
  mtls.tls_key_pem = cli_key_.c_str();
  EXPECT_EQ(WTX_EAUTH, World(nullptr, mtls));
  EXPECT_EQ(0, World("t0ken-one", mtls)) << message_;
}

TEST_F(TlsTest, HalfATlsConfigurationIsRefusedAtStart) {
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.listen = "127.0.0.1:0";
  o.tls_cert_pem = srv_cert_.c_str();
  char err[512] = "";
  EXPECT_EQ(WTX_EINVAL, wtx_worker_start(&o, &w_, err, sizeof err));
  EXPECT_STREQ("tls_cert and tls_key go together", err);
  o.tls_cert_pem = nullptr;
  o.tls_client_ca_pem = ca_.c_str();
  EXPECT_EQ(WTX_EINVAL, wtx_worker_start(&o, &w_, err, sizeof err));
  EXPECT_STREQ("tls_client_ca: mutual TLS needs tls_cert and tls_key too", err);
}

}  // namespace
