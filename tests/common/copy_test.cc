// wtx__copy_stream: the same bytes as memcpy at every alignment and length
// around the 64-byte lines it stores whole, and nothing outside [dst, +n).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {
#include "common/copy.h"
}

TEST(CopyStream, SameBytesAsMemcpyAtEveryAlignmentAndLength) {
  std::vector<uint8_t> src(4096 + 128), dst(4096 + 256);
  for (size_t i = 0; i < src.size(); i++) src[i] = static_cast<uint8_t>(i * 131 + 7);
  const size_t lens[] = {0, 1, 15, 63, 64, 65, 127, 128, 129, 1000, 4096};
  for (size_t n : lens)
    for (size_t so = 0; so < 64; so += 7)
      for (size_t dofs = 0; dofs < 64; dofs += 5) {
        std::fill(dst.begin(), dst.end(), 0xEE);
        uint8_t *d = dst.data() + 64 + dofs;
        wtx__copy_stream(d, src.data() + so, n);
        ASSERT_EQ(0, memcmp(d, src.data() + so, n)) << n << " " << so << " " << dofs;
        for (uint8_t *p = dst.data(); p < d; p++) ASSERT_EQ(0xEE, *p) << "before, n " << n;
        for (uint8_t *p = d + n; p < dst.data() + dst.size(); p++)
          ASSERT_EQ(0xEE, *p) << "after, n " << n;
      }
}
