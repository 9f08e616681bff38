// The SIGBUS guard on its own: a fault in the guarded range of a mapping
// whose file shrank is an error and the process goes on (again and again:
// the handler stays and SIGBUS is unblocked after each jump); a fault
// anywhere else still kills, as without the guard.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <vector>

#include "transport/sigbus.h"
#include "wtx/error.h"

namespace {

// A file of two pages mapped read-only, then cut to one: reading the second
// page of the mapping raises SIGBUS.
struct Shrunk {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  int fd = -1;
  const uint8_t *map = nullptr;
  Shrunk() {
    fd = memfd_create("sigbus-test", 0);
    if (fd < 0 || ftruncate(fd, static_cast<off_t>(2 * page)) != 0) abort();
    void *m = mmap(nullptr, 2 * page, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED || ftruncate(fd, static_cast<off_t>(page)) != 0) abort();
    map = static_cast<const uint8_t *>(m);
  }
  ~Shrunk() {
    munmap(const_cast<uint8_t *>(map), 2 * page);
    close(fd);
  }
};

struct Copy {
  const uint8_t *src;
  size_t len;
  std::vector<uint8_t> dst;
  size_t done = 0;
};

int CopyAll(void *arg) {
  Copy *c = static_cast<Copy *>(arg);
  c->dst.resize(c->len);
  for (size_t o = 0; o < c->len; o += 64) {
    std::memcpy(c->dst.data() + o, c->src + o, 64);
    c->done = o + 64;
  }
  return 7;
}

TEST(SigbusTest, AFaultInTheGuardedRangeIsAnError) {
  Shrunk s;
  for (int i = 0; i < 3; i++) {  // the handler stays, SIGBUS is not left blocked
    Copy c{s.map, 2 * s.page, {}};
    EXPECT_EQ(WTX_EIO, wtx__sigbus_guard(s.map, 2 * s.page, CopyAll, &c));
    EXPECT_EQ(s.page, c.done) << "the first page copies, the second faults";
  }
  sigset_t now;
  ASSERT_EQ(0, pthread_sigmask(SIG_SETMASK, nullptr, &now));
  EXPECT_FALSE(sigismember(&now, SIGBUS));
}

TEST(SigbusTest, WithoutAFaultFnsResultComesBack) {
  Shrunk s;
  Copy c{s.map, s.page, {}};
  EXPECT_EQ(7, wtx__sigbus_guard(s.map, s.page, CopyAll, &c));
  EXPECT_EQ(s.page, c.done);
}

// Guards the first page only; the copy faults on the second.
void FaultPastTheGuardedRange() {
  Shrunk s;
  Copy c{s.map, 2 * s.page, {}};
  wtx__sigbus_guard(s.map, s.page, CopyAll, &c);
  _exit(0);
}

// The handler is installed by a guard that ended; then an unguarded fault.
void FaultWithNoGuard() {
  Shrunk s;
  Copy g{s.map, s.page, {}};
  wtx__sigbus_guard(s.map, s.page, CopyAll, &g);
  Copy c{s.map, 2 * s.page, {}};
  CopyAll(&c);
  _exit(0);
}

// Killed by the fault: by SIGBUS itself, or, under ASan, by its handler
// (there before the guard's), which reports and then aborts or exits.
bool DiedOfTheFault(int status) {
  if (WIFSIGNALED(status)) return WTERMSIG(status) == SIGBUS || WTERMSIG(status) == SIGABRT;
  return WIFEXITED(status) && WEXITSTATUS(status) != 0;
}

TEST(SigbusTest, AFaultOutsideTheGuardedRangeStillKills) {
  EXPECT_EXIT(FaultPastTheGuardedRange(), DiedOfTheFault, "");
}

TEST(SigbusTest, AFaultOutsideAnyGuardStillKills) {
  EXPECT_EXIT(FaultWithNoGuard(), DiedOfTheFault, "");
}

}  // namespace
