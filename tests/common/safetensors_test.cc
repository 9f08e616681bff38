// safetensors files: what wtx writes reads back bit-exact, and a malformed
// header is refused with a message naming the tensor and the field. (The
// Python test reads wtx's files with the safetensors package itself.)
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "wtx/error.h"
#include "common/safetensors.h"

namespace {

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/wtx-st-XXXXXX";
    ASSERT_NE(nullptr, mkdtemp(tmpl));
    dir_ = tmpl;
  }
  void TearDown() override { EXPECT_EQ(0, std::system(("rm -rf " + dir_).c_str())); }

  // A file holding header (padded to 8 bytes) and data_len zero bytes.
  std::string Raw(const std::string &header, size_t data_len) {
    std::string path = dir_ + "/raw.safetensors";
    std::ofstream f(path, std::ios::binary);
    uint64_t n = header.size();
    for (int i = 0; i < 8; i++) f.put(static_cast<char>(n >> (8 * i)));
    f << header << std::string(data_len, '\0');
    return path;
  }

  // The file at path, opened (nullptr, with the error reported, when not).
  wtx_st_file *Open(const std::string &path) {
    wtx_st_file *f = nullptr;
    char err[512] = "";
    EXPECT_EQ(0, wtx_st_open(path.c_str(), &f, err, sizeof err)) << err;
    return f;
  }

  std::string OpenError(const std::string &path, int want_rc = WTX_EINVAL) {
    wtx_st_file *f = nullptr;
    char err[512] = "";
    EXPECT_EQ(want_rc, wtx_st_open(path.c_str(), &f, err, sizeof err));
    EXPECT_EQ(nullptr, f);
    return err;
  }

  std::string dir_;
};

TEST_F(SafetensorsTest, WrittenFilesReadBackBitExact) {
  std::vector<uint8_t> a(4 * 6), b(2 * 5), c;  // c: an empty tensor
  for (size_t i = 0; i < a.size(); i++) a[i] = static_cast<uint8_t>(i * 7);
  for (size_t i = 0; i < b.size(); i++) b[i] = static_cast<uint8_t>(255 - i);
  wtx_st_tensor ts[3] = {};
  ts[0] = {{"model.w", WTX_DTYPE_FLOAT32, {2, 3}, 2, a.size()}, a.data()};
  ts[1] = {{"model.b", WTX_DTYPE_BFLOAT16, {5}, 1, b.size()}, b.data()};
  ts[2] = {{"empty", WTX_DTYPE_INT64, {0, 4}, 2, 0}, c.data()};
  const char *const meta[][2] = {{"format", "pt"}, {"wtx_version", "v 7"}};
  std::string path = dir_ + "/m.safetensors";
  char err[512] = "";
  ASSERT_EQ(0, wtx_st_write(path.c_str(), ts, 3, meta, 2, err, sizeof err)) << err;

  wtx_st_file *f = Open(path);
  ASSERT_NE(nullptr, f);
  ASSERT_EQ(3u, wtx_st_count(f));
  EXPECT_STREQ("pt", wtx_st_metadata(f, "format"));
  EXPECT_STREQ("v 7", wtx_st_metadata(f, "wtx_version"));
  EXPECT_EQ(nullptr, wtx_st_metadata(f, "nope"));
  // In data order: what was written first comes first.
  const wtx_st_tensor *t0 = wtx_st_tensor_at(f, 0), *t1 = wtx_st_tensor_at(f, 1);
  EXPECT_STREQ("model.w", t0->meta.name);
  EXPECT_EQ(WTX_DTYPE_FLOAT32, t0->meta.dtype);
  ASSERT_EQ(2u, t0->meta.ndim);
  EXPECT_EQ(2u, t0->meta.shape[0]);
  EXPECT_EQ(3u, t0->meta.shape[1]);
  EXPECT_EQ(0, memcmp(a.data(), t0->data, a.size()));
  EXPECT_STREQ("model.b", t1->meta.name);
  EXPECT_EQ(WTX_DTYPE_BFLOAT16, t1->meta.dtype);
  EXPECT_EQ(0, memcmp(b.data(), t1->data, b.size()));
  EXPECT_EQ(0u, wtx_st_tensor_at(f, 2)->meta.nbytes);
  EXPECT_EQ(nullptr, wtx_st_tensor_at(f, 3));
  wtx_st_close(f);

  // The data section starts 8-byte aligned, and no temporary file is left.
  struct stat st;
  ASSERT_EQ(0, stat(path.c_str(), &st));
  EXPECT_EQ(0, (st.st_size - (long)(a.size() + b.size())) % 8);
  FILE *p = popen(("ls " + dir_).c_str(), "r");
  char line[256];
  int files = 0;
  while (fgets(line, sizeof line, p) != nullptr) files++;
  pclose(p);
  EXPECT_EQ(1, files);
}

