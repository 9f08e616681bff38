// Weight sources: metadata and iteration agree, byte totals, validation, the
// safetensors source over a file written by wtx's writer (the Python test
// feeds it one written by the safetensors package), layer grouping.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "wtx/source.h"
#include "common/safetensors.h"

namespace {

// Collects a full pass: names and bytes.
std::vector<std::pair<std::string, std::vector<uint8_t>>> Pass(wtx_source *s) {
  std::vector<std::pair<std::string, std::vector<uint8_t>>> out;
  void *it = nullptr;
  EXPECT_EQ(0, wtx_source_open(s, &it));
  wtx_tensor_meta m;
  const uint8_t *d;
  int r;
  while ((r = wtx_source_next(s, it, &m, &d)) == 1)
    out.emplace_back(m.name, std::vector<uint8_t>(d, d + m.nbytes));
  EXPECT_EQ(0, r);
  wtx_source_close(s, it);
  return out;
}

TEST(Source, SyntheticHasTheAskedSizeAndAgreesWithItsMetadata) {
  for (uint64_t size : {UINT64_C(1) << 20, UINT64_C(64) << 20, UINT64_C(1) << 30}) {
    wtx_source *s = nullptr;
    ASSERT_EQ(0, wtx_source_synthetic(size, 1, &s));
    uint64_t total = 0;
    ASSERT_EQ(0, wtx_source_total_bytes(s, &total));
    EXPECT_LE(total, size + size / 4) << size;
    EXPECT_GE(total, size / 2) << size;
    const wtx_tensor_meta *m;
    size_t n;
    ASSERT_EQ(0, wtx_source_metadata(s, &m, &n));
    EXPECT_STREQ("model.embed_tokens.weight", m[0].name);
    EXPECT_STREQ("model.norm.weight", m[n - 1].name);
    for (size_t i = 0; i < n; i++) EXPECT_EQ(WTX_DTYPE_BFLOAT16, m[i].dtype);
    if (size <= (UINT64_C(64) << 20)) {
      auto p = Pass(s);
      ASSERT_EQ(n, p.size());
      for (size_t i = 0; i < n; i++) {
        EXPECT_EQ(m[i].name, p[i].first);
        EXPECT_EQ(m[i].nbytes, p[i].second.size());
      }
    }
    wtx_source_destroy(s);
  }
}

TEST(Source, SyntheticContentIsDeterministicPerSeed) {
  wtx_source *a, *b, *c;
  ASSERT_EQ(0, wtx_source_synthetic(1 << 20, 5, &a));
  ASSERT_EQ(0, wtx_source_synthetic(1 << 20, 5, &b));
  ASSERT_EQ(0, wtx_source_synthetic(1 << 20, 6, &c));
  auto pa = Pass(a), pb = Pass(b), pc = Pass(c);
  EXPECT_EQ(pa, pb);
  EXPECT_NE(pa[0].second, pc[0].second);
  EXPECT_EQ(pa, Pass(a));  // a fresh pass yields the same again
  wtx_source_destroy(a);
  wtx_source_destroy(b);
  wtx_source_destroy(c);
}

TEST(Source, MemoryBorrowsDataAndValidatesMetadata) {
  std::vector<float> w(12, 1.5f);
  uint64_t shape[2] = {3, 4};
  wtx_memory_tensor ts[2] = {{"w", WTX_DTYPE_FLOAT32, shape, 2, w.data(), 0},
                             {"b", WTX_DTYPE_FLOAT32, shape, 1, w.data(), 0}};
  wtx_source *s = nullptr;
  char err[256] = "";
  ASSERT_EQ(0, wtx_source_memory(ts, 2, &s, err, sizeof err)) << err;
  auto p = Pass(s);
  ASSERT_EQ(2u, p.size());
  EXPECT_EQ(48u, p[0].second.size());
  EXPECT_EQ(12u, p[1].second.size());
  EXPECT_EQ(0, memcmp(w.data(), p[0].second.data(), 48));
  wtx_source_destroy(s);

  ts[1].name = "w";
  EXPECT_EQ(WTX_EINVAL, wtx_source_memory(ts, 2, &s, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "'w' appears twice")) << err;
  ts[1].name = "b";
  ts[1].dtype = 99;
  EXPECT_EQ(WTX_EINVAL, wtx_source_memory(ts, 2, &s, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "tensor 'b' (index 1): dtype: 99 is not a wire dtype")) << err;
}

// Device tensors, on the TEST DOUBLE of the CUDA runtime
// (cuda/testing/fake_cuda.c) loaded at the dlopen seam.
TEST(Source, DeviceTensorsAreCopiedToTheHostAsThePassReachesThem) {
  setenv("WTX_CUDART_LIB", "/nonexistent/libcudart.so", 1);
  float host = 1.0f;
  uint64_t one = 1;
  wtx_memory_tensor t = {"gpu.w", WTX_DTYPE_FLOAT32, &one, 1, &host, 1};
  wtx_source *s = nullptr;
  char err[512] = "";
  EXPECT_EQ(WTX_EUNAVAIL, wtx_source_memory(&t, 1, &s, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "tensor 'gpu.w' is in device memory")) << err;
  EXPECT_NE(nullptr, strstr(err, "WTX_CUDART_LIB=/nonexistent")) << err;

  char cwd[4096];
  ASSERT_NE(nullptr, getcwd(cwd, sizeof cwd));
  std::string lib = std::string(cwd) + "/cuda/testing/libwtx_fake_cuda.so";
  setenv("WTX_CUDART_LIB", lib.c_str(), 1);
  void *h = dlopen(lib.c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(nullptr, h) << dlerror();
  auto cuda_malloc = reinterpret_cast<int (*)(void **, size_t)>(dlsym(h, "cudaMalloc"));
  auto cuda_free = reinterpret_cast<int (*)(void *)>(dlsym(h, "cudaFree"));
  auto cuda_memcpy =
      reinterpret_cast<int (*)(void *, const void *, size_t, int)>(dlsym(h, "cudaMemcpy"));
  std::vector<uint8_t> a(4096), b(100);
  for (size_t i = 0; i < a.size(); i++) a[i] = (uint8_t)(i * 13);
  for (size_t i = 0; i < b.size(); i++) b[i] = (uint8_t)(200 - i);
  void *da = nullptr;
  ASSERT_EQ(0, cuda_malloc(&da, a.size()));
  ASSERT_EQ(0, cuda_memcpy(da, a.data(), a.size(), 1));
  uint64_t sa = 1024, sb = 100;
  wtx_memory_tensor ts[2] = {{"gpu.a", WTX_DTYPE_FLOAT32, &sa, 1, da, 1},
                             {"host.b", WTX_DTYPE_UINT8, &sb, 1, b.data(), 0}};
  ASSERT_EQ(0, wtx_source_memory(ts, 2, &s, err, sizeof err)) << err;
  auto p = Pass(s);
  ASSERT_EQ(2u, p.size());
  EXPECT_EQ(a, p[0].second);
  EXPECT_EQ(b, p[1].second);
  wtx_source_destroy(s);
  cuda_free(da);
  unsetenv("WTX_CUDART_LIB");
}

// A source that answers in batches (wtx_source_ops.next_batch, as the
// Python adapter does): n tensors of 4 bytes, at most `most` per call; the
// tensor k's bytes are k. `copies`: each is written into one scratch word
// that the next call overwrites (kind 1), else each has its own (kind 2).
struct Batched {
  std::vector<wtx_tensor_meta> metas;
  std::vector<std::string> names;
  std::vector<uint32_t> own;
  uint32_t scratch = 0;
  size_t most = 512, pos = 0, calls = 0, fail_at_call = 0;
  int copies = 0, bad_kind = 0, too_many = 0;
  explicit Batched(size_t n) : metas(n), names(n), own(n) {
    uint64_t one = 1;
    for (size_t k = 0; k < n; k++) {
      names[k] = "t." + std::to_string(k);
      own[k] = (uint32_t)k;
    }
    for (size_t k = 0; k < n; k++)
      EXPECT_EQ(0, wtx_tensor_meta_set(&metas[k], names[k].c_str(), WTX_DTYPE_UINT32, &one, 1,
                                       nullptr, 0));
  }
};

const wtx_source_ops kBatchedOps = {
    .version = WTX_SOURCE_OPS_VERSION,
    .name = "batched",
    .metadata = [](void *self, const wtx_tensor_meta **m, size_t *n) {
      auto *b = static_cast<Batched *>(self);
      *m = b->metas.data();
      *n = b->metas.size();
      return 0;
    },
    .open = [](void *self, void **it) {
      static_cast<Batched *>(self)->pos = 0;
      *it = self;
      return 0;
    },
    .next = nullptr,
    .close = [](void *, void *) {},
    .destroy = nullptr,
    .next_batch = [](void *self, void *, size_t max, const wtx_tensor_meta **metas,
                     const uint8_t **data, int *kinds) {
      auto *b = static_cast<Batched *>(self);
      if (++b->calls == b->fail_at_call) return (int)WTX_EIO;
      size_t k = 0, most = b->copies ? 1 : std::min(max, b->most);
      for (; k < most && b->pos < b->metas.size(); k++, b->pos++) {
        metas[k] = &b->metas[b->pos];
        b->scratch = b->own[b->pos];
        data[k] = reinterpret_cast<const uint8_t *>(b->copies ? &b->scratch : &b->own[b->pos]);
        kinds[k] = b->bad_kind ? 7 : b->copies ? 1 : 2;
      }
      return b->too_many ? (int)max + 1 : (int)k;
    },
    .ownership = nullptr,
};

TEST(Source, ABatchedSourceIsTakenOneTensorAtATimeInFewCalls) {
  Batched b(1300);  // two full batches of 512 and a part
  wtx_source *s = nullptr;
  ASSERT_EQ(0, wtx_source_create(&kBatchedOps, &b, &s));
  auto p = Pass(s);
  ASSERT_EQ(1300u, p.size());
  for (uint32_t k = 0; k < 1300; k++) {
    EXPECT_EQ(b.names[k], p[k].first);
    uint32_t v;
    memcpy(&v, p[k].second.data(), 4);
    EXPECT_EQ(k, v);
  }
  EXPECT_EQ(4u, b.calls);  // three batches and the end
  // One copy per call, each overwritten by the next call: every tensor is
  // still read as it was when handed out.
  b.copies = 1;
  b.calls = 0;
  p = Pass(s);
  ASSERT_EQ(1300u, p.size());
  uint32_t v;
  memcpy(&v, p[1299].second.data(), 4);
  EXPECT_EQ(1299u, v);
  EXPECT_EQ(1301u, b.calls);
  wtx_source_destroy(s);
}

// The ops' version says which members the source has: 0 (unset) and a
// version past this library's are refused.
TEST(Source, OpsOfNoVersionOrOfALaterOneAreRefused) {
  Batched b(10);
  wtx_source *s = nullptr;
  for (unsigned v : {0u, WTX_SOURCE_OPS_VERSION + 1}) {
    wtx_source_ops ops = kBatchedOps;
    ops.version = v;
    EXPECT_EQ(WTX_EINVAL, wtx_source_create(&ops, &b, &s)) << v;
    EXPECT_EQ(nullptr, s);
  }
}

TEST(Source, ABatchedSourcesRefusalsReachTheCaller) {
  wtx_source_ops none = kBatchedOps;
  none.next_batch = nullptr;
  Batched b(600);
  wtx_source *s = nullptr;
  EXPECT_EQ(WTX_EINVAL, wtx_source_create(&none, &b, &s));  // neither next nor next_batch
  ASSERT_EQ(0, wtx_source_create(&kBatchedOps, &b, &s));
  void *it = nullptr;
  wtx_tensor_meta m;
  const uint8_t *d;
  struct Case {
    const char *what;
    size_t fail_at_call;
    int bad_kind, too_many, want;
  } cases[] = {{"the second call fails", 2, 0, 0, WTX_EIO},
               {"a kind next never returns", 0, 1, 0, WTX_EINVAL},
               {"more than max", 0, 0, 1, WTX_EINVAL}};
  for (const Case &c : cases) {
    b.calls = 0;
    b.fail_at_call = c.fail_at_call;
    b.bad_kind = c.bad_kind;
    b.too_many = c.too_many;
    ASSERT_EQ(0, wtx_source_open(s, &it));
    int r = 0;
    size_t got = 0;
    while ((r = wtx_source_next(s, it, &m, &d)) == 1) got++;
    EXPECT_EQ(c.want, r) << c.what;
    EXPECT_EQ(c.fail_at_call ? 512u : 0u, got) << c.what;
    wtx_source_close(s, it);
  }
  wtx_source_destroy(s);
}

TEST(Source, SafetensorsFilesMapInFileOrder) {
  char tmpl[] = "/tmp/wtx-src-XXXXXX";
  ASSERT_NE(nullptr, mkdtemp(tmpl));
  std::string dir = tmpl;
  std::vector<uint8_t> a(64, 1), b(8, 2), c(4, 3);
  wtx_st_tensor f1[2] = {{{"model.layers.0.w", WTX_DTYPE_FLOAT32, {16}, 1, 64}, a.data()},
                         {{"model.layers.1.w", WTX_DTYPE_UINT8, {8}, 1, 8}, b.data()}};
  wtx_st_tensor f2[1] = {{{"lm_head", WTX_DTYPE_INT32, {1}, 1, 4}, c.data()}};
  std::string p1 = dir + "/model-00001.safetensors", p2 = dir + "/model-00002.safetensors";
  char err[512] = "";
  ASSERT_EQ(0, wtx_st_write(p1.c_str(), f1, 2, nullptr, 0, err, sizeof err));
  ASSERT_EQ(0, wtx_st_write(p2.c_str(), f2, 1, nullptr, 0, err, sizeof err));
  const char *paths[] = {p1.c_str(), p2.c_str()};
  wtx_source *s = nullptr;
  ASSERT_EQ(0, wtx_source_safetensors(paths, 2, &s, err, sizeof err)) << err;
  EXPECT_STREQ("safetensors", wtx_source_name(s));
  auto p = Pass(s);
  ASSERT_EQ(3u, p.size());
  EXPECT_EQ("model.layers.0.w", p[0].first);
  EXPECT_EQ(a, p[0].second);
  EXPECT_EQ("lm_head", p[2].first);
  EXPECT_EQ(c, p[2].second);
  wtx_source_destroy(s);
  // The same file twice: every name twice.
  const char *twice[] = {p1.c_str(), p1.c_str()};
  EXPECT_EQ(WTX_EINVAL, wtx_source_safetensors(twice, 2, &s, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "appears twice")) << err;
  const char *missing[] = {"/nonexistent.safetensors"};
  EXPECT_EQ(WTX_ENOENT, wtx_source_safetensors(missing, 1, &s, err, sizeof err));
  EXPECT_EQ(0, std::system(("rm -rf " + dir).c_str()));
}

TEST(Source, LayerIsTheOutermostNumericComponent) {
  uint64_t l = 0;
  EXPECT_EQ(1, wtx_param_layer("model.layers.12.mlp.experts.3.w", &l));
  EXPECT_EQ(12u, l);
  EXPECT_EQ(1, wtx_param_layer("h.0.attn", &l));
  EXPECT_EQ(0u, l);
  EXPECT_EQ(0, wtx_param_layer("model.embed_tokens.weight", &l));
  EXPECT_EQ(0, wtx_param_layer("layer12.w", &l));  // not a whole component

  wtx_tensor_meta m[6] = {};
  const char *names[] = {"embed", "l.0.a", "l.0.b", "l.1.a", "norm", "head"};
  for (int i = 0; i < 6; i++) m[i].name = names[i];
  size_t starts[6];
  ASSERT_EQ(4u, wtx_param_groups(m, 6, starts));
  EXPECT_EQ(0u, starts[0]);
  EXPECT_EQ(1u, starts[1]);
  EXPECT_EQ(3u, starts[2]);
  EXPECT_EQ(4u, starts[3]);  // norm and head: both without a layer
}

}  // namespace
