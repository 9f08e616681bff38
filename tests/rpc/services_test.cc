// Health and server reflection (rpc/services.h) over real loopback gRPC, on a
// server hosting the test-only Echo service: what grpcurl, Kubernetes probes
// and grpcio-reflection ask, with both reflection versions.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "echo_test.grpc-c.h"
#include "google/protobuf/descriptor.pb-c.h"
#include "grpc/health/v1/health.grpc-c.h"
#include "grpc/reflection/v1/reflection.grpc-c.h"
#include "grpc/reflection/v1alpha/reflection.grpc-c.h"
#include "rpc/services.h"

namespace {

using Req = Grpc__Reflection__V1__ServerReflectionRequest;
using Resp = Grpc__Reflection__V1__ServerReflectionResponse;
#define STATUS(x) GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__##x

grpc_status_code Say(wtx__rpc_ctx *ctx, const Wtxtest__Echo__EchoRequest *req,
                     Wtxtest__Echo__EchoReply *resp) {
  resp->text = wtx__rpc_ctx_strdup(ctx, req->text);
  return GRPC_STATUS_OK;
}

const Wtxtest__Echo__Echo_Handlers kEcho = {.say = Say, .unhandled = nullptr, .chat = nullptr};

class ServicesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_EQ(0, wtx__rpc_server_create(nullptr, &srv_));
    ASSERT_EQ(0, wtx__rpc_server_add_service(srv_, &wtxtest__echo__echo__grpc, &kEcho,
                                            nullptr));
    ASSERT_EQ(0, wtx__rpc_health_create(srv_, &health_));
    ASSERT_EQ(0, wtx__rpc_server_add_reflection(srv_));
    int port = 0;
    ASSERT_EQ(0, wtx__rpc_server_start(srv_, "127.0.0.1:0", &port));
    std::string t = "127.0.0.1:" + std::to_string(port);
    ASSERT_EQ(0, wtx__rpc_channel_create(t.c_str(), nullptr, &ch_));
  }
  void TearDown() override {
    wtx__rpc_channel_destroy(ch_);
    if (health_ != nullptr) wtx__rpc_health_close(health_);
    wtx__rpc_server_destroy(srv_);
    wtx__rpc_health_destroy(health_);
  }

  // Sends each request on one reflection stream (v1 or v1alpha; the wire is
  // the same) and returns the responses decoded as v1.
  std::vector<Resp *> Ask(const std::vector<Req> &reqs, bool alpha = false) {
    const wtx__rpc_service &svc = alpha ? grpc__reflection__v1alpha__server_reflection__grpc
                                       : grpc__reflection__v1__server_reflection__grpc;
    wtx__rpc_stream *s = nullptr;
    std::vector<Resp *> out;
    EXPECT_EQ(0, wtx__rpc_stream_open(ch_, &svc.methods[0], nullptr, &s));
    for (const Req &r : reqs) {
      std::vector<uint8_t> wire(protobuf_c_message_get_packed_size(&r.base));
      protobuf_c_message_pack(&r.base, wire.data());
      ProtobufCMessage *send = protobuf_c_message_unpack(svc.methods[0].input, nullptr,
                                                         wire.size(), wire.data());
      EXPECT_EQ(0, wtx__rpc_stream_send(s, send));
      protobuf_c_message_free_unpacked(send, nullptr);
      ProtobufCMessage *m = nullptr;
      EXPECT_EQ(1, wtx__rpc_stream_recv(s, &m));
      if (m == nullptr) break;
      if (alpha) {
        // Re-decode as v1 to share the assertions.
        std::vector<uint8_t> buf(protobuf_c_message_get_packed_size(m));
        protobuf_c_message_pack(m, buf.data());
        protobuf_c_message_free_unpacked(m, nullptr);
        m = &grpc__reflection__v1__server_reflection_response__unpack(
                 nullptr, buf.size(), buf.data())->base;
      }
      out.push_back(reinterpret_cast<Resp *>(m));
    }
    EXPECT_EQ(0, wtx__rpc_stream_close_send(s));
    ProtobufCMessage *m = nullptr;
    EXPECT_EQ(0, wtx__rpc_stream_recv(s, &m));
    wtx__rpc_status st;
    EXPECT_EQ(0, wtx__rpc_stream_finish(s, &st)) << st.message;
    return out;
  }

  static Req ListServices() {
    Req r = GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__INIT;
    r.host = const_cast<char *>("localhost");
    r.message_request_case =
        GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_LIST_SERVICES;
    r.list_services = const_cast<char *>("*");
    return r;
  }
  static Req ByFile(const char *name) {
    Req r = GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__INIT;
    r.message_request_case =
        GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_BY_FILENAME;
    r.file_by_filename = const_cast<char *>(name);
    return r;
  }
  static Req BySymbol(const char *sym) {
    Req r = GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__INIT;
    r.message_request_case =
        GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_CONTAINING_SYMBOL;
    r.file_containing_symbol = const_cast<char *>(sym);
    return r;
  }

  // The names of the files in a file_descriptor_response, in order; every
  // one must decode as a FileDescriptorProto.
  static std::vector<std::string> FileNames(const Resp *r) {
    std::vector<std::string> names;
    EXPECT_EQ(GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_FILE_DESCRIPTOR_RESPONSE,
              r->message_response_case);
    if (r->file_descriptor_response == nullptr) return names;
    for (size_t i = 0; i < r->file_descriptor_response->n_file_descriptor_proto; i++) {
      const ProtobufCBinaryData &b = r->file_descriptor_response->file_descriptor_proto[i];
      auto *fd = google__protobuf__file_descriptor_proto__unpack(nullptr, b.len, b.data);
      EXPECT_NE(nullptr, fd);
      if (fd == nullptr) continue;
      names.push_back(fd->name);
      google__protobuf__file_descriptor_proto__free_unpacked(fd, nullptr);
    }
    return names;
  }

  static void Free(std::vector<Resp *> &rs) {
    for (Resp *r : rs) protobuf_c_message_free_unpacked(&r->base, nullptr);
    rs.clear();
  }

  int Check(const char *service, int *status, wtx__rpc_status *st) {
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    req.service = const_cast<char *>(service);
    Grpc__Health__V1__HealthCheckResponse *resp = nullptr;
    int rc = grpc__health__v1__health__check__call(ch_, &req, &resp, nullptr, st);
    if (rc == 0) {
      *status = resp->status;
      protobuf_c_message_free_unpacked(&resp->base, nullptr);
    }
    return rc;
  }

  wtx__rpc_server *srv_ = nullptr;
  wtx__rpc_health *health_ = nullptr;
  wtx__rpc_channel *ch_ = nullptr;
};

