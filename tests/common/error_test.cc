// The WTX_E* table: every code has a message, a name, and a gRPC status that
// maps back to a code of the same meaning.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "wtx/error.h"

namespace {

const int kCodes[] = {
#define XX(name, value, msg, grpc) WTX_##name,
    WTX_ERRNO_MAP(XX)
#undef XX
};

TEST(Error, EveryCodeIsNegativeDistinctAndDescribed) {
  std::set<int> seen;
  for (int c : kCodes) {
    EXPECT_LT(c, 0);
    EXPECT_TRUE(seen.insert(c).second) << c;
    EXPECT_STRNE("unknown error code", wtx_strerror(c)) << c;
    EXPECT_EQ(0u, std::string(wtx_err_name(c)).rfind("WTX_E", 0)) << c;
  }
  EXPECT_STREQ("success", wtx_strerror(0));
  EXPECT_STREQ("unknown error code", wtx_strerror(-9999));
  EXPECT_STREQ("WTX_EINVAL", wtx_err_name(WTX_EINVAL));
}

TEST(Error, GrpcMappingRoundTripsToTheSameStatus) {
  EXPECT_EQ(0, wtx_err_to_grpc(0));
  EXPECT_EQ(0, wtx_err_from_grpc(0));
  for (int c : kCodes) {
    int g = wtx_err_to_grpc(c);
    EXPECT_GT(g, 0) << wtx_err_name(c);
    // Several codes may share a status; the code it maps back to must carry
    // the same status on the wire.
    EXPECT_EQ(g, wtx_err_to_grpc(wtx_err_from_grpc(g))) << wtx_err_name(c);
  }
  EXPECT_EQ(3, wtx_err_to_grpc(WTX_EINVAL));   // INVALID_ARGUMENT
  EXPECT_EQ(9, wtx_err_to_grpc(WTX_ESTATE));   // FAILED_PRECONDITION
  EXPECT_EQ(15, wtx_err_to_grpc(WTX_ECHECKSUM));  // DATA_LOSS
  EXPECT_EQ(WTX_ETIMEDOUT, wtx_err_from_grpc(4));
  EXPECT_EQ(WTX_ENOENT, wtx_err_from_grpc(5));
}

}  // namespace
