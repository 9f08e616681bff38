// Element patches: diff, check and apply, as the trainer and the worker
// use them. The property: for random tensors of every element size and
// random changes (NaN bit patterns among them), diff then apply on the old
// bytes gives the new bytes exactly, and check accepts what diff made.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "common/patch.h"
#include "wtx/error.h"

namespace {

wtx_tensor_meta Meta(int dtype, uint64_t elements) {
  wtx_tensor_meta m;
  char err[128];
  EXPECT_EQ(0, wtx_tensor_meta_set(&m, "w", dtype, &elements, 1, err, sizeof err)) << err;
  return m;
}

TEST(PatchTest, DiffThenApplyGivesBackTheNewBytesForEveryElementSize) {
  std::mt19937_64 rng(7);
  const int dtypes[] = {WTX_DTYPE_INT8, WTX_DTYPE_BFLOAT16, WTX_DTYPE_FLOAT32,
                        WTX_DTYPE_FLOAT64};
  for (int round = 0; round < 400; round++) {
    int dtype = dtypes[round % 4];
    size_t es = wtx_dtype_size(dtype);
    uint64_t elements = 1 + rng() % 3000;
    wtx_tensor_meta m = Meta(dtype, elements);
    std::vector<uint8_t> prev(m.nbytes), cur;
    for (auto &b : prev) b = static_cast<uint8_t>(rng());
    cur = prev;
    uint64_t changes = rng() % (elements + 1);
    for (uint64_t k = 0; k < changes; k++) {
      uint64_t at = rng() % elements;
      if (es == 4 && k % 3 == 0) {
        uint32_t nan = 0x7fc00000u | static_cast<uint32_t>(rng() & 0xff);  // a NaN
        memcpy(&cur[at * 4], &nan, 4);
      } else {
        cur[at * es + rng() % es] ^= static_cast<uint8_t>(1 + rng() % 255);
      }
    }
    int idt = round % 8 < 4 ? WTX_DTYPE_INT32 : WTX_DTYPE_INT64;
    std::vector<uint8_t> out(wtx__patch_bytes(idt, elements, es) + 1);
    uint64_t n = wtx__patch_diff(cur.data(), prev.data(), m.nbytes, es, idt, elements, out.data());
    ASSERT_LE(n, elements);
    uint64_t differ = 0;
    for (uint64_t i = 0; i < elements; i++) differ += memcmp(&cur[i * es], &prev[i * es], es) != 0;
    EXPECT_EQ(differ, n) << "round " << round;
    if (n == 0) {
      EXPECT_EQ(prev, cur);
      continue;
    }
    char err[256] = "";
    ASSERT_EQ(0, wtx__patch_check(&m, idt, n, out.data(), wtx__patch_bytes(idt, n, es), err,
                                  sizeof err)) << err;
    std::vector<uint8_t> applied = prev;
    wtx__patch_apply(&m, idt, n, out.data(), applied.data());
    ASSERT_EQ(cur, applied) << "round " << round;
    // A bound below the count stops the diff.
    EXPECT_EQ(n, wtx__patch_diff(cur.data(), prev.data(), m.nbytes, es, idt, n - 1,
                                 out.data()));
  }
}

// A patch of '' with the indices given, as int32, and zero values.
std::vector<uint8_t> Patch(const std::vector<uint32_t> &idx, size_t es) {
  std::vector<uint8_t> b(idx.size() * (4 + es));
  memcpy(b.data(), idx.data(), idx.size() * 4);
  return b;
}

TEST(PatchTest, EachMalformedPatchIsRefusedNamingWhatIsWrong) {
  wtx_tensor_meta m = Meta(WTX_DTYPE_FLOAT32, 100);
  char err[256] = "";
  auto check = [&](int idt, uint64_t count, const std::vector<uint8_t> &b, uint64_t len) {
    err[0] = '\0';
    return wtx__patch_check(&m, idt, count, b.data(), len, err, sizeof err);
  };
  auto ok = Patch({1, 5, 99}, 4);
  EXPECT_EQ(0, check(WTX_DTYPE_INT32, 3, ok, ok.size())) << err;
  auto past = Patch({1, 5, 100}, 4);
  EXPECT_EQ(WTX_EINVAL, check(WTX_DTYPE_INT32, 3, past, past.size()));
  EXPECT_NE(nullptr, strstr(err, "index 2 of 3 is past the tensor's elements")) << err;
  auto twice = Patch({1, 5, 5}, 4);
  EXPECT_EQ(WTX_EINVAL, check(WTX_DTYPE_INT32, 3, twice, twice.size()));
  EXPECT_NE(nullptr, strstr(err, "none repeats")) << err;
  auto back = Patch({7, 5}, 4);
  EXPECT_EQ(WTX_EINVAL, check(WTX_DTYPE_INT32, 2, back, back.size()));
  EXPECT_NE(nullptr, strstr(err, "index 1 of 2 is not above")) << err;
  EXPECT_EQ(WTX_EINVAL, check(WTX_DTYPE_INT32, 3, ok, ok.size() - 1));
  EXPECT_NE(nullptr, strstr(err, "indices and values of FLOAT32 take 24")) << err;
  EXPECT_EQ(WTX_EINVAL, check(WTX_DTYPE_INT16, 3, ok, ok.size()));
  EXPECT_NE(nullptr, strstr(err, "patch.index_dtype: must be INT32 or INT64")) << err;
  EXPECT_EQ(WTX_EINVAL, check(WTX_DTYPE_INT32, 0, ok, 0));
  EXPECT_NE(nullptr, strstr(err, "patch.count: 0")) << err;
  EXPECT_EQ(WTX_EINVAL, check(WTX_DTYPE_INT32, 101, ok, 101 * 8));
  EXPECT_NE(nullptr, strstr(err, "must be 1..100")) << err;
  // Past 2^31 elements an index needs 64 bits.
  wtx_tensor_meta big = Meta(WTX_DTYPE_INT8, (UINT64_C(1) << 31) + 1);
  EXPECT_EQ(WTX_EINVAL, wtx__patch_check(&big, WTX_DTYPE_INT32, 1, nullptr, 5, err, sizeof err));
  EXPECT_NE(nullptr, strstr(err, "must be INT64")) << err;
  EXPECT_EQ(0, wtx__patch_check(&big, WTX_DTYPE_INT64, 1, nullptr, 9, err, sizeof err)) << err;
  EXPECT_EQ(WTX_DTYPE_INT64, wtx__patch_index_dtype((UINT64_C(1) << 31) + 1));
  EXPECT_EQ(WTX_DTYPE_INT32, wtx__patch_index_dtype(UINT64_C(1) << 31));
}

// A caller's patch cut to a box of the tensor (a tensor-parallel worker's
// slice) is the patch of the box: for random shapes, boxes and patches,
// applying the cut to the box read out of the old tensor gives the box
// read out of the patched tensor, and the cut's indices increase; and
// applied where the box lies in the old tensor (wtx__patch_apply_box, a
// worker patching a trainer rank's box), it gives the patched tensor in
// the box and the old one outside it.
TEST(PatchTest, ACutPatchAppliedToABoxGivesThatBoxOfThePatchedTensor) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 500; round++) {
    size_t ndim = 1 + rng() % 3, es = (round % 2) ? 2 : 4;
    uint64_t shape[3], lo[3], len[3], elements = 1, box_elements = 1;
    for (size_t d = 0; d < ndim; d++) {
      shape[d] = 1 + rng() % 9;
      lo[d] = rng() % shape[d];
      len[d] = 1 + rng() % (shape[d] - lo[d]);
      elements *= shape[d];
      box_elements *= len[d];
    }
    std::vector<uint8_t> old(elements * es);
    for (auto &b : old) b = static_cast<uint8_t>(rng());
    std::vector<int64_t> at;  // a random increasing subset, as int64 indices
    for (uint64_t i = 0; i < elements; i++)
      if (rng() % 3 == 0) at.push_back(static_cast<int64_t>(i));
    std::vector<uint8_t> values(at.size() * es);
    for (auto &b : values) b = static_cast<uint8_t>(rng());
    std::vector<uint8_t> now = old;
    for (size_t k = 0; k < at.size(); k++) memcpy(&now[at[k] * es], &values[k * es], es);
    auto box_of = [&](const std::vector<uint8_t> &t) {  // row-major, element by element
      std::vector<uint8_t> b;
      for (uint64_t i = 0; i < elements; i++) {
        uint64_t r = i;
        bool in = true;
        for (size_t d = ndim; d-- > 0; r /= shape[d])
          in = in && r % shape[d] >= lo[d] && r % shape[d] < lo[d] + len[d];
        if (in) b.insert(b.end(), &t[i * es], &t[i * es] + es);
      }
      return b;
    };
    std::vector<int64_t> idx(at.size() + 1);
    std::vector<uint8_t> val(values.size() + 1);
    uint64_t m = wtx__patch_cut(shape, ndim, lo, len, WTX_DTYPE_INT64, at.size(), at.data(),
                                values.data(), es, idx.data(), val.data());
    std::vector<uint8_t> box = box_of(old);
    ASSERT_EQ(box_elements * es, box.size());
    for (uint64_t k = 0; k < m; k++) {
      ASSERT_LT(static_cast<uint64_t>(idx[k]), box_elements) << "round " << round;
      if (k > 0) {
        ASSERT_LT(idx[k - 1], idx[k]) << "round " << round;
      }
      memcpy(&box[idx[k] * es], &val[k * es], es);
    }
    EXPECT_EQ(box_of(now), box) << "round " << round;
    std::vector<uint8_t> wire(m * (8 + es) + 1), in_place = old;
    memcpy(wire.data(), idx.data(), m * 8);
    memcpy(wire.data() + m * 8, val.data(), m * es);
    wtx__patch_apply_box(shape, ndim, lo, len, WTX_DTYPE_INT64, m, wire.data(), es,
                         in_place.data());
    for (uint64_t i = 0; i < elements; i++) {
      uint64_t r = i;
      bool in = true;
      for (size_t d = ndim; d-- > 0; r /= shape[d])
        in = in && r % shape[d] >= lo[d] && r % shape[d] < lo[d] + len[d];
      const std::vector<uint8_t> &want = in ? now : old;
      ASSERT_EQ(0, memcmp(&want[i * es], &in_place[i * es], es)) << "round " << round << ", "
                                                                  << i;
    }
  }
}

}  // namespace