TEST_F(ServicesTest, ListServicesNamesEveryServiceInBothVersions) {
  for (bool alpha : {false, true}) {
    auto rs = Ask({ListServices()}, alpha);
    ASSERT_EQ(1u, rs.size());
    ASSERT_EQ(GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_LIST_SERVICES_RESPONSE,
              rs[0]->message_response_case);
    std::set<std::string> names;
    for (size_t i = 0; i < rs[0]->list_services_response->n_service; i++)
      names.insert(rs[0]->list_services_response->service[i]->name);
    EXPECT_EQ((std::set<std::string>{"wtxtest.echo.Echo", "grpc.health.v1.Health",
                                     "grpc.reflection.v1.ServerReflection",
                                     "grpc.reflection.v1alpha.ServerReflection"}),
              names);
    EXPECT_STREQ("localhost", rs[0]->valid_host);
    ASSERT_NE(nullptr, rs[0]->original_request);
    EXPECT_STREQ("*", rs[0]->original_request->list_services);
    Free(rs);
  }
}

TEST_F(ServicesTest, FileByFilenameComesFirstWithItsImports) {
  auto rs = Ask({ByFile("echo_test.proto"), ByFile("echo_common.proto")});
  ASSERT_EQ(2u, rs.size());
  EXPECT_EQ((std::vector<std::string>{"echo_test.proto", "echo_common.proto"}),
            FileNames(rs[0]));
  EXPECT_EQ((std::vector<std::string>{"echo_common.proto"}), FileNames(rs[1]));
  Free(rs);
}

TEST_F(ServicesTest, FileContainingSymbolFindsServicesMethodsMessagesAndFields) {
  const char *in_test[] = {"wtxtest.echo.Echo", "wtxtest.echo.Echo.Say",
                           "wtxtest.echo.EchoRequest", "wtxtest.echo.EchoRequest.Nested",
                           "wtxtest.echo.EchoRequest.delay_ms"};
  for (const char *sym : in_test) {
    auto rs = Ask({BySymbol(sym)}, /*alpha=*/true);
    ASSERT_EQ(1u, rs.size());
    auto names = FileNames(rs[0]);
    ASSERT_FALSE(names.empty()) << sym;
    EXPECT_EQ("echo_test.proto", names[0]) << sym;
    Free(rs);
  }
  auto rs = Ask({BySymbol("wtxtest.common.Blob"), BySymbol("grpc.health.v1.Health")});
  ASSERT_EQ(2u, rs.size());
  EXPECT_EQ((std::vector<std::string>{"echo_common.proto"}), FileNames(rs[0]));
  EXPECT_EQ((std::vector<std::string>{"grpc/health/v1/health.proto"}), FileNames(rs[1]));
  Free(rs);
}

