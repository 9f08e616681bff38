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
  wtx__log_set_sink(Sink, &got);
  wtx__log_set_level(WTX__LOG_WARN);
  wtx__log(WTX__LOG_INFO, "event=dropped");
  wtx__log(WTX__LOG_ERROR, "event=kept n=%d", 7);
  wtx__log_set_level(WTX__LOG_OFF);
  wtx__log(WTX__LOG_ERROR, "event=off");
  wtx__log_set_sink(nullptr, nullptr);
  wtx__log_set_level(WTX__LOG_INFO);
  ASSERT_EQ(1u, got.lines.size());
  EXPECT_EQ(WTX__LOG_ERROR, got.lines[0].first);
  const std::string &l = got.lines[0].second;
  EXPECT_EQ(0u, l.rfind("ts=", 0)) << l;
  EXPECT_NE(std::string::npos, l.find("Z level=error event=kept n=7")) << l;
}

TEST(Log, LevelNamesParse) {
  int level = -1;
  EXPECT_EQ(0, wtx__log_parse_level("WARN", &level));
  EXPECT_EQ(WTX__LOG_WARN, level);
  EXPECT_EQ(0, wtx__log_parse_level("off", &level));
  EXPECT_EQ(WTX__LOG_OFF, level);
  EXPECT_EQ(WTX_EINVAL, wtx__log_parse_level("verbose", &level));
}

TEST(Log, ValuesAreQuotedOnlyWhenTheyMustBe) {
  char buf[64];
  EXPECT_STREQ("step-7", wtx__log_quote("step-7", buf, sizeof buf));
  EXPECT_STREQ("\"a b\"", wtx__log_quote("a b", buf, sizeof buf));
  EXPECT_STREQ("\"k=v \\\"q\\\" \\\\ \\n\"", wtx__log_quote("k=v \"q\" \\ \n", buf, sizeof buf));
  EXPECT_STREQ("\"\"", wtx__log_quote("", buf, sizeof buf));
  char small[6];
  wtx__log_quote("a long value with spaces", small, sizeof small);
  EXPECT_LT(std::string(small).size(), sizeof small);  // cut, still terminated
}

}  // namespace
