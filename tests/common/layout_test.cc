// Parameter tables: names interned and refused twice, and the table's
// identity exactly as wtx.v1's ParamRange defines it (a trainer in another
// language computes it from that text).
#include "common/layout.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <string>
#include <vector>

#include "wtx/error.h"

namespace {

wtx_tensor_meta Meta(const char *name, int dtype, std::vector<uint64_t> shape) {
  wtx_tensor_meta m{};
  char err[128];
  EXPECT_EQ(0, wtx_tensor_meta_set(&m, name, dtype, shape.data(), shape.size(), err,
                                   sizeof err)) << err;
  return m;
}

void Le(std::string *b, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; i++) b->push_back(static_cast<char>(v >> (8 * i)));
}

TEST(LayoutTest, TheIdentityIsXxh3OfTheDocumentedBytes) {
  std::vector<wtx_tensor_meta> m = {Meta("w", WTX_DTYPE_BFLOAT16, {2, 3}),
                                    Meta("b", WTX_DTYPE_FLOAT32, {})};
  std::string bytes = std::string("w") + '\0';
  Le(&bytes, WTX_DTYPE_BFLOAT16, 4);
  Le(&bytes, 2, 4);
  Le(&bytes, 2, 8);
  Le(&bytes, 3, 8);
  bytes += std::string("b") + '\0';
  Le(&bytes, WTX_DTYPE_FLOAT32, 4);
  Le(&bytes, 0, 4);
  EXPECT_EQ(XXH3_64bits(bytes.data(), bytes.size()), wtx__layout_xxh3(m.data(), m.size()));
  // Order, shape and dtype are all part of it.
  std::vector<wtx_tensor_meta> swapped = {m[1], m[0]};
  EXPECT_NE(wtx__layout_xxh3(m.data(), 2), wtx__layout_xxh3(swapped.data(), 2));
  std::vector<wtx_tensor_meta> reshaped = {Meta("w", WTX_DTYPE_BFLOAT16, {3, 2}), m[1]};
  EXPECT_NE(wtx__layout_xxh3(m.data(), 2), wtx__layout_xxh3(reshaped.data(), 2));
}

// The identity of a table larger than the pieces it is hashed in (and of
// a name longer than a piece, which no valid meta has) is the XXH3 of all
// its bytes at once.
TEST(LayoutTest, TheIdentityOfALargeTableIsTheHashOfAllItsBytes) {
  std::vector<std::string> names;
  for (int i = 0; i < 5000; i++) names.push_back(std::string(1 + i % 90, 'a' + i % 26));
  names[2500] = std::string(70000, 'x');
  std::vector<wtx_tensor_meta> m;
  std::string bytes;
  for (int i = 0; i < 5000; i++) {
    wtx_tensor_meta t = Meta("n", WTX_DTYPE_INT8, std::vector<uint64_t>(i % 4, 3));
    t.name = names[i].c_str();
    m.push_back(t);
    bytes += names[i] + '\0';
    Le(&bytes, WTX_DTYPE_INT8, 4);
    Le(&bytes, i % 4, 4);
    for (int d = 0; d < i % 4; d++) Le(&bytes, 3, 8);
  }
  EXPECT_EQ(XXH3_64bits(bytes.data(), bytes.size()), wtx__layout_xxh3(m.data(), m.size()));
}

TEST(LayoutTest, NamesAreCopiedAndRefusedTwice) {
  wtx__layout l;
  ASSERT_EQ(0, wtx__layout_init(&l));
  char name[] = "layer.0";
  wtx_tensor_meta m = Meta(name, WTX_DTYPE_UINT8, {4});
  ASSERT_EQ(0, wtx__layout_add(&l, &m));
  name[0] = 'X';
  EXPECT_STREQ("layer.0", l.metas[0].name);
  wtx_tensor_meta again = Meta("layer.0", WTX_DTYPE_UINT8, {8});
  EXPECT_EQ(WTX_EEXIST, wtx__layout_add(&l, &again));
  EXPECT_EQ(1u, l.n);
  wtx__layout other;
  ASSERT_EQ(0, wtx__layout_init(&other));
  wtx__layout_swap(&l, &other);
  EXPECT_EQ(0u, l.n);
  EXPECT_EQ(1u, other.n);
  wtx__layout_clear(&other);
  EXPECT_EQ(0, wtx__layout_add(&other, &again));  // usable after clear
  wtx__layout_free(&l);
  wtx__layout_free(&other);
}