TEST_F(ServicesTest, UnknownNamesAnswerNotFoundAndTheStreamGoesOn) {
  Req ext = GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__INIT;
  ext.message_request_case =
      GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_ALL_EXTENSION_NUMBERS_OF_TYPE;
  ext.all_extension_numbers_of_type = const_cast<char *>("wtxtest.echo.EchoReply");
  Req noext = ext;
  noext.all_extension_numbers_of_type = const_cast<char *>("no.Such");
  auto rs = Ask({BySymbol("wtxtest.echo.Nope"), ByFile("nope.proto"), ext, noext,
                 ListServices()});
  ASSERT_EQ(5u, rs.size());
  for (int i : {0, 1, 3}) {
    ASSERT_EQ(GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ERROR_RESPONSE,
              rs[i]->message_response_case)
        << i;
    EXPECT_EQ(GRPC_STATUS_NOT_FOUND, rs[i]->error_response->error_code);
    EXPECT_NE(std::string(), rs[i]->error_response->error_message);
  }
  ASSERT_EQ(GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ALL_EXTENSION_NUMBERS_RESPONSE,
            rs[2]->message_response_case);
  EXPECT_STREQ("wtxtest.echo.EchoReply", rs[2]->all_extension_numbers_response->base_type_name);
  EXPECT_EQ(0u, rs[2]->all_extension_numbers_response->n_extension_number);
  EXPECT_EQ(GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_LIST_SERVICES_RESPONSE,
            rs[4]->message_response_case);
  Free(rs);
}

TEST_F(ServicesTest, HealthCheckFollowsTheStatusAndRejectsUnknownServices) {
  int status = -1;
  wtx__rpc_status st;
  ASSERT_EQ(0, Check("", &status, &st)) << st.message;
  EXPECT_EQ(STATUS(NOT_SERVING), status);  // until set
  wtx__rpc_health_set(health_, 1);
  for (const char *svc : {"", "wtxtest.echo.Echo", "grpc.health.v1.Health"}) {
    ASSERT_EQ(0, Check(svc, &status, &st)) << st.message;
    EXPECT_EQ(STATUS(SERVING), status) << svc;
  }
  wtx__rpc_health_set(health_, 0);
  ASSERT_EQ(0, Check("wtxtest.echo.Echo", &status, &st));
  EXPECT_EQ(STATUS(NOT_SERVING), status);
  EXPECT_EQ(WTX_ENOENT, Check("wtxtest.Nope", &status, &st));
  EXPECT_EQ(GRPC_STATUS_NOT_FOUND, st.code);
  EXPECT_NE(std::string::npos, std::string(st.message).find("wtxtest.Nope"));
}

TEST_F(ServicesTest, HealthWatchStreamsEveryChangeAndEndsOnClose) {
  wtx__rpc_health_set(health_, 1);
  wtx__rpc_stream *s = nullptr;
  ASSERT_EQ(0, grpc__health__v1__health__watch__open(ch_, nullptr, &s));
  Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  ASSERT_EQ(0, grpc__health__v1__health__watch__send(s, &req));
  ASSERT_EQ(0, wtx__rpc_stream_close_send(s));
  std::vector<int> seen;
  Grpc__Health__V1__HealthCheckResponse *m = nullptr;
  ASSERT_EQ(1, grpc__health__v1__health__watch__recv(s, &m));
  seen.push_back(m->status);
  protobuf_c_message_free_unpacked(&m->base, nullptr);
  wtx__rpc_health_set(health_, 0);
  ASSERT_EQ(1, grpc__health__v1__health__watch__recv(s, &m));
  seen.push_back(m->status);
  protobuf_c_message_free_unpacked(&m->base, nullptr);
  wtx__rpc_health_set(health_, 1);
  ASSERT_EQ(1, grpc__health__v1__health__watch__recv(s, &m));
  seen.push_back(m->status);
  protobuf_c_message_free_unpacked(&m->base, nullptr);
  wtx__rpc_health_close(health_);
  int rc;
  while ((rc = grpc__health__v1__health__watch__recv(s, &m)) == 1) {
    seen.push_back(m->status);
    protobuf_c_message_free_unpacked(&m->base, nullptr);
  }
  EXPECT_EQ(0, rc);
  wtx__rpc_status st;
  EXPECT_EQ(0, wtx__rpc_stream_finish(s, &st)) << st.message;
  EXPECT_EQ((std::vector<int>{STATUS(SERVING), STATUS(NOT_SERVING), STATUS(SERVING),
                              STATUS(NOT_SERVING)}),
            seen);
}

TEST_F(ServicesTest, HealthWatchOfAnUnknownServiceSaysSo) {
  wtx__rpc_stream *s = nullptr;
  ASSERT_EQ(0, grpc__health__v1__health__watch__open(ch_, nullptr, &s));
  Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
  req.service = const_cast<char *>("wtxtest.Nope");
  ASSERT_EQ(0, grpc__health__v1__health__watch__send(s, &req));
  Grpc__Health__V1__HealthCheckResponse *m = nullptr;
  ASSERT_EQ(1, grpc__health__v1__health__watch__recv(s, &m));
  EXPECT_EQ(STATUS(SERVICE_UNKNOWN), m->status);
  protobuf_c_message_free_unpacked(&m->base, nullptr);
  wtx__rpc_health_close(health_);
  while (grpc__health__v1__health__watch__recv(s, &m) == 1)
    protobuf_c_message_free_unpacked(&m->base, nullptr);
  wtx__rpc_status st;
  EXPECT_EQ(0, wtx__rpc_stream_finish(s, &st)) << st.message;
}

}  // namespace
