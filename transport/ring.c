/* A byte ring in shared memory (ring.h): one writer, one reader, no lock.
 * The writer advances `written`, the reader `read`, each with release
 * stores after its copy; both wait on one futex word that either bumps
 * after progress. A process-shared mutex or condition would let a peer
 * that dies mid-wait hang the other (glibc's condition waits for its
 * waiters to leave); a counter and a futex cannot. */
#include "transport/ring.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <linux/futex.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "transport/host_region.h"
#include "wtx/error.h"

#define MAGIC "wtxring1"
/* How often a wait looks at the cancel and the peer's socket. */
#define SLICE_MS 20

typedef struct shared {
  char magic[8];
  uint64_t cap;
  _Alignas(64) _Atomic uint64_t written; /* bytes put, in all */
  _Alignas(64) _Atomic uint64_t read;    /* bytes taken, in all */
  _Alignas(64) _Atomic uint32_t seq;     /* the futex: bumped after progress */
  _Atomic int closed;
  _Alignas(64) uint8_t data[];
} shared;

struct wtx__ring {
  shared *s;
  size_t map_len;
};

/* Maps len bytes of fd (-1: fresh zeroed memory of this process's own). */
static int map(int fd, size_t len, wtx__ring **out) {
  int flags = MAP_SHARED | (fd < 0 ? MAP_ANONYMOUS : 0);
  void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, flags, fd, 0);
  if (m == MAP_FAILED) return fd < 0 ? WTX_ENOMEM : WTX_EIO;
  wtx__ring *r = calloc(1, sizeof *r);
  if (r == NULL) {
    munmap(m, len);
    return WTX_ENOMEM;
  }
  r->s = m;
  r->map_len = len;
  *out = r;
  return 0;
}

int wtx__ring_private(size_t cap, wtx__ring **out) {
  int rc = map(-1, sizeof(shared) + cap, out);
  if (rc == 0) (*out)->s->cap = cap;
  return rc;
}

int wtx__ring_create(size_t cap, wtx__ring **out, char *name, size_t nlen, char *err,
                     size_t errlen) {
  size_t len = sizeof(shared) + cap;
  int fd;
  int rc = wtx__shm_object_make("ring", len, name, nlen, &fd, err, errlen);
  if (rc == 0 && (rc = map(fd, len, out)) != 0)
    snprintf(err, errlen, "shm ring: cannot map %s: %s", name, strerror(errno));
  if (fd >= 0) close(fd);
  if (rc != 0 && fd >= 0) shm_unlink(name);
  if (rc != 0) return rc;
  (*out)->s->cap = cap; /* the rest is zero, as ftruncate made it */
  memcpy((*out)->s->magic, MAGIC, 8);
  return 0;
}

int wtx__ring_open(const char *name, wtx__ring **out, char *err, size_t errlen) {
  int fd;
  uint64_t size = 0;
  int rc = wtx__shm_object_open(name, &fd, &size);
  if (rc == 0 && size <= sizeof(shared)) rc = WTX_EPERM;
  if (rc == 0) rc = map(fd, (size_t)size, out);
  if (fd >= 0) close(fd);
  if (rc == 0 && (memcmp((*out)->s->magic, MAGIC, 8) != 0 ||
                  (*out)->s->cap != (size_t)size - sizeof(shared))) {
    wtx__ring_destroy(*out);
    rc = WTX_EPROTO;
  }
  if (rc != 0)
    snprintf(err, errlen, "shm ring: cannot open the worker's ring: %s",
             rc == WTX_EIO ? strerror(errno) : rc == WTX_EPERM
             ? "not a region of this user" : "not a ring");
  return rc;
}

void wtx__ring_unlink(const char *name) { shm_unlink(name); }

/* Whether fd is readable now (a cancel written; a peer's socket closed). */
static int readable(int fd) {
  struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
  return fd >= 0 && poll(&p, 1, 0) > 0;
}

