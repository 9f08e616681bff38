// Waiting on a directory's state in tests: a publisher writes its files
// (and renames LATEST into place) on a thread of its own, after the call
// that published has answered. The wait wakes on the directory's inotify
// events, never on a timer, and is bounded.
#ifndef WTX_TESTS_COMMON_DIR_WAIT_H
#define WTX_TESTS_COMMON_DIR_WAIT_H

#include <poll.h>
#include <sys/inotify.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <string>

namespace wtxtest {

// Waits until done() holds, at most timeout_ms, re-asking it after each
// change in dir (a file created, written, renamed in or deleted). Returns
// done()'s last answer.
inline bool WaitInDir(const std::string &dir, const std::function<bool()> &done,
                      int timeout_ms = 10000) {
  int fd = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
  if (fd >= 0)
    inotify_add_watch(fd, dir.c_str(), IN_CREATE | IN_CLOSE_WRITE | IN_MOVED_TO | IN_DELETE);
  auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  bool ok = done(); // the watch is in place: no change after this is missed
  while (!ok && fd >= 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now()).count();
    if (left <= 0) break;
    struct pollfd p = {fd, POLLIN, 0};
    if (poll(&p, 1, (int)left) > 0) {
      char events[4096];
      while (read(fd, events, sizeof events) > 0) {
      }
    }
    ok = done();
  }
  if (fd >= 0) close(fd);
  return ok;
}

// The first line of dir/LATEST ("" when there is none).
inline std::string Latest(const std::string &dir) {
  std::ifstream f(dir + "/LATEST");
  std::string s;
  std::getline(f, s);
  return s;
}

// Waits until dir/LATEST names file.
inline bool WaitLatest(const std::string &dir, const std::string &file, int timeout_ms = 10000) {
  return WaitInDir(dir, [&] { return Latest(dir) == file; }, timeout_ms);
}

}  // namespace wtxtest

#endif  // WTX_TESTS_COMMON_DIR_WAIT_H
