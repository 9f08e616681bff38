// Text a caller sends: UTF-8 validity, and host:port addresses split the one
// way every listener and connection of the worker reads them.
#include "common/text.h"

#include <gtest/gtest.h>

#include <string>

#include "wtx/error.h"

namespace {

TEST(Text, Utf8IsCheckedWhole) {
  EXPECT_TRUE(wtx__utf8_valid("model.layers.0.weight"));
  EXPECT_TRUE(wtx__utf8_valid("gewicht.\xc3\xa4"));
  EXPECT_FALSE(wtx__utf8_valid("bad.\xc3"));
}

TEST(Text, HostPortSplitsAndDropsTheBracketsOfAnIpv6Host) {
  char host[64], port[8];
  ASSERT_EQ(0, wtx__split_hostport("127.0.0.1:9400", host, sizeof host, port, sizeof port));
  EXPECT_STREQ("127.0.0.1", host);
  EXPECT_STREQ("9400", port);
  ASSERT_EQ(0, wtx__split_hostport("[::1]:0", host, sizeof host, port, sizeof port));
  EXPECT_STREQ("::1", host);
  EXPECT_STREQ("0", port);
  ASSERT_EQ(0, wtx__split_hostport("worker-0.wtx:50051", host, sizeof host, port, sizeof port));
  EXPECT_STREQ("worker-0.wtx", host);
  for (const char *bad : {"9400", ":9400", "host:", ""})
    EXPECT_EQ(WTX_EINVAL, wtx__split_hostport(bad, host, sizeof host, port, sizeof port)) << bad;
  std::string long_host(64, 'h');
  EXPECT_EQ(WTX_EINVAL, wtx__split_hostport((long_host + ":1").c_str(), host, sizeof host, port,
                                            sizeof port));
  EXPECT_EQ(WTX_EINVAL, wtx__split_hostport("h:123456789", host, sizeof host, port, sizeof port));
}

}  // namespace