TEST_F(SafetensorsTest, RewritingReplacesTheFileWhole) {
  std::vector<uint8_t> a(8, 1), b(16, 2);
  wtx_st_tensor t = {{"x", WTX_DTYPE_UINT8, {8}, 1, 8}, a.data()};
  std::string path = dir_ + "/m.safetensors";
  char err[256] = "";
  ASSERT_EQ(0, wtx_st_write(path.c_str(), &t, 1, nullptr, 0, err, sizeof err));
  t = {{"x", WTX_DTYPE_UINT8, {16}, 1, 16}, b.data()};
  ASSERT_EQ(0, wtx_st_write(path.c_str(), &t, 1, nullptr, 0, err, sizeof err));
  wtx_st_file *f = Open(path);
  ASSERT_NE(nullptr, f);
  EXPECT_EQ(16u, wtx_st_tensor_at(f, 0)->meta.nbytes);
  EXPECT_EQ(2, wtx_st_tensor_at(f, 0)->data[15]);
  wtx_st_close(f);
}

TEST_F(SafetensorsTest, MalformedHeadersNameTheProblem) {
  struct Case {
    std::string header;
    size_t data;
    std::string want;
  } cases[] = {
      {"{\"a\":{\"dtype\":\"F33\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4,
       "tensor 'a': dtype 'F33' unknown"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,4]}}", 4,
       "tensor 'a': data_offsets span 4 bytes, dtype x shape is 8"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
       "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}", 12,
       "tensor 'b' starts at 8, expected 4"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8,
       "tensors cover 4 of 8 data bytes"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 2,
       "tensor 'a': data_offsets end 4 beyond the 2-byte data section"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,4]}}", 4,
       "tensor 'a': shape[0] is not a non-negative integer"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],"
       "\"data_offsets\":[0,4]}}", 4, "tensor 'a': 9 dims, at most 8"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, "tensor 'a': needs dtype"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},"
       "\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}", 0,
       "'a' appears twice in the header"},
      {"{\"__metadata__\":{},\"__metadata__\":{}}", 0,
       "'__metadata__' appears twice in the header"},
      {"{\"a\":1}", 0, "tensor 'a': needs dtype"},
      {"{\"a\":{\"dtype\":\"F32\",\"dtype\":\"F32\"}}", 0, "tensor 'a': dtype appears twice"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}", 4,
       "tensor 'a': shape[0] is not a non-negative integer"},
      {"{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 4,
       "tensor 'a': needs dtype"},
      {"{\"__metadata__\":{\"k\":1}}", 0, "__metadata__ values must be strings"},
      {"{\"a\":", 0, "header is not valid JSON"},
      {"[1,2]", 0, "header is not a JSON object"},
      {"{\"__metadata__\":[]}", 0, "__metadata__ is not an object"},
  };
  for (const Case &c : cases) {
    std::string err = OpenError(Raw(c.header, c.data));
    EXPECT_NE(std::string::npos, err.find(c.want)) << c.header << "\n  got: " << err;
  }
  // Header length beyond the file.
  std::string path = dir_ + "/short.safetensors";
  std::ofstream(path, std::ios::binary) << std::string("\xff\x00\x00\x00\x00\x00\x00\x00", 8) << "{}";
  EXPECT_NE(std::string::npos, OpenError(path).find("header length 255 exceeds"));
  EXPECT_NE(std::string::npos,
            OpenError(dir_ + "/missing.safetensors", WTX_ENOENT).find("missing.safetensors"));
}

