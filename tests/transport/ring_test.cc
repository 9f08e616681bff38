// The shared-memory ring of tcp's many senders on one host (transport/
// ring.h): bytes arrive whole and in order however the ring wraps, only
// this user's "/wtx-" rings open, and every wait ends on its deadline, a
// cancel, the other side closing the ring or its socket closing.
#include "transport/ring.h"

#include <gtest/gtest.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/clock.h"
#include "wtx/error.h"

namespace {

struct Pair {  // the worker's ring and the sender's view of it
  wtx__ring *reader = nullptr, *writer = nullptr;
  char name[128] = "", err[256] = "";
  explicit Pair(size_t cap) {
    EXPECT_EQ(0, wtx__ring_create(cap, &reader, name, sizeof name, err, sizeof err)) << err;
    EXPECT_EQ(0, wtx__ring_open(name, &writer, err, sizeof err)) << err;
    wtx__ring_unlink(name);
  }
  ~Pair() {
    wtx__ring_destroy(writer);
    wtx__ring_destroy(reader);
  }
};

wtx__ring_wait Within(int64_t ms, int cancel_fd = -1, int peer_fd = -1) {
  return {wtx__clock_ms() + ms, cancel_fd, peer_fd};
}

TEST(Ring, BytesArriveWholeAndInOrderAcrossTheWrap) {
  Pair p(1000);  // smaller than what goes through it: it wraps, and the writer waits
  std::vector<uint8_t> in(100000), out(in.size());
  for (size_t i = 0; i < in.size(); i++) in[i] = static_cast<uint8_t>(i * 31 + i / 7);
  int wrc = -1;
  std::thread t([&] {
    const char *why = "";
    std::vector<iovec> v;
    for (size_t at = 0; at < in.size(); at += 777)
      v.push_back({in.data() + at, std::min<size_t>(777, in.size() - at)});
    wtx__ring_wait w = Within(10000);
    wrc = wtx__ring_put(p.writer, v.data(), v.size(), &w, &why);
  });
  const char *why = "";
  wtx__ring_wait w = Within(10000);
  ASSERT_EQ(0, wtx__ring_take(p.reader, out.data(), nullptr, nullptr, 50000, &w, &why)) << why;
  struct Sink {
    std::vector<uint8_t> *out;
    size_t at;
  } sink{&out, 50000};
  auto fn = [](void *arg, const uint8_t *b, size_t k) {
    auto *s = static_cast<Sink *>(arg);
    memcpy(s->out->data() + s->at, b, k);
    s->at += k;
    return 0;
  };
  ASSERT_EQ(0, wtx__ring_take(p.reader, nullptr, fn, &sink, 50000, &w, &why)) << why;
  t.join();
  EXPECT_EQ(0, wrc);
  EXPECT_TRUE(in == out);
}

TEST(Ring, OnlyThisUsersWtxRingsOpen) {
  wtx__ring *r = nullptr;
  char err[256];
  EXPECT_NE(0, wtx__ring_open("/not-ours", &r, err, sizeof err));
  EXPECT_NE(0, wtx__ring_open("/wtx-ring-gone", &r, err, sizeof err));
  Pair p(64);  // once unlinked, its name opens no more
  EXPECT_NE(0, wtx__ring_open(p.name, &r, err, sizeof err));
}

TEST(Ring, AWaitEndsOnItsDeadlineACancelAClosedRingOrAClosedSocket) {
  Pair p(64);
  uint8_t b[128] = {0};
  const char *why = "";
  wtx__ring_wait w = Within(50);
  EXPECT_EQ(WTX_ETIMEDOUT, wtx__ring_take(p.reader, b, nullptr, nullptr, 1, &w, &why));
  int cancel = eventfd(1, EFD_CLOEXEC);  // written already
  w = Within(60000, cancel);
  EXPECT_EQ(WTX_ECANCELED, wtx__ring_take(p.reader, b, nullptr, nullptr, 1, &w, &why));
  close(cancel);
  int sv[2];
  ASSERT_EQ(0, socketpair(AF_UNIX, SOCK_STREAM, 0, sv));
  close(sv[1]);  // the peer's process is gone
  w = Within(60000, -1, sv[0]);
  EXPECT_EQ(WTX_EIO, wtx__ring_take(p.reader, b, nullptr, nullptr, 1, &w, &why));
  EXPECT_STREQ("peer closed the connection", why);
  close(sv[0]);
  // A writer with no room left fails at once when the reader gives up.
  iovec v = {b, sizeof b};
  int rc = -1;
  std::thread t([&] {
    wtx__ring_wait tw = Within(60000);
    const char *twhy = "";
    rc = wtx__ring_put(p.writer, &v, 1, &tw, &twhy);
  });
  wtx__ring_close(p.reader);
  t.join();
  EXPECT_EQ(WTX_EIO, rc);
}

}  // namespace
