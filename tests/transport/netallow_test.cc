// --allow-upstream: networks, addresses and host names, both families.
#include "transport/netallow.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>

#include <string>

#include "wtx/error.h"

namespace {

sockaddr_storage Addr(const char *text) {
  sockaddr_storage ss{};
  auto *v4 = reinterpret_cast<sockaddr_in *>(&ss);
  auto *v6 = reinterpret_cast<sockaddr_in6 *>(&ss);
  if (inet_pton(AF_INET, text, &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
  } else {
    EXPECT_EQ(1, inet_pton(AF_INET6, text, &v6->sin6_addr)) << text;
    v6->sin6_family = AF_INET6;
  }
  return ss;
}

bool Admits(const wtx__netallow *a, const char *text) {
  sockaddr_storage ss = Addr(text);
  return wtx__netallow_admits(a, reinterpret_cast<sockaddr *>(&ss)) == 1;
}

TEST(NetAllow, NetworksAddressesAndHosts) {
  wtx__netallow *a = nullptr;
  char err[256] = "";
  ASSERT_EQ(0, wtx__netallow_parse("10.0.0.0/8, 192.168.1.7,fd00::/8,localhost", &a, err,
                                   sizeof err))
      << err;
  EXPECT_TRUE(Admits(a, "10.200.3.4"));
  EXPECT_FALSE(Admits(a, "11.0.0.1"));
  EXPECT_TRUE(Admits(a, "192.168.1.7"));
  EXPECT_FALSE(Admits(a, "192.168.1.8"));
  EXPECT_TRUE(Admits(a, "fd12::1"));
  EXPECT_FALSE(Admits(a, "fe80::1"));
  EXPECT_TRUE(Admits(a, "127.0.0.1"));  // localhost, resolved at parse
  wtx__netallow_destroy(a);
}

TEST(NetAllow, AnEmptyListAdmitsAnythingAndABadEntryIsNamed) {
  wtx__netallow *a = nullptr;
  char err[256] = "";
  ASSERT_EQ(0, wtx__netallow_parse(nullptr, &a, err, sizeof err));
  EXPECT_EQ(nullptr, a);
  EXPECT_TRUE(Admits(a, "8.8.8.8"));
  EXPECT_EQ(WTX_EINVAL, wtx__netallow_parse("10.0.0.0/33", &a, err, sizeof err));
  EXPECT_STREQ("allow_upstream: '10.0.0.0/33' is not an address, network or resolvable host",
               err);
  EXPECT_EQ(WTX_EINVAL, wtx__netallow_parse("no-such-host.invalid", &a, err, sizeof err));
  EXPECT_EQ(WTX_EINVAL, wtx__netallow_parse(",", &a, err, sizeof err));
  EXPECT_EQ(nullptr, a);
}

TEST(NetAllow, PrefixesCutInsideAByte) {
  wtx__netallow *a = nullptr;
  char err[256] = "";
  ASSERT_EQ(0, wtx__netallow_parse("172.16.0.0/12", &a, err, sizeof err)) << err;
  EXPECT_TRUE(Admits(a, "172.31.255.255"));
  EXPECT_FALSE(Admits(a, "172.32.0.0"));
  EXPECT_FALSE(Admits(a, "172.15.255.255"));
  wtx__netallow_destroy(a);
}

}  // namespace
