// The string -> index map the worker uses for update names and the store's
// index: each key once, found again after growth, cleared for reuse.
#include "common/strmap.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "wtx/error.h"

namespace {

TEST(StrmapTest, AddsFindsAndRefusesDuplicates) {
  wtx__strmap *m = nullptr;
  ASSERT_EQ(0, wtx__strmap_create(&m));
  EXPECT_EQ(0u, wtx__strmap_count(m));
  EXPECT_EQ(0, wtx__strmap_get(m, "a", nullptr));
  ASSERT_EQ(0, wtx__strmap_add(m, "a", 7, nullptr));
  ASSERT_EQ(0, wtx__strmap_add(m, "", 8, nullptr));  // the empty key is a key
  EXPECT_EQ(WTX_EEXIST, wtx__strmap_add(m, "a", 9, nullptr));
  size_t v = 0;
  ASSERT_EQ(1, wtx__strmap_get(m, "a", &v));
  EXPECT_EQ(7u, v);  // the duplicate left the value alone
  ASSERT_EQ(1, wtx__strmap_get(m, "", &v));
  EXPECT_EQ(8u, v);
  EXPECT_EQ(0, wtx__strmap_get(m, "b", &v));
  EXPECT_EQ(2u, wtx__strmap_count(m));
  wtx__strmap_destroy(m);
}

TEST(StrmapTest, KeysAreCopied) {
  wtx__strmap *m = nullptr;
  ASSERT_EQ(0, wtx__strmap_create(&m));
  char key[] = "layer.0.weight";
  const char *stored = nullptr;
  ASSERT_EQ(0, wtx__strmap_add(m, key, 1, &stored));
  key[0] = 'X';
  EXPECT_STREQ("layer.0.weight", stored);  // the map's copy, not the caller's
  EXPECT_EQ(1, wtx__strmap_get(m, "layer.0.weight", nullptr));
  EXPECT_EQ(0, wtx__strmap_get(m, key, nullptr));
  wtx__strmap_destroy(m);
}

// A borrowed key (an owner that holds the names already indexes them
// without a second copy) is found, refused twice whether borrowed or
// copied, and sits beside copied keys.
TEST(StrmapTest, BorrowedKeysAreFoundAndRefusedTwiceBesideCopiedOnes) {
  wtx__strmap *m = nullptr;
  ASSERT_EQ(0, wtx__strmap_create(&m));
  char key[] = "layer.0.weight";
  ASSERT_EQ(0, wtx__strmap_add_borrowed(m, key, 7));
  ASSERT_EQ(0, wtx__strmap_add(m, "layer.1.weight", 8, nullptr));
  size_t v = 0;
  EXPECT_EQ(1, wtx__strmap_get(m, "layer.0.weight", &v));
  EXPECT_EQ(7u, v);
  EXPECT_EQ(WTX_EEXIST, wtx__strmap_add(m, "layer.0.weight", 9, nullptr));
  EXPECT_EQ(WTX_EEXIST, wtx__strmap_add_borrowed(m, "layer.1.weight", 9));
  EXPECT_EQ(2u, wtx__strmap_count(m));
  wtx__strmap_clear(m);
  EXPECT_EQ(0, wtx__strmap_get(m, key, nullptr));
  EXPECT_EQ(0, wtx__strmap_add_borrowed(m, key, 1));  // usable after clear
  EXPECT_EQ(1, wtx__strmap_get(m, "layer.0.weight", nullptr));
  wtx__strmap_destroy(m);
}

// The first name seen a second time, read through a stride as the callers
// read tensor tables: NULL when every name is new, in O(n).
TEST(StrmapTest, FindsTheFirstDuplicateName) {
  struct entry {
    const char *name;  // first, as in wtx_tensor_meta
    double other;
  };
  std::vector<std::string> names;
  for (size_t i = 0; i < 40000; i++)
    names.push_back("model.layers." + std::to_string(i / 100) + ".experts." +
                    std::to_string(i % 100) + ".w");
  std::vector<entry> es;
  for (const auto &n : names) es.push_back({n.c_str(), 0});
  int rc = -1;
  EXPECT_EQ(nullptr, wtx__strmap_first_duplicate(es.data(), es.size(), sizeof(entry), &rc));
  EXPECT_EQ(0, rc);
  std::string again = names[123], later = names[7];
  es[30000].name = again.c_str();  // the first name seen twice
  es[35000].name = later.c_str();
  const char *dup = wtx__strmap_first_duplicate(es.data(), es.size(), sizeof(entry), &rc);
  EXPECT_EQ(0, rc);
  EXPECT_EQ(again.c_str(), dup);  // the second occurrence, the caller's pointer
  EXPECT_EQ(nullptr, wtx__strmap_first_duplicate(es.data(), 0, sizeof(entry), &rc));
  EXPECT_EQ(0, rc);
  const char *bare[] = {"", "a", ""};  // a plain array of names; "" is a name
  EXPECT_EQ(bare[2], wtx__strmap_first_duplicate(bare, 3, sizeof bare[0], &rc));
}

TEST(StrmapTest, HoldsAHundredThousandNamesAndClears) {
  wtx__strmap *m = nullptr;
  ASSERT_EQ(0, wtx__strmap_create(&m));
  const size_t n = 100000;  // an MoE checkpoint's parameter count
  for (size_t i = 0; i < n; i++)
    ASSERT_EQ(0, wtx__strmap_add(m, ("model.layers." + std::to_string(i)).c_str(), i, nullptr));
  EXPECT_EQ(n, wtx__strmap_count(m));
  for (size_t i = 0; i < n; i += 997) {
    size_t v = 0;
    ASSERT_EQ(1, wtx__strmap_get(m, ("model.layers." + std::to_string(i)).c_str(), &v));
    EXPECT_EQ(i, v);
  }
  wtx__strmap_clear(m);
  EXPECT_EQ(0u, wtx__strmap_count(m));
  EXPECT_EQ(0, wtx__strmap_get(m, "model.layers.5", nullptr));
  ASSERT_EQ(0, wtx__strmap_add(m, "model.layers.5", 3, nullptr));  // usable after clear
  wtx__strmap_destroy(m);
}

// Reserved ahead (empty or not), grown past a reservation, or cleared and
// filled again: every key is found with its value, none twice. Filled as
// the session and the store fill theirs, prefetching the key a few adds
// ahead (present or not, into a table that may grow before it is added).
TEST(StrmapTest, ATableReservedOrGrownFindsEveryKey) {
  wtx__strmap *m = nullptr;
  ASSERT_EQ(0, wtx__strmap_create(&m));
  auto key = [](size_t i) { return "model.layers." + std::to_string(i / 64) + ".e" +
                                   std::to_string(i); };
  auto fill = [&](size_t from, size_t to) {
    for (size_t i = from; i < to; i++) {
      wtx__strmap_prefetch(m, key(i + 8).c_str());
      wtx__strmap_prefetch(m, key(i / 2).c_str());
      ASSERT_EQ(0, wtx__strmap_add(m, key(i).c_str(), i, nullptr));
    }
  };
  auto expect_all = [&](size_t n) {
    EXPECT_EQ(n, wtx__strmap_count(m));
    for (size_t i = 0; i < n; i++) {
      size_t v = n;
      ASSERT_EQ(1, wtx__strmap_get(m, key(i).c_str(), &v)) << i;
      ASSERT_EQ(i, v);
      ASSERT_EQ(WTX_EEXIST, wtx__strmap_add(m, key(i).c_str(), 0, nullptr));
    }
  };
  wtx__strmap_reserve(m, 5000);  // empty: the table is made this size
  fill(0, 3000);
  wtx__strmap_reserve(m, 40000);  // not empty: the table grows, keys stay
  fill(3000, 50000);              // and past the reservation
  expect_all(50000);
  wtx__strmap_clear(m);
  EXPECT_EQ(0, wtx__strmap_get(m, key(7).c_str(), nullptr));
  fill(0, 20000);
  expect_all(20000);
  wtx__strmap_clear(m);
  wtx__strmap_reserve(m, 100);  // smaller than the last table, then past it
  fill(0, 3000);
  expect_all(3000);
  wtx__strmap_destroy(m);
  ASSERT_EQ(0, wtx__strmap_create(&m));
  wtx__strmap_reserve(m, SIZE_MAX);  // capped, not 2^64 buckets: empty,
  fill(0, 3);
  wtx__strmap_reserve(m, SIZE_MAX);  // and holding keys
  expect_all(3);
  wtx__strmap_destroy(m);
}

}  // namespace
