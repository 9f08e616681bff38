/* A byte ring with one writer and one reader, no lock (tcp's many
 * senders). In POSIX shared memory between two processes on one host
 * (TcpInitInfo.shm_ring: a sender's chunks go through a ring the worker
 * made instead of its socket, which stays open to say either side is
 * alive): the reader creates it, the writer opens it by name, and the
 * reader then unlinks the name, so no third process can. Or private, a
 * thread of the worker's reading a sender's socket ahead into it. Every
 * wait is bounded by a deadline, ends when cancel_fd is readable, and
 * fails when the peer's socket (peer_fd) has closed: neither side writes
 * on it once the ring is in use. Internal to transport/. */
#ifndef WTX_TRANSPORT_RING_H
#define WTX_TRANSPORT_RING_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct wtx__ring wtx__ring;

/* How a wait is bounded: until (wtx__clock_ms), cancel_fd (-1: none) and
 * peer_fd (-1: none). */
typedef struct wtx__ring_wait {
  int64_t until;
  int cancel_fd, peer_fd;
} wtx__ring_wait;

/* The reader: a new ring of cap bytes, a "/wtx-ring-..." object of this
 * user (0600) whose name goes into name (nlen >= 64). */
int wtx__ring_create(size_t cap, wtx__ring **out, char *name, size_t nlen, char *err,
                     size_t errlen);
/* A ring of cap bytes within this process: for two of its threads. */
int wtx__ring_private(size_t cap, wtx__ring **out);
/* The writer: the ring named, which must be a "/wtx-" object of this
 * user. */
int wtx__ring_open(const char *name, wtx__ring **out, char *err, size_t errlen);
/* The reader, once the writer opened it (or will not): the name goes. */
void wtx__ring_unlink(const char *name);
/* Writes the n pieces of iov into the ring, waiting for room. 0, or
 * WTX_ETIMEDOUT, WTX_ECANCELED, WTX_EIO (the reader closed it, or is gone);
 * *why says which. */
int wtx__ring_put(wtx__ring *r, const struct iovec *iov, size_t n, const wtx__ring_wait *w,
                  const char **why);
/* The writer's room, in place: waits until the ring has room (the waits of
 * wtx__ring_put) and gives the longest free run, *len bytes at *p, for
 * wtx__ring_commit to publish (recv(2) straight into the ring). */
int wtx__ring_reserve(wtx__ring *r, uint8_t **p, size_t *len, const wtx__ring_wait *w,
                      const char **why);
void wtx__ring_commit(wtx__ring *r, size_t n);
/* Takes len bytes: into dst, or when dst is NULL handed to fn(arg, p, k)
 * piece by piece (its failure is returned as it is, *why untouched). */
int wtx__ring_take(wtx__ring *r, uint8_t *dst, int (*fn)(void *arg, const uint8_t *p, size_t k),
                   void *arg, uint64_t len, const wtx__ring_wait *w, const char **why);
/* Closes it for both sides: the other's waits fail at once. */
void wtx__ring_close(wtx__ring *r);
/* Unmaps it (the other side's mapping stays). */
void wtx__ring_destroy(wtx__ring *r);

#ifdef __cplusplus
}
#endif
#endif /* WTX_TRANSPORT_RING_H */
