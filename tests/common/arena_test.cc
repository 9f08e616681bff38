// The bump allocator: aligned pieces that never overlap, large pieces
// beside the open block instead of closing it, and a free that leaves the
// arena usable.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/arena.h"

namespace {

TEST(ArenaTest, PiecesAreAlignedAndNeverOverlap) {
  wtx__arena a = WTX__ARENA_INIT;
  std::vector<std::pair<uint8_t *, size_t>> pieces;
  for (size_t i = 0; i < 5000; i++) {
    size_t n = (i * 37) % 300 + (i % 97 == 0 ? 40000 : 0);  // some beyond a block
    auto *p = static_cast<uint8_t *>(wtx__arena_alloc(&a, n));
    ASSERT_NE(nullptr, p);
    EXPECT_EQ(0u, reinterpret_cast<uintptr_t>(p) % alignof(std::max_align_t)) << i;
    memset(p, static_cast<int>(i & 0xff), n);
    pieces.emplace_back(p, n);
  }
  for (size_t i = 0; i < pieces.size(); i++)
    for (size_t k = 0; k < pieces[i].second; k++)
      ASSERT_EQ(static_cast<uint8_t>(i & 0xff), pieces[i].first[k]) << "piece " << i;
  wtx__arena_free(&a);
  EXPECT_EQ(nullptr, a.blocks);
  EXPECT_NE(nullptr, wtx__arena_alloc(&a, 16));  // usable again
  wtx__arena_free(&a);
}

#ifndef __SANITIZE_ADDRESS__  // there every piece has a block of its own
TEST(ArenaTest, ALargePieceLeavesTheOpenBlockOpen) {
  wtx__arena a = WTX__ARENA_INIT;
  auto *x = static_cast<char *>(wtx__arena_alloc(&a, 16));
  ASSERT_NE(nullptr, wtx__arena_alloc(&a, 1 << 20));
  auto *y = static_cast<char *>(wtx__arena_alloc(&a, 16));
  EXPECT_EQ(x + 16, y) << "the small pieces share their block";
  wtx__arena_free(&a);
}
#endif

}  // namespace