// A caller may fill the table's next slots itself and add each from where
// it lies (the worker checks a chunk's params straight into its table):
// room made first, the slots do not move while they are added, each name
// is interned as from a copy, and a name refused leaves the table as it was.
TEST(LayoutTest, MetasFilledInTheTablesOwnSlotsAreAddedWhereTheyLie) {
  wtx__layout l;
  ASSERT_EQ(0, wtx__layout_init(&l));
  wtx_tensor_meta first = Meta("embed", WTX_DTYPE_UINT8, {2});
  ASSERT_EQ(0, wtx__layout_add(&l, &first));
  ASSERT_EQ(0, wtx__layout_room(&l, 1000));
  const wtx_tensor_meta *slots = &l.metas[l.n];
  std::vector<std::string> names;
  for (int i = 0; i < 1000; i++) names.push_back("layers." + std::to_string(i) + ".w");
  for (int i = 0; i < 1000; i++) {
    wtx_tensor_meta *slot = &l.metas[l.n];
    *slot = Meta(names[i].c_str(), WTX_DTYPE_UINT8, {static_cast<uint64_t>(i + 1)});
    ASSERT_EQ(0, wtx__layout_add(&l, slot)) << i;
    ASSERT_EQ(slots, &l.metas[1]) << "the slots moved at " << i;
  }
  for (auto &n : names) n[0] = 'X';  // the caller's strings change: the table's do not
  ASSERT_EQ(1001u, l.n);
  EXPECT_STREQ("layers.0.w", l.metas[1].name);
  EXPECT_STREQ("layers.999.w", l.metas[1000].name);
  EXPECT_EQ(1000u, l.metas[1000].nbytes);
  EXPECT_EQ(2u + 1000u * 1001u / 2, wtx__layout_bytes(&l, 0, l.n));
  // A repeat in the slot: refused, nothing added.
  wtx_tensor_meta *slot = &l.metas[l.n];
  *slot = Meta("layers.5.w", WTX_DTYPE_UINT8, {7});
  EXPECT_EQ(WTX_EEXIST, wtx__layout_add(&l, slot));
  EXPECT_EQ(1001u, l.n);
  EXPECT_EQ(2u + 1000u * 1001u / 2, wtx__layout_bytes(&l, 0, l.n));
  wtx__layout_free(&l);
}

// The bytes of any run of a table's tensors, in O(1) (a by-position chunk
// of 8192 tensors counts its bytes without reading their metas), across the
// growth of its arrays and after a clear.
TEST(LayoutTest, TheBytesOfAnyRunOfTensorsAreTheirSizesSummed) {
  wtx__layout l;
  ASSERT_EQ(0, wtx__layout_init(&l));
  std::vector<std::string> names;
  for (int i = 0; i < 300; i++) names.push_back("t" + std::to_string(i));
  for (int round = 0; round < 2; round++) {
    wtx__layout_clear(&l);
    for (uint64_t i = 0; i < 300; i++) {
      wtx_tensor_meta m = Meta(names[i].c_str(), WTX_DTYPE_FLOAT32, {i % 7 + round});
      ASSERT_EQ(0, wtx__layout_add(&l, &m));
    }
    for (size_t first = 0; first <= 300; first += 37)
      for (size_t n = 0; first + n <= 300; n += 29) {
        uint64_t sum = 0;
        for (size_t i = first; i < first + n; i++) sum += l.metas[i].nbytes;
        EXPECT_EQ(sum, wtx__layout_bytes(&l, first, n)) << first << "+" << n;
      }
  }
  wtx__layout_free(&l);
}

}  // namespace
