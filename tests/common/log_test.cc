// Structured logs: the level threshold, the host's sink, and logfmt quoting
// of values a reader must be able to split back.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "wtx/error.h"
#include "common/log.h"

namespace {

struct Captured {
  std::vector<std::pair<int, std::string>> lines;
};

void Sink(void *user, int level, const char *line) {
  static_cast<Captured *>(user)->lines.emplace_back(level, line);
}

TEST(Log, LinesBelowTheLevelAreDroppedAndTheRestReachTheSink) {
  Captured got;
  wtx_log_set_sink(Sink, &got);
  wtx_log_set_level(WTX_LOG_WARN);
  wtx_log(WTX_LOG_INFO, "event=dropped");
  wtx_log(WTX_LOG_ERROR, "event=kept n=%d", 7);
  wtx_log_set_level(WTX_LOG_OFF);
  wtx_log(WTX_LOG_ERROR, "event=off");
  wtx_log_set_sink(nullptr, nullptr);
  wtx_log_set_level(WTX_LOG_INFO);
  ASSERT_EQ(1u, got.lines.size());
  EXPECT_EQ(WTX_LOG_ERROR, got.lines[0].first);
  const std::string &l = got.lines[0].second;
  EXPECT_EQ(0u, l.rfind("ts=", 0)) << l;
  EXPECT_NE(std::string::npos, l.find("Z level=error event=kept n=7")) << l;
}

TEST(Log, LevelNamesParse) {
  int level = -1;
  EXPECT_EQ(0, wtx_log_parse_level("WARN", &level));
  EXPECT_EQ(WTX_LOG_WARN, level);
  EXPECT_EQ(0, wtx_log_parse_level("off", &level));
  EXPECT_EQ(WTX_LOG_OFF, level);
  EXPECT_EQ(WTX_EINVAL, wtx_log_parse_level("verbose", &level));
}

TEST(Log, ValuesAreQuotedOnlyWhenTheyMustBe) {
  char buf[64];
  EXPECT_STREQ("step-7", wtx_log_quote("step-7", buf, sizeof buf));
  EXPECT_STREQ("\"a b\"", wtx_log_quote("a b", buf, sizeof buf));
  EXPECT_STREQ("\"k=v \\\"q\\\" \\\\ \\n\"", wtx_log_quote("k=v \"q\" \\ \n", buf, sizeof buf));
  EXPECT_STREQ("\"\"", wtx_log_quote("", buf, sizeof buf));
  char small[6];
  wtx_log_quote("a long value with spaces", small, sizeof small);
  EXPECT_LT(std::string(small).size(), sizeof small);  // cut, still terminated
}

}  // namespace