static void progress(shared *s) {
  atomic_fetch_add_explicit(&s->seq, 1, memory_order_release);
  syscall(SYS_futex, &s->seq, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/* Waits for the other side's progress while avail(s) is 0, or a
 * failure: the ring closed, the cancel, the peer gone, the deadline. */
static int wait_for(shared *s, uint64_t (*avail)(const shared *), const wtx__ring_wait *w,
                    const char **why) {
  for (;;) {
    uint32_t seen = atomic_load_explicit(&s->seq, memory_order_acquire);
    if (avail(s) > 0) return 0;
    if (atomic_load(&s->closed)) {
      *why = "the ring was closed by the other side";
      return WTX_EIO;
    }
    if (readable(w->cancel_fd)) {
      *why = "cancelled";
      return WTX_ECANCELED;
    }
    if (readable(w->peer_fd)) {
      *why = "peer closed the connection";
      return WTX_EIO;
    }
    int64_t left = w->until - wtx__clock_ms();
    if (left <= 0) {
      *why = "not all data within the timeout";
      return WTX_ETIMEDOUT;
    }
    int64_t ms = left < SLICE_MS ? left : SLICE_MS;
    struct timespec t = {.tv_sec = 0, .tv_nsec = ms * 1000000};
    syscall(SYS_futex, &s->seq, FUTEX_WAIT, seen, &t, NULL, 0);
  }
}

static uint64_t room(const shared *s) {
  return s->cap - (atomic_load_explicit(&s->written, memory_order_relaxed) -
                   atomic_load_explicit(&s->read, memory_order_acquire));
}

static uint64_t bytes(const shared *s) {
  return atomic_load_explicit(&s->written, memory_order_acquire) -
         atomic_load_explicit(&s->read, memory_order_relaxed);
}

int wtx__ring_reserve(wtx__ring *r, uint8_t **p, size_t *len, const wtx__ring_wait *w,
                      const char **why) {
  shared *s = r->s;
  int rc = wait_for(s, room, w, why);
  if (rc != 0) return rc;
  size_t tail = (size_t)(atomic_load_explicit(&s->written, memory_order_relaxed) % s->cap);
  size_t k = (size_t)room(s);
  *p = s->data + tail;
  *len = k < s->cap - tail ? k : (size_t)s->cap - tail;
  return 0;
}

void wtx__ring_commit(wtx__ring *r, size_t n) {
  shared *s = r->s;
  uint64_t at = atomic_load_explicit(&s->written, memory_order_relaxed);
  atomic_store_explicit(&s->written, at + n, memory_order_release);
  progress(s);
}

int wtx__ring_put(wtx__ring *r, const struct iovec *iov, size_t n, const wtx__ring_wait *w,
                  const char **why) {
  for (size_t i = 0; i < n; i++) {
    const uint8_t *p = iov[i].iov_base;
    for (size_t left = iov[i].iov_len; left > 0;) {
      uint8_t *dst;
      size_t k;
      int rc = wtx__ring_reserve(r, &dst, &k, w, why);
      if (rc != 0) return rc;
      if (k > left) k = left;
      memcpy(dst, p, k);
      wtx__ring_commit(r, k);
      p += k;
      left -= k;
    }
  }
  return 0;
}

int wtx__ring_take(wtx__ring *r, uint8_t *dst, int (*fn)(void *arg, const uint8_t *p, size_t k),
                   void *arg, uint64_t len, const wtx__ring_wait *w, const char **why) {
  shared *s = r->s;
  while (len > 0) {
    int rc = wait_for(s, bytes, w, why);
    if (rc != 0) return rc;
    uint64_t at = atomic_load_explicit(&s->read, memory_order_relaxed);
    size_t head = (size_t)(at % s->cap), k = (size_t)bytes(s);
    if (k > s->cap - head) k = (size_t)s->cap - head;
    if (k > len) k = (size_t)len;
    if (dst != NULL) {
      memcpy(dst, s->data + head, k);
      dst += k;
    } else if ((rc = fn(arg, s->data + head, k)) != 0) {
      return rc;
    }
    atomic_store_explicit(&s->read, at + k, memory_order_release);
    progress(s);
    len -= k;
  }
  return 0;
}

void wtx__ring_close(wtx__ring *r) {
  if (r == NULL) return;
  atomic_store(&r->s->closed, 1);
  progress(r->s);
}

void wtx__ring_destroy(wtx__ring *r) {
  if (r == NULL) return;
  munmap(r->s, r->map_len);
  free(r);
}
