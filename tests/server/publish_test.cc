// Publishing to --publish-dir: every published main version lands as
// <version>.safetensors (readable back, bit-exact) with LATEST naming it;
// only the newest `keep` files stay; labels become safe file names.
#include "server/publish.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "common/safetensors.h"
#include "tests/common/dir_wait.h"

namespace {

class PublishTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/wtx-publish-XXXXXX";
    ASSERT_NE(nullptr, mkdtemp(tmpl));
    dir_ = tmpl;
    ASSERT_EQ(0, wtx_store_create(&s_));
  }
  void TearDown() override {
    wtx__publisher_destroy(p_);
    wtx_store_destroy(s_);
    EXPECT_EQ(0, std::system(("rm -rf " + dir_).c_str()));
  }
  void Publish(const char *version, int fill) {
    const wtx_model_ops &ops = wtx_store_model_ops;
    ASSERT_EQ(0, ops.begin(s_, WTX_TARGET_MAIN));
    wtx_tensor_meta m{};
    char err[64];
    uint64_t shape = 100;
    ASSERT_EQ(0, wtx_tensor_meta_set(&m, "w", WTX_DTYPE_UINT8, &shape, 1, err, sizeof err));
    uint8_t *d = nullptr;
    ASSERT_EQ(0, ops.stage(s_, &m, &d));
    memset(d, fill, 100);
    ASSERT_EQ(0, ops.loaded(s_, &m, nullptr));
    ASSERT_EQ(0, ops.commit(s_, version));
    wtx__publisher_notify(p_);
  }
  std::string Latest() { return wtxtest::Latest(dir_); }
  // Waits (at most 10 s) until LATEST names file.
  bool WaitFor(const std::string &file) { return wtxtest::WaitLatest(dir_, file); }
  bool Exists(const std::string &file) { return access((dir_ + "/" + file).c_str(), F_OK) == 0; }
  // Waits (at most 10 s) until file is gone: the publisher rotates old
  // files out just after LATEST names the new one (so LATEST never names a
  // deleted file, even with --publish-keep 1).
  bool WaitGone(const std::string &file) {
    return wtxtest::WaitInDir(dir_, [&] { return !Exists(file); });
  }
  std::string dir_;
  wtx_store *s_ = nullptr;
  wtx__publisher *p_ = nullptr;
};

TEST_F(PublishTest, EachVersionIsWrittenAndOnlyTheNewestKeepStay) {
  ASSERT_EQ(0, wtx__publisher_create(s_, dir_.c_str(), 2, &p_));
  Publish("v1", 1);
  ASSERT_TRUE(WaitFor("v1.safetensors"));
  Publish("v2", 2);
  ASSERT_TRUE(WaitFor("v2.safetensors"));
  Publish("v3", 3);
  ASSERT_TRUE(WaitFor("v3.safetensors"));
  EXPECT_TRUE(WaitGone("v1.safetensors"));  // rotated out
  EXPECT_TRUE(Exists("v2.safetensors"));
  EXPECT_TRUE(Exists("v3.safetensors"));
  // The file holds the published bytes.
  wtx_st_file *f = nullptr;
  char err[256] = "";
  ASSERT_EQ(0, wtx_st_open((dir_ + "/v3.safetensors").c_str(), &f, err, sizeof err)) << err;
  ASSERT_EQ(1u, wtx_st_count(f));
  const wtx_st_tensor *t = wtx_st_tensor_at(f, 0);
  EXPECT_STREQ("w", t->meta.name);
  ASSERT_EQ(100u, t->meta.nbytes);
  for (int i = 0; i < 100; i++) ASSERT_EQ(3, t->data[i]);
  wtx_st_close(f);
}

TEST_F(PublishTest, AVersionQueuedAtShutdownIsStillWritten) {
  ASSERT_EQ(0, wtx__publisher_create(s_, dir_.c_str(), 2, &p_));
  Publish("last", 5);
  wtx__publisher_destroy(p_);  // without waiting
  p_ = nullptr;
  EXPECT_EQ("last.safetensors", Latest());
}

TEST_F(PublishTest, LabelsBecomeSafeFileNames) {
  ASSERT_EQ(0, wtx__publisher_create(s_, dir_.c_str(), 2, &p_));
  Publish("../step 7/x", 1);
  // No directory part, no hidden file: a leading dot and every slash or
  // space become underscores.
  ASSERT_TRUE(WaitFor("_._step_7_x.safetensors")) << Latest();
}

// The vLLM bridge names a version's directory by its label only when the
// label needed no change (else gen-<generation>): the rule says which.
TEST(FileName, SaysWhetherTheLabelWasAlreadyAFileName) {
  char out[256];
  EXPECT_EQ(1, wtx__file_name("step-7.v_2", out, sizeof out));
  EXPECT_STREQ("step-7.v_2", out);
  EXPECT_EQ(0, wtx__file_name("a/b", out, sizeof out));
  EXPECT_STREQ("a_b", out);
  EXPECT_EQ(0, wtx__file_name(".hidden", out, sizeof out));
  EXPECT_EQ(0, wtx__file_name("", out, sizeof out));
  EXPECT_EQ(0, wtx__file_name(std::string(300, 'x').c_str(), out, sizeof out));
  EXPECT_EQ(200u, strlen(out));
}

TEST_F(PublishTest, ADirectoryThatCannotBeWrittenIsRefused) {
  EXPECT_EQ(WTX_ENOENT, wtx__publisher_create(s_, (dir_ + "/missing").c_str(), 2, &p_));
  EXPECT_EQ(nullptr, p_);
}

}  // namespace