TEST_F(SafetensorsTest, UnknownFieldsAreSkippedWhateverTheirShape) {
  std::string path = Raw("{\"x\":{\"extra\":{\"deep\":[1,{\"k\":null}]},\"dtype\":\"F32\","
                         "\"shape\":[1],\"data_offsets\":[0,4],\"more\":[true,2.5]}}", 4);
  wtx_st_file *f = Open(path);
  ASSERT_NE(nullptr, f);
  ASSERT_EQ(1u, wtx_st_count(f));
  EXPECT_STREQ("x", wtx_st_tensor_at(f, 0)->meta.name);
  EXPECT_EQ(4u, wtx_st_tensor_at(f, 0)->meta.nbytes);
  wtx_st_close(f);
}

// The header's order is not the data's (the safetensors package sorts
// names; its data goes by alignment): the tensors come in data order, and
// an entry as short as a header allows still parses (the names' table is
// sized from the header's length).
TEST_F(SafetensorsTest, TensorsComeInDataOrderWhateverTheHeaderOrder) {
  std::string path = Raw("{\"z\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]},"
                         "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[8,10]},"
                         "\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[4,8]}}", 10);
  wtx_st_file *f = Open(path);
  ASSERT_NE(nullptr, f);
  ASSERT_EQ(3u, wtx_st_count(f));
  EXPECT_STREQ("z", wtx_st_tensor_at(f, 0)->meta.name);
  EXPECT_STREQ("a", wtx_st_tensor_at(f, 1)->meta.name);
  EXPECT_STREQ("b", wtx_st_tensor_at(f, 2)->meta.name);
  wtx_st_close(f);
}

TEST_F(SafetensorsTest, EscapedNamesAreDecoded) {
  std::string path = Raw("{\"a\\\"b\\u00e9\":{\"dtype\":\"U8\",\"shape\":[1],"
                         "\"data_offsets\":[0,1]}}", 1);
  wtx_st_file *f = Open(path);
  ASSERT_NE(nullptr, f);
  EXPECT_STREQ("a\"b\xc3\xa9", wtx_st_tensor_at(f, 0)->meta.name);
  wtx_st_close(f);
}

TEST_F(SafetensorsTest, WriteRefusesADuplicateName) {
  std::vector<uint8_t> a(4);
  wtx_st_tensor ts[2] = {{{"w", WTX_DTYPE_UINT8, {4}, 1, 4}, a.data()},
                         {{"w", WTX_DTYPE_UINT8, {4}, 1, 4}, a.data()}};
  char err[256] = "";
  std::string path = dir_ + "/dup.safetensors";
  EXPECT_EQ(WTX_EINVAL, wtx_st_write(path.c_str(), ts, 2, nullptr, 0, err, sizeof err));
  EXPECT_NE(nullptr, std::strstr(err, "tensor 'w' appears twice")) << err;
  EXPECT_NE(0, access(path.c_str(), F_OK));
}

TEST_F(SafetensorsTest, AnEmptyModelIsAValidFile) {
  std::string path = dir_ + "/e.safetensors";
  char err[256] = "";
  ASSERT_EQ(0, wtx_st_write(path.c_str(), nullptr, 0, nullptr, 0, err, sizeof err));
  wtx_st_file *f = Open(path);
  ASSERT_NE(nullptr, f);
  EXPECT_EQ(0u, wtx_st_count(f));
  wtx_st_close(f);
}

}  // namespace
