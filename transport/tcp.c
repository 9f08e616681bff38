/* tcp: a byte stream pipelined along a chain, trainer -> worker 0 -> worker 1
 * -> ... -> worker n-1, so the trainer's uplink carries the model once however
 * many workers there are (docs/data-plane.md, "tcp").
 *
 * Connections: the trainer listens on its data port; at init, worker 0
 * connects to it, and worker i (i > 0) connects to the relay port worker i-1
 * reported as its data_address. Every connection opens with a hello carrying
 * the session's data_token; a peer without it is refused. Per chunk, the
 * upstream writes a 32-byte frame header (magic, version, chunk sequence,
 * first_param_offset, chunk_bytes), the chunk's bytes and, with
 * checksum_trailer, the checksums of the tensors ending in the chunk: the
 * trainer hashes each piece right after it sends it, so it reads its
 * tensors once (they were a second pass before the UpdateWeights calls). A
 * worker receives each piece into a buffer of its own that stays in L2, a
 * relay forwards it downstream from there, and the assembler copies it
 * into model memory, hashing it on the way, before the next is read:
 * cut-through, so the chain adds a piece of latency per hop, not a chunk;
 * the trailer is checked by each worker and forwarded as it came.
 *
 * A chunk (its header, the relay's accept and every byte) and a connect
 * each have one deadline, the session's timeout_ms, however the peer
 * trickles: a dead or slow peer ends as an error, never a hang. cancel
 * (abort, drain) ends a wait at once through an eventfd. After
 * an error the stream is out of step and the session must be initialized
 * again. The data plane uses blocking sockets with poll() deadlines on the
 * call's own thread (a receive runs inside its UpdateWeights handler). */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/hash.h"
#include "common/random.h"
#include "common/text.h"
#include "transport/host_region.h"
#include "transport/ipc_region.h"
#include "transport/ring.h"
#include "transport/tcp_frame.h"
#include "transport/tcp_rank.h"
#include "transport/transport.h"

/* Bytes the last worker receives at a time, into its piece buffer, from
 * which the assembler copies them out while they are in L2 (larger pieces
 * are hashed from further out). A receive straight into model memory would
 * make the kernel's copy write lines it first reads from DRAM; through the
 * buffer they go out with non-temporal stores (wtx_rx_bytes). Tiny tensors
 * come the same way, many in one recv. The buffer starts on a page: the
 * kernel copies with rep movsb, which on AMD Zen 3 slows down badly where
 * the destination lies 1-31 bytes past the source modulo 4 KiB, as
 * malloc's buffers, 16 bytes into a page, would. */
#define PIECE (128u << 10)
/* Bytes the trainer sends at a time, each piece hashed right after its
 * sendmsg while it is in L2, and a relay receives and forwards at a time.
 * Fewer calls per byte than PIECE: each sendmsg also runs loopback's
 * receive path and the wake-up of the reader. The last worker keeps PIECE:
 * larger receives do not help it. */
#define SEND_PIECE (512u << 10)

/* ---- sockets with deadlines ---- */

/* How long a blocking step may take: an absolute deadline (wtx__clock_ms)
 * and an eventfd that, once written (cancel), ends every wait at once; -1:
 * none. */
typedef struct waitspec {
  int64_t until;
  int cancel_fd;
} waitspec;

static waitspec within(uint32_t ms, int cancel_fd) {
  return (waitspec){wtx__clock_ms() + ms, cancel_fd};
}

/* Waits until fd is ready for events: 0, WTX_ETIMEDOUT past the deadline,
 * WTX_ECANCELED once cancelled. */
static int wait_fd(int fd, short events, const waitspec *ws) {
  struct pollfd p[2] = {{.fd = fd, .events = events},
                        {.fd = ws->cancel_fd, .events = POLLIN}};
  nfds_t n = ws->cancel_fd >= 0 ? 2 : 1;
  for (;;) {
    int64_t left = ws->until - wtx__clock_ms();
    if (left < 0) left = 0;
    int r = poll(p, n, (int)(left > 60000 ? 60000 : left));
    if (r > 0 && n == 2 && p[1].revents != 0) return WTX_ECANCELED;
    if (r > 0) return 0;
    if (r < 0 && errno != EINTR) return WTX_EIO;
    if (r == 0 && wtx__clock_ms() >= ws->until) return WTX_ETIMEDOUT;
  }
}

static const char *wait_why(int rc, const char *timeout) {
  return rc == WTX_ETIMEDOUT ? timeout : rc == WTX_ECANCELED ? "cancelled" : strerror(errno);
}

/* The most bytes a reader waits for before the kernel wakes it. */
#define LOWAT_MAX ((size_t)1 << 20)

/* Before a wait, asks the kernel to wake the reader only once want bytes
 * (at most LOWAT_MAX) are in, instead of at every segment: on loopback the
 * sender's own system call runs the receive path and wakes the reader, a
 * cross-core interrupt each time. The kernel still wakes it
 * for a FIN, an error, or a receive buffer under pressure, and caps want
 * at half that buffer; a failed setsockopt only loses the saving. */
static void wake_after(int fd, uint64_t want) {
  int lowat = want < LOWAT_MAX ? (int)want : (int)LOWAT_MAX;
  (void)setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof lowat);
}

/* Reads exactly len bytes by the deadline: it bounds the whole read, so a
 * peer that trickles a byte at a time still fails in time. more: bytes the
 * peer sends right after these without waiting for anything (the rest of
 * a chunk), which the reader may wait for too; 0 when unsure. */
static int read_more(int fd, void *buf, size_t len, uint64_t more, const waitspec *ws,
                     const char **why) {
  uint8_t *p = buf;
  while (len > 0) {
    ssize_t r = recv(fd, p, len, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      len -= (size_t)r;
      continue;
    }
    if (r == 0) {
      *why = "peer closed the connection";
      return WTX_EIO;
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      *why = strerror(errno);
      return WTX_EIO;
    }
    wake_after(fd, len + more);
    int rc = wait_fd(fd, POLLIN, ws);
    if (rc != 0) {
      *why = wait_why(rc, "not all data within the timeout");
      return rc;
    }
  }
  return 0;
}

static int read_full(int fd, void *buf, size_t len, const waitspec *ws, const char **why) {
  return read_more(fd, buf, len, 0, ws, why);
}

/* Writes the n pieces of iov in order, all by the deadline: sendmsg with up
 * to 64 pieces a call, resumed where a short write stopped. */
static int write_iov_full(int fd, const struct iovec *iov, size_t n, const waitspec *ws,
                          const char **why) {
  size_t i = 0, off = 0; /* the next byte: piece i, offset off */
  for (;;) {
    while (i < n && off == iov[i].iov_len) {
      i++;
      off = 0;
    }
    if (i == n) return 0;
    struct iovec v[64];
    size_t m = 0;
    for (size_t j = i; j < n && m < 64; j++, m++) v[m] = iov[j];
    v[0].iov_base = (uint8_t *)v[0].iov_base + off;
    v[0].iov_len -= off;
    struct msghdr msg = {.msg_iov = v, .msg_iovlen = m};
    ssize_t r = sendmsg(fd, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
    for (size_t left = r > 0 ? (size_t)r : 0; left > 0;) {
      size_t rest = iov[i].iov_len - off, k = left < rest ? left : rest;
      off += k;
      left -= k;
      if (off == iov[i].iov_len) {
        i++;
        off = 0;
      }
    }
    if (r > 0 || (r < 0 && errno == EINTR)) continue;
    if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK) {
      *why = strerror(errno);
      return WTX_EIO;
    }
    int rc = wait_fd(fd, POLLOUT, ws);
    if (rc != 0) {
      *why = wait_why(rc, "peer took not all data within the timeout");
      return rc;
    }
  }
}

static int write_full(int fd, const void *buf, size_t len, const waitspec *ws,
                      const char **why) {
  struct iovec v = {.iov_base = (void *)buf, .iov_len = len};
  return write_iov_full(fd, &v, 1, ws, why);
}

static void tune(int fd) {
  int one = 1, buf = 4 << 20;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
}

/* "ip:port" of a bound or connected socket (local side). */
static void sock_name(int fd, int local, char *out, size_t len) {
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  int r = local ? getsockname(fd, (struct sockaddr *)&ss, &sl)
                : getpeername(fd, (struct sockaddr *)&ss, &sl);
  char host[NI_MAXHOST], port[NI_MAXSERV];
  if (r != 0 || getnameinfo((struct sockaddr *)&ss, sl, host, sizeof host, port,
                            sizeof port, NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
    snprintf(out, len, "?");
    return;
  }
  snprintf(out, len, ss.ss_family == AF_INET6 ? "[%s]:%s" : "%s:%s", host, port);
}

/* Listens on addr ("host:port", port 0 picks one); *bound gets "ip:port". */
static int listen_on(const char *addr, int *fd_out, char *bound, size_t blen,
                     char *err, size_t errlen) {
  char host[256], port[32];
  if (wtx__split_hostport(addr, host, sizeof host, port, sizeof port) != 0) {
    snprintf(err, errlen, "tcp: '%s' is not host:port", addr);
    return WTX_EINVAL;
  }
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
  struct addrinfo *ai = NULL;
  if (getaddrinfo(host[0] ? host : NULL, port, &hints, &ai) != 0 || ai == NULL) {
    snprintf(err, errlen, "tcp: cannot resolve '%s'", addr);
    return WTX_EINVAL;
  }
  int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (fd < 0 || bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 8) != 0) {
    snprintf(err, errlen, "tcp: cannot listen on %s: %s", addr, strerror(errno));
    if (fd >= 0) close(fd);
    freeaddrinfo(ai);
    return WTX_EIO;
  }
  freeaddrinfo(ai);
  sock_name(fd, 1, bound, blen);
  *fd_out = fd;
  return 0;
}

static int connect_to(const char *addr, const wtx__netallow *allow, const waitspec *ws,
                      int *fd_out, char *err, size_t errlen) {
  char host[256], port[32];
  if (wtx__split_hostport(addr, host, sizeof host, port, sizeof port) != 0) {
    snprintf(err, errlen, "init_info.tcp.upstream_address: '%s' is not host:port",
             addr);
    return WTX_EINVAL;
  }
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_NUMERICSERV};
  struct addrinfo *ai = NULL;
  if (getaddrinfo(host, port, &hints, &ai) != 0 || ai == NULL) {
    snprintf(err, errlen, "init_info.tcp.upstream_address: cannot resolve '%s'",
             addr);
    return WTX_EUNAVAIL;
  }
  if (!wtx__netallow_admits(allow, ai->ai_addr)) {
    snprintf(err, errlen, "init_info.tcp.upstream_address: '%s' is outside this "
             "worker's --allow-upstream", addr);
    freeaddrinfo(ai);
    return WTX_EPERM;
  }
  int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  int rc = fd < 0 ? WTX_EIO : 0;
  if (rc == 0 && connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS) {
      rc = WTX_EUNAVAIL;
    } else if ((rc = wait_fd(fd, POLLOUT, ws)) == 0) {
      int soerr = 0;
      socklen_t sl = sizeof soerr;
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &sl);
      if (soerr != 0) {
        errno = soerr;
        rc = WTX_EUNAVAIL;
      }
    }
  }
  freeaddrinfo(ai);
  if (rc != 0) {
    snprintf(err, errlen, "tcp: cannot connect to %s: %s", addr,
             rc == WTX_ETIMEDOUT ? "timed out" : strerror(errno));
    if (fd >= 0) close(fd);
    return rc;
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  tune(fd);
  *fd_out = fd;
  return 0;
}

static int send_hello(int fd, const uint8_t *token, size_t len, const waitspec *ws,
                      const char **why) {
  uint8_t h[WTX__TCP_HELLO_BYTES];
  wtx__tcp_hello_encode(h, token, len);
  return write_full(fd, h, sizeof h, ws, why);
}

/* How long a connected peer has to present its hello: one that stays
 * silent (or squats the port) is dropped after this, and accepting goes on. */
#define HELLO_MS 2000

/* Accepts connections on lfd until one presents the session's token (by
 * the deadline); peers without it, or silent ones, are dropped. err says
 * why not, for the caller to say whose connection it waited for. */
static int accept_peer(int lfd, const uint8_t *token, size_t len, const waitspec *ws,
                       int *fd_out, char *err, size_t errlen) {
  for (;;) {
    int rc = wait_fd(lfd, POLLIN, ws);
    if (rc != 0) {
      snprintf(err, errlen, "%s", rc == WTX_ECANCELED ? "cancelled while waiting "
               "for the downstream connection" : "no downstream connection with this "
               "session's token within the timeout");
      return rc;
    }
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
      snprintf(err, errlen, "accept: %s", strerror(errno));
      return WTX_EIO;
    }
    uint8_t h[WTX__TCP_HELLO_BYTES];
    const char *why = "";
    waitspec hello = within(HELLO_MS, ws->cancel_fd);
    if (hello.until > ws->until) hello.until = ws->until;
    rc = read_full(fd, h, sizeof h, &hello, &why);
    if (rc == 0) rc = wtx__tcp_hello_check(h, token, len);
    if (rc == 0) {
      tune(fd);
      *fd_out = fd;
      return 0;
    }
    close(fd); /* not our peer, or silent: drop it and keep waiting */
    if (rc == WTX_ECANCELED) {
      snprintf(err, errlen, "cancelled while waiting for the downstream connection");
      return rc;
    }
  }
}

/* ---- worker half ---- */

/* With several senders a worker reads one sender's chunk at a time, in
 * stream order, while the others keep sending: each connection is read
 * ahead by a thread of its own into a ring (ring.h, private), so that a
 * sender's link stays busy while the worker takes another's chunk (a
 * socket's buffer holds a few MiB, a fraction of a second on a datacenter
 * link). The bytes are copied once from the ring into staging, as they
 * were from the piece buffer. */
typedef struct ahead {
  pthread_t th;
  int stop_fd; /* eventfd: written to end the reader */
  int rc;      /* the reader's failure, said before it closes the ring */
  char why[200];
} ahead;

/* A connection chunks arrive on: the upstream, or a sender's. */
typedef struct inlet {
  int fd;
  uint64_t seq; /* chunks it has carried */
  char addr[300];
  /* Where its bytes are taken from instead of the socket: the ring a
   * reader thread fills (ra set), or with shm_ring the one this worker
   * made for the sender in shared memory. */
  wtx__ring *ring;
  ahead *ra;
} inlet;

typedef struct tcp_worker {
  wtx_wire_params wire;
  uint8_t token[WTX__TCP_TOKEN_MAX];
  size_t token_len;
  int relay;   /* whether a downstream worker follows */
  int shm_ring; /* senders on this host: each sends through a ring */
  /* Senders on this node: the bytes are in this region (cuda_region_bytes) */
  wtx__ipc_region *region;
  uint64_t region_bytes;
  /* Senders on this host, and a model that adopts host memory: the bytes
   * are in this one instead of rings (shm_region_bytes, host_adopt) */
  wtx__host_region *hregion;
  uint64_t hregion_bytes;
  const char *cuda_device; /* the worker's --cuda-device (env), NULL: default */
  uint64_t max_bytes;      /* --max-model-bytes */
  int trailer; /* checksums follow each chunk's bytes (checksum_trailer) */
  uint8_t *tbuf; /* the last trailer's values, as received */
  uint64_t *sums; /* and decoded */
  size_t tcap;    /* values both hold */
  /* in[0]: the upstream; in[k]: sender k (sender_addresses[k-1]) */
  inlet *in;
  size_t n_in;
  uint32_t index; /* worker_index, said after each hello when n_in > 1 */
  uint64_t plan_digest; /* rank 0's, which every sender must share */
  int lfd;     /* relay listener, -1 when last in the chain */
  int down;    /* relay connection, accepted at the first chunk */
  int cancel_fd; /* eventfd: written by cancel, ends every wait */
  const wtx__netallow *allow; /* where connect may go; NULL: anywhere */
  int relay_port;              /* the relay listener's port; 0: any */
  int broken;
  size_t piece;    /* bytes received at a time: SEND_PIECE on a relay, else PIECE */
  uint8_t *bounce; /* piece bytes, each piece received into it */
  char broke_why[400];
} tcp_worker;

/* ---- reading ahead (several senders) ---- */

/* The most bytes read ahead per sender: enough to keep a link busy for
 * the time the worker spends on other senders' chunks. AHEAD_TOTAL bounds
 * what a worker holds beyond its model whatever the number of senders
 * (256 ranks get 1 MiB each), and AHEAD_MIN keeps each ring useful. */
#define AHEAD_MAX ((size_t)32 << 20)
#define AHEAD_TOTAL ((size_t)256 << 20)
#define AHEAD_MIN ((size_t)1 << 20)

/* The ring each sender of w gets: a chunk, within the bounds above. */
static size_t ahead_cap(uint64_t buffer_size, size_t n_senders) {
  size_t cap = AHEAD_TOTAL / (n_senders ? n_senders : 1);
  if (cap > AHEAD_MAX) cap = AHEAD_MAX;
  if (cap < AHEAD_MIN) cap = AHEAD_MIN;
  return buffer_size < cap ? (size_t)buffer_size : cap;
}

/* Gives the inlet's ring up: its writer's waits fail at once. */
static void ring_drop(inlet *in) {
  wtx__ring_close(in->ring);
  wtx__ring_destroy(in->ring);
  in->ring = NULL;
}

/* The reader's failure, for the taker, then the ring closed under it. */
static void *ahead_fail(inlet *in, const char *why) {
  snprintf(in->ra->why, sizeof in->ra->why, "%s", why);
  in->ra->rc = WTX_EIO;
  wtx__ring_close(in->ring);
  return NULL;
}

/* The reader: receives into the ring's room while there is some, until it
 * is stopped or the connection fails. It takes whatever has come, so the
 * socket wakes it at any byte: a low-water mark left by the handshake's
 * reads would hide a stream's last few bytes (a trailer's sums, after a
 * receive the ring's room cut short) until the taker's deadline. */
static void *ahead_main(void *arg) {
  inlet *in = arg;
  wtx__ring_wait forever = {INT64_MAX, in->ra->stop_fd, -1};
  wake_after(in->fd, 1);
  for (;;) {
    uint8_t *p;
    size_t room;
    const char *why = "";
    if (wtx__ring_reserve(in->ring, &p, &room, &forever, &why) != 0) return NULL; /* stopped */
    struct pollfd pf[2] = {{.fd = in->fd, .events = POLLIN},
                           {.fd = in->ra->stop_fd, .events = POLLIN}};
    if (poll(pf, 2, -1) < 0 && errno != EINTR) return ahead_fail(in, strerror(errno));
    if (pf[1].revents != 0) return NULL;
    ssize_t r = recv(in->fd, p, room, MSG_DONTWAIT);
    if (r > 0) wtx__ring_commit(in->ring, (size_t)r);
    else if (r == 0) return ahead_fail(in, "peer closed the connection");
    else if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK)
      return ahead_fail(in, strerror(errno));
  }
}

/* Ends in's reader (before its fd is closed; the ring goes with ring_drop). */
static void ahead_stop(inlet *in) {
  ahead *a = in->ra;
  if (a == NULL) return;
  uint64_t one = 1;
  ssize_t wr = write(a->stop_fd, &one, sizeof one);
  (void)wr;
  pthread_join(a->th, NULL);
  close(a->stop_fd);
  free(a);
  in->ra = NULL;
}

/* Starts reading in ahead into a ring of cap bytes. */
static int ahead_start(inlet *in, size_t cap) {
  ahead *a = calloc(1, sizeof *a);
  if (a == NULL || wtx__ring_private(cap, &in->ring) != 0) {
    free(a);
    return WTX_ENOMEM;
  }
  a->stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  in->ra = a;
  if (a->stop_fd < 0 || pthread_create(&a->th, NULL, ahead_main, in) != 0) {
    if (a->stop_fd >= 0) close(a->stop_fd);
    free(a);
    in->ra = NULL;
    ring_drop(in);
    return WTX_ENOMEM;
  }
  return 0;
}

/* Takes len bytes of in's stream from its ring: into dst, or when dst is
 * NULL into rx (copied and hashed as the assembler does). A ring closed by
 * a failed reader says the reader's why. */
static int ring_take(inlet *in, uint8_t *dst, wtx_rx *rx, uint64_t len, const waitspec *ws,
                     const char **why);

/* Reads len bytes of in's stream, from its ring when it has one. */
static int inlet_read(inlet *in, void *buf, size_t len, const waitspec *ws, const char **why) {
  return in->ring != NULL ? ring_take(in, buf, NULL, len, ws, why)
                          : read_full(in->fd, buf, len, ws, why);
}

static int rx_take(void *rx, const uint8_t *p, size_t k) { return wtx_rx_bytes(rx, p, k); }

static int ring_take(inlet *in, uint8_t *dst, wtx_rx *rx, uint64_t len, const waitspec *ws,
                     const char **why) {
  /* A reader thread watches the socket itself; a sender's ring, its socket */
  wtx__ring_wait rw = {ws->until, ws->cancel_fd, in->ra != NULL ? -1 : in->fd};
  int rc = wtx__ring_take(in->ring, dst, rx_take, rx, len, &rw, why);
  if (rc == WTX_EIO && in->ra != NULL && in->ra->rc != 0) *why = in->ra->why;
  return rc;
}

static void tcp_worker_destroy(void *self) {
  tcp_worker *w = self;
  if (w == NULL) return;
  for (size_t i = 0; w->in != NULL && i < w->n_in; i++) {
    ahead_stop(&w->in[i]);
    ring_drop(&w->in[i]);
    if (w->in[i].fd >= 0) close(w->in[i].fd);
  }
  wtx__ipc_region_free(w->region);
  wtx__host_region_free(w->hregion);
  free(w->in);
  if (w->lfd >= 0) close(w->lfd);
  if (w->down >= 0) close(w->down);
  if (w->cancel_fd >= 0) close(w->cancel_fd);
  free(w->tbuf);
  free(w->sums);
  free(w->bounce);
  free(w);
}

/* The init fields of many senders that need no network to check. */
static int check_senders(const Wtx__V1__TcpInitInfo *ti, const wtx_wire_params *wire,
                         char *err, size_t errlen) {
  size_t n = ti->n_sender_addresses;
  if (n == 0) return 0;
  if (n >= WTX_MAX_SENDERS) {
    snprintf(err, errlen, "init_info.tcp.sender_addresses: %zu senders besides the "
             "upstream, at most %d in all", n, WTX_MAX_SENDERS);
    return WTX_EINVAL;
  }
  if (ti->relay) {
    snprintf(err, errlen, "init_info.tcp.relay: a worker fed by several senders "
             "(sender_addresses) connects to each and relays nothing");
    return WTX_EINVAL;
  }
  if (ti->shm_ring && wire->buffer_size > SIZE_MAX / 2) {
    snprintf(err, errlen, "init_info.packing.buffer_size: too large for a ring");
    return WTX_EINVAL;
  }
  if (!ti->checksum_trailer &&
      wire->checksum == WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64) {
    snprintf(err, errlen, "init_info.tcp.checksum_trailer: needed with several senders "
             "(sender_addresses): each sender hashes the bytes it sends");
    return WTX_EINVAL;
  }
  for (size_t i = 0; i < n; i++)
    if (ti->sender_addresses[i][0] == '\0') {
      snprintf(err, errlen, "init_info.tcp.sender_addresses[%zu]: empty", i);
      return WTX_EINVAL;
    }
  return 0;
}

/* Validates the handshake and allocates; no network (that is connect). */
static int tcp_worker_init(const Wtx__V1__InitInfo *init, const wtx_wire_params *wire,
                           const wtx_worker_env *env, void **self, char *err,
                           size_t errlen) {
  const Wtx__V1__TcpInitInfo *ti = init->tcp;
  if (ti->data_token.len < WTX__TCP_TOKEN_MIN || ti->data_token.len > WTX__TCP_TOKEN_MAX) {
    snprintf(err, errlen, "init_info.tcp.data_token: %zu bytes, must be %d..%d",
             ti->data_token.len, WTX__TCP_TOKEN_MIN, WTX__TCP_TOKEN_MAX);
    return WTX_EINVAL;
  }
  int rc = check_senders(ti, wire, err, errlen);
  if (rc == 0 && (ti->shm_ring || ti->cuda_region_bytes > 0) && ti->n_sender_addresses == 0) {
    snprintf(err, errlen, "init_info.tcp.%s: only with several senders (sender_addresses)",
             ti->shm_ring ? "shm_ring" : "cuda_region_bytes");
    rc = WTX_EINVAL;
  }
  if (rc == 0 && ti->shm_ring && ti->cuda_region_bytes > 0) {
    snprintf(err, errlen, "init_info.tcp.cuda_region_bytes: not with shm_ring");
    rc = WTX_EINVAL;
  }
  if (rc == 0 && ti->shm_region_bytes > 0 && !ti->shm_ring) {
    snprintf(err, errlen, "init_info.tcp.shm_region_bytes: only with shm_ring");
    rc = WTX_EINVAL;
  }
  if (rc != 0) return rc;
  tcp_worker *w = calloc(1, sizeof *w);
  if (w == NULL) return WTX_ENOMEM;
  w->lfd = w->down = -1;
  w->piece = ti->relay ? SEND_PIECE : PIECE;
  w->bounce = aligned_alloc(4096, w->piece); /* see PIECE: the kernel's copy into it */
  w->cancel_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  w->n_in = 1 + ti->n_sender_addresses;
  w->in = calloc(w->n_in, sizeof *w->in);
  if (w->bounce == NULL || w->cancel_fd < 0 || w->in == NULL) {
    tcp_worker_destroy(w);
    return WTX_ENOMEM;
  }
  for (size_t i = 0; i < w->n_in; i++) {
    w->in[i].fd = -1;
    snprintf(w->in[i].addr, sizeof w->in[i].addr, "%s",
             i == 0 ? ti->upstream_address : ti->sender_addresses[i - 1]);
  }
  w->index = ti->worker_index;
  w->plan_digest = ti->plan_digest;
  w->wire = *wire;
  w->allow = env != NULL ? env->allow_upstream : NULL;
  w->relay_port = env != NULL ? env->relay_port : 0;
  w->relay = ti->relay;
  w->shm_ring = ti->shm_ring;
  w->region_bytes = ti->cuda_region_bytes;
  /* One copy per byte pays only where the model reads the region in
   * place: copied out, the ring's two copies overlap and the region's
   * follow each other. */
  w->hregion_bytes = env != NULL && env->host_adopt ? ti->shm_region_bytes : 0;
  w->cuda_device = env != NULL ? env->cuda_device : NULL;
  w->max_bytes = env != NULL ? env->max_model_bytes : 0;
  w->trailer = ti->checksum_trailer &&
               wire->checksum == WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64;
  w->token_len = ti->data_token.len;
  memcpy(w->token, ti->data_token.data, w->token_len);
  *self = w;
  return 0;
}

/* With several senders: tells the sender which worker this is and rank
 * 0's plan, and takes its own plan back; they must be the same. */
static int agree_plan(tcp_worker *w, inlet *in, const waitspec *ws, const char **why,
                      char *err, size_t errlen) {
  uint8_t who[WTX__TCP_WHO_BYTES], plan[WTX__TCP_PLAN_BYTES];
  uint64_t theirs = 0;
  wtx__tcp_who_encode(who, w->index, w->plan_digest);
  int rc = write_full(in->fd, who, sizeof who, ws, why);
  if (rc == 0) rc = read_full(in->fd, plan, sizeof plan, ws, why);
  if (rc == 0 && wtx__tcp_plan_decode(plan, &theirs) != 0) {
    *why = "its answer to the who record is not one";
    rc = WTX_EPROTO;
  }
  if (rc == 0 && theirs != w->plan_digest) {
    *why = "";
    snprintf(err, errlen, "tcp: sender %s planned this sync differently from rank 0 (plan "
             "digest %016llx, rank 0's %016llx): its metadata, ownership or view of the "
             "workers differ", in->addr, (unsigned long long)theirs,
             (unsigned long long)w->plan_digest);
    rc = WTX_EINVAL;
  }
  return rc;
}

/* Sends a sender the record of what to write into instead of the socket
 * (a ring, a region), then waits for its 'A': it opened it. Anything else,
 * or a closed connection, is a sender that could not (refused_rc, refused). */
static int offer(int fd, const struct iovec *v, size_t n, const waitspec *ws, const char **why,
                 int refused_rc, const char *refused) {
  uint8_t ack = 0;
  int rc = write_iov_full(fd, v, n, ws, why);
  if (rc == 0) rc = read_full(fd, &ack, 1, ws, why);
  if (rc == 0 && ack != 'A') {
    *why = refused;
    rc = refused_rc;
  }
  return rc;
}

/* The record of a shared-memory object of this worker's, a ring or (with
 * region) the host region, of cap bytes, named name; offered as offer. */
static int offer_named(int fd, uint64_t cap, const char *name, int region, const waitspec *ws,
                       const char **why) {
  uint8_t r[WTX__TCP_RING_BYTES];
  wtx__tcp_ring_encode(r, cap, (uint32_t)strlen(name), region);
  struct iovec v[2] = {{r, sizeof r}, {(void *)name, strlen(name)}};
  return offer(fd, v, 2, ws, why, WTX_EPERM,
               region ? "it could not open this worker's receive region (another user, or no "
                        "shared memory)"
                      : "it could not open this worker's ring (another user, or no shared "
                        "memory)");
}

/* With shm_ring: a ring for the sender, its name sent, and unlinked once
 * the sender said it opened it. */
static int share_ring(tcp_worker *w, inlet *in, const waitspec *ws, const char **why,
                      char *err, size_t errlen) {
  char name[128];
  size_t cap = ahead_cap(w->wire.buffer_size, w->n_in);
  int rc = wtx__ring_create(cap, &in->ring, name, sizeof name, err, errlen);
  if (rc != 0) return rc;
  rc = offer_named(in->fd, cap, name, 0, ws, why);
  wtx__ring_unlink(name); /* opened or not: no one else may */
  if (rc != 0) ring_drop(in);
  return rc;
}

/* With cuda_region_bytes: the region's record to the sender, which says
 * it opened it. */
static int share_region(tcp_worker *w, inlet *in, const waitspec *ws, const char **why) {
  uint8_t rec[4 + WTX__IPC_REGION_RECORD];
  memcpy(rec, WTX__TCP_REGION_MAGIC, 4);
  wtx__ipc_region_record(w->region, rec + 4);
  struct iovec v = {rec, sizeof rec};
  return offer(in->fd, &v, 1, ws, why, WTX_EUNAVAIL,
               "it could not open this worker's receive region (not on this node?)");
}

/* With the host region: its name to the sender, which says it mapped it
 * (the name goes once every sender has: tcp_worker_connect). */
static int share_host_region(tcp_worker *w, inlet *in, const waitspec *ws, const char **why) {
  return offer_named(in->fd, w->hregion_bytes, wtx__host_region_name(w->hregion), 1, ws, why);
}

/* How often a refused sender is asked again while the init lasts. */
#define RETRY_MS 50

/* connect_to a trainer rank, which may not listen yet (every rank starts
 * at once): a refused connect is asked again until the deadline. */
static int connect_rank(const char *addr, const wtx__netallow *allow, const waitspec *ws,
                        int *fd, char *err, size_t errlen) {
  int rc = connect_to(addr, allow, ws, fd, err, errlen);
  while (rc == WTX_EUNAVAIL && errno == ECONNREFUSED) {
    waitspec pause = within(RETRY_MS, ws->cancel_fd);
    if (pause.until > ws->until) pause.until = ws->until;
    /* the cancel, or the pause ending (poll without an fd when none) */
    int wrc = ws->cancel_fd >= 0 ? wait_fd(ws->cancel_fd, POLLIN, &pause)
                                 : (poll(NULL, 0, RETRY_MS), WTX_ETIMEDOUT);
    if (wrc != WTX_ETIMEDOUT || wtx__clock_ms() >= ws->until) break;
    rc = connect_to(addr, allow, ws, fd, err, errlen);
  }
  return rc;
}

/* Connects to one inlet and says hello; with several senders the hello is
 * followed by this worker's index. Only the upstream, which drives the
 * session, must listen already. */
static int open_inlet(tcp_worker *w, inlet *in, const waitspec *ws, char *err,
                      size_t errlen) {
  int rc = in == &w->in[0] ? connect_to(in->addr, w->allow, ws, &in->fd, err, errlen)
                           : connect_rank(in->addr, w->allow, ws, &in->fd, err, errlen);
  const char *why = "";
  if (rc == 0 && (rc = send_hello(in->fd, w->token, w->token_len, ws, &why)) == 0 &&
      w->n_in > 1)
    rc = agree_plan(w, in, ws, &why, err, errlen);
  if (rc == 0 && w->hregion != NULL)
    rc = share_host_region(w, in, ws, &why);
  else if (rc == 0 && w->shm_ring)
    rc = share_ring(w, in, ws, &why, err, errlen);
  if (rc == 0 && w->region != NULL) rc = share_region(w, in, ws, &why);
  if (rc != 0 && why[0] != '\0') snprintf(err, errlen, "tcp: hello to %s: %s", in->addr, why);
  return rc;
}

/* The host region, when there is room for it; else the senders write
 * into rings, as for a model that stages (two copies, the same bytes). */
static void host_region_open(tcp_worker *w) {
  char why[300] = "";
  if (wtx__host_region_make(w->hregion_bytes, w->max_bytes, &w->hregion, why, sizeof why) != 0)
    wtx__log(WTX__LOG_WARN, "event=region_declined backend=tcp bytes=%llu reason=\"%s\" "
             "(each sender writes into a ring instead)", (unsigned long long)w->hregion_bytes,
             why);
}

/* Joins the chain: connects upstream (and to every other sender), says
 * hello, listens for the relay. */
static int tcp_worker_connect(void *self, char *data_address, size_t addrlen, char *err,
                              size_t errlen) {
  tcp_worker *w = self;
  waitspec ws = within(w->wire.timeout_ms, w->cancel_fd);
  int rc = w->region_bytes > 0 && w->region == NULL
               ? wtx__ipc_region_make(w->cuda_device, w->region_bytes, w->max_bytes,
                                      w->wire.timeout_ms, &w->region, err, errlen)
               : 0;
  if (rc == 0 && w->hregion_bytes > 0) host_region_open(w);
  for (size_t i = 0; rc == 0 && i < w->n_in; i++) rc = open_inlet(w, &w->in[i], &ws, err, errlen);
  /* Each sender opened the region by its name, or the init failed: no
   * one else may. */
  wtx__host_region_unlink(w->hregion);
  /* Several senders: each read ahead (see ahead). */
  size_t cap = ahead_cap(w->wire.buffer_size, w->n_in);
  for (size_t i = 0; rc == 0 && w->n_in > 1 && !w->shm_ring && i < w->n_in; i++)
    if ((rc = ahead_start(&w->in[i], cap)) != 0) snprintf(err, errlen, "tcp: out of memory");
  if (addrlen > 0) data_address[0] = '\0';
  if (rc == 0 && w->relay) {
    /* Relay on the interface the upstream reached us through. */
    char local[300], host[256], port[32];
    sock_name(w->in[0].fd, 1, local, sizeof local);
    wtx__split_hostport(local, host, sizeof host, port, sizeof port);
    char addr[300];
    snprintf(addr, sizeof addr, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, w->relay_port);
    rc = listen_on(addr, &w->lfd, data_address, addrlen, err, errlen);
  }
  return rc;
}

/* From any thread: the connect or receive running now returns at once. */
static void tcp_worker_cancel(void *self) {
  tcp_worker *w = self;
  uint64_t one = 1;
  ssize_t r = write(w->cancel_fd, &one, sizeof one);
  (void)r; /* an eventfd at its maximum is already cancelled */
}

/* The stream is out of step: close both sides so the peers fail now. */
static void worker_break(tcp_worker *w, const char *why) {
  if (!w->broken) snprintf(w->broke_why, sizeof w->broke_why, "%s", why);
  w->broken = 1;
  for (size_t i = 0; i < w->n_in; i++) {
    ahead_stop(&w->in[i]); /* before its fd goes */
    ring_drop(&w->in[i]);
    if (w->in[i].fd >= 0) close(w->in[i].fd);
    w->in[i].fd = -1;
  }
  if (w->down >= 0) close(w->down);
  if (w->lfd >= 0) close(w->lfd);
  w->down = w->lfd = -1;
}

static void tcp_worker_reset(void *self) {
  worker_break(self, "the update was aborted");
}

static int worker_fail(tcp_worker *w, wtx_rx *rx, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int worker_fail(tcp_worker *w, wtx_rx *rx, int rc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  char why[400];
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  worker_break(w, why);
  wtx_rx_errorf(rx, "tcp: %s", why);
  return rc;
}

/* The checksum trailer after the chunk's bytes on in: read, relayed, and
 * handed to rx. */
static int receive_trailer(tcp_worker *w, inlet *in, wtx_rx *rx, const waitspec *to) {
  uint8_t h[WTX__TCP_TRAILER_HEAD_BYTES];
  const char *why = "";
  char bad[200];
  uint32_t n = 0;
  int rc = inlet_read(in, h, sizeof h, to, &why);
  if (rc != 0)
    return worker_fail(w, rx, rc, "chunk %llu checksums from %s: %s",
                       (unsigned long long)in->seq, in->addr, why);
  if ((rc = wtx__tcp_trailer_check(h, in->seq, WTX_MAX_CHUNK_PARAMS, &n, bad, sizeof bad)) != 0)
    return worker_fail(w, rx, rc, "chunk %llu from %s: %s", (unsigned long long)in->seq,
                       in->addr, bad);
  if (n > w->tcap) {
    uint8_t *b = realloc(w->tbuf, (size_t)n * 8);
    if (b != NULL) w->tbuf = b;
    uint64_t *v = b != NULL ? realloc(w->sums, (size_t)n * 8) : NULL;
    if (v == NULL) return worker_fail(w, rx, WTX_ENOMEM, "out of memory for %u checksums", n);
    w->sums = v;
    w->tcap = n;
  }
  if ((rc = inlet_read(in, w->tbuf, (size_t)n * 8, to, &why)) != 0)
    return worker_fail(w, rx, rc, "chunk %llu checksums from %s: %s",
                       (unsigned long long)in->seq, in->addr, why);
  struct iovec v[2] = {{h, sizeof h}, {w->tbuf, (size_t)n * 8}};
  if (w->down >= 0 && (rc = write_iov_full(w->down, v, 2, to, &why)) != 0)
    return worker_fail(w, rx, rc, "relay chunk %llu checksums downstream: %s",
                       (unsigned long long)in->seq, why);
  wtx__tcp_trailer_get_sums(w->tbuf, w->sums, n);
  return wtx_rx_checksums(rx, w->sums, n);
}

/* The inlet UpdateInfo names (tcp.sender), or NULL with rx's error set. */
static inlet *chunk_inlet(tcp_worker *w, const Wtx__V1__UpdateInfo *info, wtx_rx *rx) {
  uint32_t k = info->tcp != NULL ? info->tcp->sender : 0;
  if (k < w->n_in) return &w->in[k];
  wtx_rx_errorf(rx, "update_info.tcp.sender: %u, but this session has %zu sender%s", k,
                w->n_in, w->n_in == 1 ? "" : "s");
  return NULL;
}

/* A chunk's header from in, checked against what UpdateWeights announced,
 * and passed on to the relay. */
static int receive_header(tcp_worker *w, inlet *in, const Wtx__V1__UpdateInfo *info,
                          wtx_rx *rx, const waitspec *to) {
  const char *why = "";
  uint8_t f[WTX__TCP_FRAME_BYTES];
  int rc = inlet_read(in, f, sizeof f, to, &why);
  if (rc != 0)
    return worker_fail(w, rx, rc, "chunk %llu header from %s: %s",
                       (unsigned long long)in->seq, in->addr, why);
  wtx__tcp_frame want = {in->seq, info->first_param_offset, wtx_rx_remaining(rx)};
  char bad[300];
  if ((rc = wtx__tcp_frame_check(f, &want, bad, sizeof bad)) != 0)
    return worker_fail(w, rx, rc, "chunk %llu from %s: %s", (unsigned long long)in->seq,
                       in->addr, bad);
  if (w->lfd >= 0 && w->down < 0) {
    char err[300];
    rc = accept_peer(w->lfd, w->token, w->token_len, to, &w->down, err, sizeof err);
    if (rc != 0) return worker_fail(w, rx, rc, "relay: %s", err);
  }
  if (w->down >= 0 && (rc = write_full(w->down, f, sizeof f, to, &why)) != 0)
    return worker_fail(w, rx, rc, "relay chunk %llu downstream: %s",
                       (unsigned long long)in->seq, why);
  return 0;
}

/* The chunk's bytes from in, piece by piece, whatever tensors each holds. */
static int receive_bytes(tcp_worker *w, inlet *in, wtx_rx *rx, const waitspec *to) {
  const char *why = "";
  uint64_t remaining = wtx_rx_remaining(rx);
  if (in->ring != NULL) {
    int rc = ring_take(in, NULL, rx, remaining, to, &why);
    if (rc != 0 && why[0] != '\0') /* else rx's own refusal, already said */
      return worker_fail(w, rx, rc, "chunk %llu from %s after %llu of %llu bytes: %s",
                         (unsigned long long)in->seq, in->addr,
                         (unsigned long long)(remaining - wtx_rx_remaining(rx)),
                         (unsigned long long)remaining, why);
    return rc;
  }
  for (uint64_t got = 0; got < remaining;) {
    size_t k = remaining - got < w->piece ? (size_t)(remaining - got) : w->piece;
    uint8_t *dst = w->bounce;
    /* The rest of the chunk, which a relay does not wait for: it passes
     * each piece on as it comes, so the chain's next worker is not held
     * back by this one's wake-ups. */
    uint64_t after = w->down < 0 ? remaining - got - k : 0;
    int rc = read_more(in->fd, dst, k, after, to, &why);
    if (rc != 0)
      return worker_fail(w, rx, rc, "chunk %llu from %s after %llu of %llu "
                         "bytes: %s", (unsigned long long)in->seq, in->addr,
                         (unsigned long long)got, (unsigned long long)remaining,
                         why);
    if (w->down >= 0 && (rc = write_full(w->down, dst, k, to, &why)) != 0)
      return worker_fail(w, rx, rc, "relay chunk %llu downstream: %s",
                         (unsigned long long)in->seq, why);
    if ((rc = wtx_rx_bytes(rx, dst, k)) != 0) return rc;
    got += k;
  }
  return 0;
}

static int tcp_worker_receive(void *self, const Wtx__V1__UpdateInfo *info,
                              wtx_rx *rx) {
  tcp_worker *w = self;
  if (w->broken) {
    wtx_rx_errorf(rx, "tcp: the data stream broke earlier (%s); initialize the "
                  "session again", w->broke_why);
    return WTX_ESTATE;
  }
  if (w->trailer && info->n_xxh3_64 > 0)
    return worker_fail(w, rx, WTX_EINVAL, "update_info.xxh3_64: must be empty, this "
                       "session's checksums follow each chunk's bytes "
                       "(init_info.tcp.checksum_trailer)");
  inlet *in = chunk_inlet(w, info, rx);
  if (in == NULL) return WTX_EINVAL;
  /* Each sender hashes only what it sends: a checksum per tensor touched. */
  int rc = w->n_in > 1 && w->trailer ? wtx_rx_span_checksums(rx) : 0;
  /* One deadline for the whole chunk, header, relay accept and bytes. */
  waitspec ws = within(w->wire.timeout_ms, w->cancel_fd);
  if (rc != 0 || (rc = receive_header(w, in, info, rx, &ws)) != 0) return rc;
  /* With a region the chunk's bytes are there, written before the frame. */
  rc = w->region != NULL    ? wtx__ipc_region_out(w->region, wtx_rx_stream_offset(rx), rx)
       : w->hregion != NULL ? wtx__host_region_out(w->hregion, wtx_rx_stream_offset(rx), rx)
                            : receive_bytes(w, in, rx, &ws);
  if (rc != 0) return rc;
  if (w->trailer && (rc = receive_trailer(w, in, rx, &ws)) != 0) return rc;
  in->seq++;
  return 0;
}

/* With a receive region (cuda_region_bytes), the chunks are on its GPU:
 * a model that stages there, or adopts it, gets them device to device. */
static int tcp_worker_device(void *self) {
  tcp_worker *w = self;
  return w->region != NULL ? wtx__ipc_region_device(w->region) : -1;
}

static int tcp_worker_region(void *self, uint8_t **base, uint64_t *bytes) {
  tcp_worker *w = self;
  return w->region != NULL    ? wtx__ipc_region_get(w->region, base, bytes)
         : w->hregion != NULL ? wtx__host_region_get(w->hregion, base, bytes)
                              : WTX_ENOENT;
}

/* Only with a region is there a device to stage on (tcp_worker_device). */
static int tcp_worker_put_box(void *self, void *dst, const wtx_box *whole, const void *src,
                              const wtx_box *box, size_t es, char *err, size_t errlen) {
  tcp_worker *w = self;
  if (w->region != NULL)
    return wtx__ipc_region_box(w->region, dst, whole, src, box, es, err, errlen);
  snprintf(err, errlen, "tcp: no GPU to put a box on");
  return WTX_ESTATE;
}

const wtx_worker_transport wtx_tcp_worker_transport = {
    .name = "tcp",
    .init_case = WTX__V1__INIT_INFO__BACKEND_TCP,
    .update_case = WTX__V1__UPDATE_INFO__BACKEND_TCP,
    .default_checksum = WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64,
    .supports_draft = 1,
    .init = tcp_worker_init,
    .connect = tcp_worker_connect,
    .receive = tcp_worker_receive,
    .cancel = tcp_worker_cancel,
    .reset = tcp_worker_reset,
    .destroy = tcp_worker_destroy,
    .device = tcp_worker_device,
    .region = tcp_worker_region,
    .put_box = tcp_worker_put_box,
};

/* ---- trainer half ---- */

typedef struct tcp_trainer {
  wtx_wire_params wire;
  size_t n_workers;
  uint8_t token[32];
  int lfd, fd;
  char address[300]; /* the data port, as worker 0 reaches it */
  uint8_t *buffers;
  Wtx__V1__TcpInitInfo *tcp; /* one per worker */
  Wtx__V1__TcpUpdateInfo update;
  /* the writer thread: one chunk at a time */
  pthread_t writer;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int has_job, stop, job_rc;
  wtx_chunk job;
  const struct iovec *job_iov; /* the chunk's pieces (post_iov) */
  size_t job_n_iov;
  const wtx_chunk_sums *job_sums; /* NULL: checksums in UpdateInfo or off */
  uint64_t seq;
  char job_why[300];
  /* the writer's: the hash of the tensor being sent, carried from chunk to
   * chunk, and the trailer record */
  XXH3_state_t *h;
  uint8_t *trailer;
  size_t trailer_cap;
} tcp_trainer;

/* Hashing a chunk as it is sent (wtx_chunk_sums): pos is the chunk's
 * bytes hashed so far, j the next tensor end. */
typedef struct hasher {
  XXH3_state_t *h;
  const wtx_chunk_sums *cs;
  size_t j;
  uint64_t pos;
} hasher;

/* Hashes the chunk's next len bytes at p, taking a digest at every tensor
 * end on the way (len 0: the ends at the current position). */
static void hash_span(hasher *hs, const uint8_t *p, size_t len) {
  for (;;) {
    while (hs->j < hs->cs->n && hs->cs->ends[hs->j] == hs->pos) {
      hs->cs->out[hs->j++] = XXH3_64bits_digest(hs->h);
      XXH3_64bits_reset(hs->h);
    }
    if (len == 0) return;
    uint64_t stop = hs->j < hs->cs->n ? hs->cs->ends[hs->j] - hs->pos : UINT64_MAX;
    size_t k = stop < len ? (size_t)stop : len;
    XXH3_64bits_update(hs->h, p, k);
    p += k;
    len -= k;
    hs->pos += k;
  }
}

/* Where a chunk goes and what sending it keeps: the connection (or, with
 * a worker on this host that made one, its shared-memory ring, the
 * connection then only saying the worker is alive), the hash state
 * carried from chunk to chunk, and the trailer's buffer. */
typedef struct outlet {
  int fd;
  wtx__ring *ring;
  int cancel_fd; /* -1: none */
  XXH3_state_t *h;
  uint8_t **trailer;
  size_t *trailer_cap;
  /* or a worker's receive region on its GPU, or in host memory: a chunk's
   * bytes go there, at its offset in the stream, before its frame and
   * trailer */
  wtx__ipc_region *region;
  wtx__host_region *hregion;
  uint64_t at;
  /* set while the bytes go into hregion: where the next land */
  uint64_t *cursor;
} outlet;

/* Writes iov to the outlet by ws's deadline. */
static int outlet_write(const outlet *o, const struct iovec *iov, size_t n, const waitspec *ws,
                        const char **why) {
  if (o->cursor != NULL) return wtx__host_region_put(o->hregion, o->cursor, iov, n, why);
  if (o->ring == NULL) return write_iov_full(o->fd, iov, n, ws, why);
  wtx__ring_wait w = {ws->until, o->cancel_fd, o->fd};
  return wtx__ring_put(o->ring, iov, n, &w, why);
}

/* Sends win's m pieces, then hashes them: the socket's copy reads them
 * from the model's memory, and the hash from the cache that copy left
 * them in. */
static int send_then_hash(const outlet *o, const struct iovec *win, size_t m, hasher *hs,
                          const waitspec *ws, const char **why) {
  int rc = outlet_write(o, win, m, ws, why);
  for (size_t i = 0; rc == 0 && i < m; i++) hash_span(hs, win[i].iov_base, win[i].iov_len);
  return rc;
}

/* Sends the n pieces of iov, SEND_PIECE bytes at a time, each hashed right
 * after it goes, while it is in cache (hashing first would read each piece
 * from memory in the hash, and again in the send). */
static int write_hashing(const outlet *o, const struct iovec *iov, size_t n, hasher *hs,
                         const waitspec *ws, const char **why) {
  struct iovec win[64];
  size_t m = 0, bytes = 0;
  for (size_t i = 0; i < n; i++) {
    const uint8_t *p = iov[i].iov_base;
    for (size_t left = iov[i].iov_len; left > 0;) {
      size_t k = left < SEND_PIECE - bytes ? left : SEND_PIECE - bytes;
      win[m++] = (struct iovec){.iov_base = (void *)p, .iov_len = k};
      bytes += k;
      p += k;
      left -= k;
      if (bytes == SEND_PIECE || m == 64) {
        int rc = send_then_hash(o, win, m, hs, ws, why);
        if (rc != 0) return rc;
        m = bytes = 0;
      }
    }
  }
  int rc = m > 0 ? send_then_hash(o, win, m, hs, ws, why) : 0;
  if (rc == 0) hash_span(hs, NULL, 0);
  return rc;
}

/* Chunk seq's checksum trailer on fd, after its bytes, built in *buf
 * (*cap bytes, grown as needed and kept for the next chunk). */
static int write_trailer(const outlet *o, uint64_t seq, const wtx_chunk_sums *cs,
                         const waitspec *ws, const char **why) {
  uint8_t **buf = o->trailer;
  size_t *cap = o->trailer_cap;
  size_t len = WTX__TCP_TRAILER_HEAD_BYTES + cs->n * 8;
  if (len > *cap) {
    uint8_t *b = realloc(*buf, len);
    if (b == NULL) {
      *why = "out of memory";
      return WTX_ENOMEM;
    }
    *buf = b;
    *cap = len;
  }
  wtx__tcp_trailer_encode(*buf, seq, (uint32_t)cs->n);
  wtx__tcp_trailer_put_sums(*buf + WTX__TCP_TRAILER_HEAD_BYTES, cs->out, cs->n);
  struct iovec v = {*buf, len};
  return outlet_write(o, &v, 1, ws, why);
}


/* A chunk into the worker's receive region, then its frame and trailer
 * on the socket; each span hashed from the source, as sent. */
static int send_to_region(const outlet *o, const wtx__tcp_frame *fr, struct iovec head,
                          const struct iovec *iov, size_t n, const wtx_chunk_sums *cs,
                          const waitspec *ws, const char **why) {
  static _Thread_local char err[300];
  int rc = wtx__ipc_region_put(o->region, o->at, iov, n, err, sizeof err);
  if (rc != 0) {
    *why = err;
    return rc;
  }
  if ((rc = outlet_write(o, &head, 1, ws, why)) != 0 || cs == NULL) return rc;
  XXH3_64bits_reset(o->h); /* spans: each sender hashes its own */
  hasher hs = {.h = o->h, .cs = cs};
  for (size_t i = 0; i < n; i++) hash_span(&hs, iov[i].iov_base, iov[i].iov_len);
  hash_span(&hs, NULL, 0);
  return write_trailer(o, fr->seq, cs, ws, why);
}

/* A chunk's bytes to o; with cs each piece hashed right after it goes,
 * from cache (a fresh hash when reset, else the one the last chunk left
 * open), and the chunk's tensor ends checked against its bytes. */
static int write_bytes(const outlet *o, const struct iovec *iov, size_t n,
                       const wtx_chunk_sums *cs, int reset, const waitspec *ws,
                       const char **why) {
  if (cs == NULL) return outlet_write(o, iov, n, ws, why);
  if (reset) XXH3_64bits_reset(o->h);
  hasher hs = {.h = o->h, .cs = cs};
  int rc = write_hashing(o, iov, n, &hs, ws, why);
  if (rc == 0 && hs.j != cs->n) {
    *why = "the chunk's tensor ends lie beyond its bytes";
    rc = WTX_EINVAL;
  }
  return rc;
}

/* A chunk into the worker's receive region in host memory (spans: each
 * sender hashes its own), then its frame and trailer on the socket. */
static int send_to_host_region(const outlet *o, const wtx__tcp_frame *fr, struct iovec head,
                               const struct iovec *iov, size_t n, const wtx_chunk_sums *cs,
                               const waitspec *ws, const char **why) {
  uint64_t at = o->at;
  outlet into = *o;
  into.cursor = &at;
  int rc = write_bytes(&into, iov, n, cs, 1, ws, why);
  if (rc == 0) rc = outlet_write(o, &head, 1, ws, why);
  return rc != 0 || cs == NULL ? rc : write_trailer(o, fr->seq, cs, ws, why);
}

/* Sends one chunk, all by ws's deadline: header, bytes (hashed on the way
 * when cs), trailer. A chunk that continues a tensor (first_offset > 0)
 * continues its hash, unless each span is hashed on its own (spans: many
 * senders). */
static int send_chunk(const outlet *o, const wtx__tcp_frame *fr, const struct iovec *iov,
                      size_t n, const wtx_chunk_sums *cs, int spans, const waitspec *ws,
                      const char **why) {
  uint8_t f[WTX__TCP_FRAME_BYTES];
  wtx__tcp_frame_encode(f, fr);
  struct iovec head = {f, sizeof f};
  if (o->region != NULL) return send_to_region(o, fr, head, iov, n, cs, ws, why);
  if (o->hregion != NULL) return send_to_host_region(o, fr, head, iov, n, cs, ws, why);
  int rc = outlet_write(o, &head, 1, ws, why);
  if (rc == 0) rc = write_bytes(o, iov, n, cs, fr->first_offset == 0 || spans, ws, why);
  return rc != 0 || cs == NULL ? rc : write_trailer(o, fr->seq, cs, ws, why);
}

/* The chain's chunk seq, from the trainer. */
static int write_chunk(tcp_trainer *t, uint64_t seq, const wtx_chunk *c,
                       const struct iovec *iov, size_t n, const wtx_chunk_sums *cs,
                       const char **why) {
  outlet o = {t->fd, NULL, -1, t->h, &t->trailer, &t->trailer_cap, NULL, NULL, 0, NULL};
  waitspec ws = within(t->wire.timeout_ms, -1); /* the whole chunk */
  return send_chunk(&o, &(wtx__tcp_frame){seq, c->first_offset, c->bytes}, iov, n, cs, 0, &ws,
                    why);
}

static void *writer_main(void *arg) {
  tcp_trainer *t = arg;
  pthread_mutex_lock(&t->mu);
  for (;;) {
    while (!t->has_job && !t->stop) pthread_cond_wait(&t->cv, &t->mu);
    if (t->stop) break;
    wtx_chunk c = t->job;
    uint64_t seq = t->seq++;
    const struct iovec *iov = t->job_iov;
    size_t n = t->job_n_iov;
    const wtx_chunk_sums *cs = t->job_sums;
    pthread_mutex_unlock(&t->mu);
    const char *why = "";
    int rc = write_chunk(t, seq, &c, iov, n, cs, &why);
    pthread_mutex_lock(&t->mu);
    t->job_rc = rc;
    if (rc != 0)
      snprintf(t->job_why, sizeof t->job_why, "tcp: sending chunk %llu to worker "
               "0: %s", (unsigned long long)seq, why);
    t->has_job = 0;
    pthread_cond_broadcast(&t->cv);
  }
  pthread_mutex_unlock(&t->mu);
  return NULL;
}

static void tcp_trainer_destroy(void *self) {
  tcp_trainer *t = self;
  if (t == NULL) return;
  pthread_mutex_lock(&t->mu);
  t->stop = 1;
  pthread_cond_broadcast(&t->cv);
  pthread_mutex_unlock(&t->mu);
  if (t->writer) pthread_join(t->writer, NULL);
  if (t->fd >= 0) close(t->fd);
  if (t->lfd >= 0) close(t->lfd);
  pthread_mutex_destroy(&t->mu);
  pthread_cond_destroy(&t->cv);
  free(t->buffers);
  free(t->tcp);
  free(t->trailer);
  if (t->h != NULL) XXH3_freeState(t->h);
  free(t);
}

static int tcp_trainer_create(const wtx_trainer_args *args, void **self,
                              char *err, size_t errlen) {
  const wtx_wire_params *wire = &args->wire;
  size_t n_workers = args->n_workers;
  tcp_trainer *t = calloc(1, sizeof *t);
  if (t == NULL) return WTX_ENOMEM;
  t->lfd = t->fd = -1;
  t->wire = *wire;
  t->n_workers = n_workers;
  pthread_mutex_init(&t->mu, NULL);
  pthread_cond_init(&t->cv, NULL);
  t->buffers = malloc((size_t)(wire->buffer_size * wire->num_buffers));
  t->tcp = calloc(n_workers, sizeof *t->tcp);
  t->h = XXH3_createState();
  if (t->buffers == NULL || t->tcp == NULL || t->h == NULL) {
    snprintf(err, errlen, "tcp: cannot allocate %u buffers of %llu bytes",
             wire->num_buffers, (unsigned long long)wire->buffer_size);
    tcp_trainer_destroy(t);
    return WTX_ENOMEM;
  }
  /* A fresh secret per session: only our workers may join the chain. */
  if (wtx__random_bytes(t->token, sizeof t->token) != 0) {
    snprintf(err, errlen, "tcp: the kernel gave no random bytes for the data token");
    tcp_trainer_destroy(t);
    return WTX_EIO;
  }
  const char *bind = args->data_address != NULL && args->data_address[0]
                         ? args->data_address
                         : "127.0.0.1:0";
  int rc = listen_on(bind, &t->lfd, t->address, sizeof t->address, err, errlen);
  if (rc == 0 && pthread_create(&t->writer, NULL, writer_main, t) != 0)
    rc = WTX_ENOMEM;
  if (rc != 0) {
    tcp_trainer_destroy(t);
    return rc;
  }
  wtx__v1__tcp_update_info__init(&t->update);
  *self = t;
  return 0;
}

static int tcp_trainer_init_info(void *self, size_t i, const char *const *prev,
                                 Wtx__V1__InitInfo *out) {
  tcp_trainer *t = self;
  Wtx__V1__TcpInitInfo *ti = &t->tcp[i];
  wtx__v1__tcp_init_info__init(ti);
  ti->upstream_address = i == 0 ? t->address : (char *)prev[i - 1];
  if (ti->upstream_address == NULL || ti->upstream_address[0] == '\0')
    return WTX_EPROTO; /* worker i-1 did not report a relay address */
  ti->relay = i + 1 < t->n_workers;
  ti->data_token.data = t->token;
  ti->data_token.len = sizeof t->token;
  ti->checksum_trailer = 1; /* with checksums on, they follow the bytes */
  out->backend_case = WTX__V1__INIT_INFO__BACKEND_TCP;
  out->tcp = ti;
  return 0;
}

static int tcp_trainer_connect(void *self, const char *const *addresses,
                               char *err, size_t errlen) {
  (void)addresses;
  tcp_trainer *t = self;
  waitspec ws = within(t->wire.timeout_ms, -1);
  char why[300] = "";
  int rc = accept_peer(t->lfd, t->token, sizeof t->token, &ws, &t->fd, why, sizeof why);
  if (rc != 0) snprintf(err, errlen, "tcp: %s", why);
  return rc;
}

static uint8_t *tcp_trainer_buffer(void *self, uint32_t k) {
  tcp_trainer *t = self;
  return t->buffers + k * t->wire.buffer_size;
}

static int tcp_trainer_prepare(void *self, uint32_t k, const wtx_chunk *c,
                               Wtx__V1__UpdateInfo *ui, char *err, size_t errlen) {
  (void)k;
  (void)c;
  (void)err;
  (void)errlen;
  tcp_trainer *t = self;
  ui->backend_case = WTX__V1__UPDATE_INFO__BACKEND_TCP;
  ui->tcp = &t->update;
  return 0;
}

/* Hands chunk k's pieces to the writer thread; the socket copies each byte
 * once, straight from the source's memory or buffer k (the engine's
 * choice per tensor). */
static int tcp_trainer_post_iov(void *self, uint32_t k, const wtx_chunk *c,
                                const struct iovec *iov, size_t n,
                                const wtx_chunk_sums *sums) {
  (void)k;
  tcp_trainer *t = self;
  pthread_mutex_lock(&t->mu);
  int busy = t->has_job;
  if (!busy) {
    t->job = *c;
    t->job_iov = iov;
    t->job_n_iov = n;
    t->job_sums = sums;
    t->has_job = 1;
    pthread_cond_broadcast(&t->cv);
  }
  pthread_mutex_unlock(&t->mu);
  return busy ? WTX_ESTATE : 0;
}

static int tcp_trainer_complete(void *self, uint32_t k, const wtx_stop *stop, char *err,
                                size_t errlen) {
  (void)stop; /* the relay's answer comes back on the stream at once */
  (void)k;
  tcp_trainer *t = self;
  pthread_mutex_lock(&t->mu);
  while (t->has_job) pthread_cond_wait(&t->cv, &t->mu);
  int rc = t->job_rc;
  if (rc != 0) snprintf(err, errlen, "%s", t->job_why);
  t->job_rc = 0;
  pthread_mutex_unlock(&t->mu);
  return rc;
}

const wtx_trainer_transport wtx_tcp_trainer_transport = {
    .name = "tcp",
    .init_case = WTX__V1__INIT_INFO__BACKEND_TCP,
    .update_case = WTX__V1__UPDATE_INFO__BACKEND_TCP,
    .default_checksum = WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64,
    .hashes_in_stream = 1,
    .create = tcp_trainer_create,
    .init_info = tcp_trainer_init_info,
    .connect = tcp_trainer_connect,
    .buffer = tcp_trainer_buffer,
    .prepare = tcp_trainer_prepare,
    .post_iov = tcp_trainer_post_iov,
    .complete = tcp_trainer_complete,
    .destroy = tcp_trainer_destroy,
};

/* ---- a trainer rank of many senders (tcp_rank.h) ---- */

/* A worker's connection to this rank. */
typedef struct rank_conn {
  int fd;            /* -1: not connected */
  uint64_t seq;      /* chunks it has carried */
  XXH3_state_t *h;   /* for its chunks' span sums */
  uint64_t *sums;    /* a chunk's span sums */
  size_t sums_cap;
  uint8_t *trailer;  /* and their trailer record */
  size_t trailer_cap;
  wtx__ring *ring;   /* the worker's, when it made one (shm_ring) */
  wtx__ipc_region *region; /* the worker's receive region (cuda_region_bytes) */
  wtx__host_region *hregion; /* or in host memory, in place of the ring */
} rank_conn;

struct wtx__tcp_rank {
  uint8_t token[WTX__TCP_TOKEN_MAX];
  size_t token_len;
  uint32_t timeout_ms;
  int lfd;
  int cancel_fd;
  size_t n_workers;
  rank_conn *c;     /* per worker */
  uint64_t digest;  /* this rank's plan, which rank 0's must equal */
  wtx__tcp_params params; /* to find where rank 0's plan differs */
  char differs[1500];     /* where it does, once rank 0 checked */
  int want_link;          /* rank 0's check stays open as the link */
  int shm_ring;           /* each worker sends a ring to write into */
  int cuda_region;        /* each worker sends a receive region on its GPU */
  int link;               /* rank 0's connection, -1: none */
  /* wtx__tcp_rank_watch's thread, while watching: it polls the link and
   * stop_fd; ended: rank 0 closed the link meanwhile. */
  pthread_t watcher;
  int watching;
  int watch_stop_fd;
  atomic_int ended;
};

void wtx__tcp_rank_destroy(wtx__tcp_rank *r) {
  if (r == NULL) return;
  wtx__tcp_rank_reset(r);
  for (size_t w = 0; r->c != NULL && w < r->n_workers; w++) {
    if (r->c[w].h != NULL) XXH3_freeState(r->c[w].h);
    free(r->c[w].sums);
    free(r->c[w].trailer);
  }
  if (r->lfd >= 0) close(r->lfd);
  if (r->link >= 0) close(r->link);
  if (r->cancel_fd >= 0) close(r->cancel_fd);
  if (r->watch_stop_fd >= 0) close(r->watch_stop_fd);
  free(r->c);
  free(r);
}

static int rank_alloc(wtx__tcp_rank *r) {
  r->c = calloc(r->n_workers + 1, sizeof *r->c);
  if (r->c == NULL) return WTX_ENOMEM;
  for (size_t w = 0; w < r->n_workers; w++) {
    r->c[w].fd = -1;
    if ((r->c[w].h = XXH3_createState()) == NULL) return WTX_ENOMEM;
  }
  return 0;
}

int wtx__tcp_rank_listen(const char *addr, const uint8_t *token, size_t token_len,
                         uint64_t plan_digest, const wtx__tcp_params *params,
                         size_t n_workers, uint32_t timeout_ms, wtx__tcp_rank **out,
                         char *bound, size_t blen, char *err, size_t errlen) {
  if (token_len < WTX__TCP_TOKEN_MIN || token_len > WTX__TCP_TOKEN_MAX ||
      (n_workers == 0 && !params->link)) {
    snprintf(err, errlen, "tcp: the session token must be %d..%d bytes", WTX__TCP_TOKEN_MIN,
             WTX__TCP_TOKEN_MAX);
    return WTX_EINVAL;
  }
  wtx__tcp_rank *r = calloc(1, sizeof *r);
  if (r == NULL) return WTX_ENOMEM;
  r->lfd = -1;
  r->n_workers = n_workers;
  r->timeout_ms = timeout_ms;
  r->token_len = token_len;
  memcpy(r->token, token, token_len);
  r->digest = plan_digest;
  r->params = *params;
  r->want_link = params->link;
  r->shm_ring = params->shm_ring;
  r->cuda_region = params->cuda_region;
  r->link = -1;
  r->cancel_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  r->watch_stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  int rc = r->cancel_fd < 0 || r->watch_stop_fd < 0 ? WTX_ENOMEM : rank_alloc(r);
  if (rc == 0) rc = listen_on(addr, &r->lfd, bound, blen, err, errlen);
  if (rc == 0 && listen(r->lfd, WTX_MAX_WORKERS) != 0) rc = WTX_EIO; /* every worker at once */
  if (rc != 0) {
    if (rc == WTX_ENOMEM) snprintf(err, errlen, "tcp: out of memory");
    wtx__tcp_rank_destroy(r);
    return rc;
  }
  *out = r;
  return 0;
}

/* The first of rank 0's parameter digests (count of them on fd) that
 * differs from this rank's; past the shorter list when one is a prefix of
 * the other; UINT64_MAX when all agree. */
static int first_difference(wtx__tcp_rank *r, int fd, uint32_t count, const waitspec *ws,
                            uint64_t *index) {
  uint8_t raw[4096];
  uint64_t v[sizeof raw / 8];
  const char *why = "";
  size_t n = r->params.n < count ? r->params.n : count;
  for (size_t i = 0; i < n;) {
    size_t k = n - i < sizeof raw / 8 ? n - i : sizeof raw / 8;
    if (read_full(fd, raw, k * 8, ws, &why) != 0) return WTX_EIO;
    wtx__tcp_trailer_get_sums(raw, v, k);
    for (size_t j = 0; j < k; j++, i++)
      if (v[j] != r->params.digests[i]) {
        *index = i;
        return 0;
      }
  }
  *index = count != r->params.n ? n : UINT64_MAX;
  return 0;
}

/* Rank 0 checking this rank's plan, whose digest (theirs) differs: where,
 * answered to rank 0 and kept in r->differs for this rank's own error. */
static void answer_rank0(wtx__tcp_rank *r, int fd, uint64_t theirs, const waitspec *ws) {
  uint8_t head[WTX__TCP_TRAILER_HEAD_BYTES], d[WTX__TCP_DIFF_BYTES];
  char text[WTX__TCP_DIFF_TEXT_MAX] = "";
  const char *why = "";
  uint32_t count = 0;
  uint64_t at = UINT64_MAX;
  snprintf(r->differs, sizeof r->differs, "tcp: rank 0's plan (digest %016llx) differs "
           "from this rank's (%016llx)", (unsigned long long)theirs,
           (unsigned long long)r->digest);
  if (read_full(fd, head, sizeof head, ws, &why) != 0 ||
      wtx__tcp_trailer_check(head, 0, UINT32_MAX, &count, text, sizeof text) != 0 ||
      first_difference(r, fd, count, ws, &at) != 0)
    return; /* rank 0 names no parameter, and neither does this rank */
  size_t len = strlen(r->differs);
  if (at < r->params.n) {
    r->params.describe(r->params.arg, (size_t)at, text, sizeof text);
    snprintf(r->differs + len, sizeof r->differs - len, ", first at parameter %llu: this "
             "rank has %s", (unsigned long long)at, text);
  } else if (at != UINT64_MAX) {
    snprintf(text, sizeof text, "no parameter %llu (it has %zu)", (unsigned long long)at,
             r->params.n);
    snprintf(r->differs + len, sizeof r->differs - len, ": rank 0 has %u parameters, this "
             "rank %zu", count, r->params.n);
  } else {
    snprintf(r->differs + len, sizeof r->differs - len, ", though every parameter's "
             "metadata and ownership agree: their views of the workers' shard rules differ");
  }
  wtx__tcp_diff_encode(d, at, (uint32_t)strlen(text));
  struct iovec v[2] = {{d, sizeof d}, {text, strlen(text)}};
  (void)write_iov_full(fd, v, 2, ws, &why);
}

/* Who a fresh connection says it is (hello, then who), within HELLO_MS: a
 * worker's index; -1 for a peer that is not one of ours; -2 for a worker
 * bringing another plan; -3 for rank 0's check, agreeing, or -4 not. */
static int64_t read_worker(wtx__tcp_rank *r, int fd, const waitspec *ws, uint64_t *theirs) {
  uint8_t h[WTX__TCP_HELLO_BYTES], who[WTX__TCP_WHO_BYTES], plan[WTX__TCP_PLAN_BYTES];
  const char *why = "";
  uint32_t index = 0;
  waitspec hello = within(HELLO_MS, ws->cancel_fd);
  if (hello.until > ws->until) hello.until = ws->until;
  if (read_full(fd, h, sizeof h, &hello, &why) != 0 ||
      wtx__tcp_hello_check(h, r->token, r->token_len) != 0 ||
      read_full(fd, who, sizeof who, &hello, &why) != 0 ||
      wtx__tcp_who_decode(who, &index, theirs) != 0 ||
      (index != WTX__TCP_WHO_RANK0 && (index >= r->n_workers || r->c[index].fd >= 0)))
    return -1;
  /* Answered either way, so the worker can name a plan that differs. */
  wtx__tcp_plan_encode(plan, r->digest);
  if (write_full(fd, plan, sizeof plan, &hello, &why) != 0) return -1;
  if (index == WTX__TCP_WHO_RANK0 && *theirs != r->digest) answer_rank0(r, fd, *theirs, ws);
  if (index == WTX__TCP_WHO_RANK0) return *theirs == r->digest ? -3 : -4;
  return *theirs == r->digest ? (int64_t)index : -2;
}

/* With shm_ring: the worker's ring record, or its host region's, that
 * opened, 'A' answered (a refusal closes the connection instead). */
static int take_ring(rank_conn *k, int fd, const waitspec *ws, char *err, size_t errlen) {
  uint8_t rec[WTX__TCP_RING_BYTES];
  char name[256] = "";
  const char *why = "";
  uint64_t cap = 0;
  uint32_t n = 0;
  int region = 0;
  int rc = read_full(fd, rec, sizeof rec, ws, &why);
  if (rc == 0 && wtx__tcp_ring_decode(rec, &cap, &n, &region) != 0) {
    why = "not a ring record";
    rc = WTX_EPROTO;
  }
  if (rc == 0) rc = read_full(fd, name, n, ws, &why);
  if (rc != 0) {
    snprintf(err, errlen, "tcp: a worker's ring: %s", why);
    return rc;
  }
  wtx__ring_destroy(k->ring);
  k->ring = NULL;
  wtx__host_region_free(k->hregion);
  k->hregion = NULL;
  rc = region ? wtx__host_region_open(name, cap, &k->hregion, err, errlen)
              : wtx__ring_open(name, &k->ring, err, errlen);
  if (rc != 0) return rc;
  uint8_t ack = 'A';
  return write_full(fd, &ack, 1, ws, &why);
}

/* With cuda_region: the worker's region record, the region opened, 'A'
 * answered (a refusal closes the connection instead). */
static int take_region(const wtx__tcp_rank *r, rank_conn *k, int fd, const waitspec *ws,
                       char *err, size_t errlen) {
  uint8_t rec[4 + WTX__IPC_REGION_RECORD];
  const char *why = "";
  int rc = read_full(fd, rec, sizeof rec, ws, &why);
  if (rc == 0 && memcmp(rec, WTX__TCP_REGION_MAGIC, 4) != 0) {
    why = "not a region record";
    rc = WTX_EPROTO;
  }
  if (rc != 0) {
    snprintf(err, errlen, "tcp: a worker's receive region: %s", why);
    return rc;
  }
  wtx__ipc_region_free(k->region);
  k->region = NULL;
  if ((rc = wtx__ipc_region_open(rec + 4, r->timeout_ms, &k->region, err, errlen)) != 0)
    return rc;
  uint8_t ack = 'A';
  return write_full(fd, &ack, 1, ws, &why);
}

/* What accept still waits for: rank 0's link, and (workers) every worker's
 * connection. */
static size_t rank_missing(const wtx__tcp_rank *r, int workers) {
  size_t n = r->want_link && r->link < 0;
  for (size_t w = 0; workers && w < r->n_workers; w++) n += r->c[w].fd < 0;
  return n;
}

/* accept and accept_link: until nothing is missing (rank_missing). */
static int rank_accept(wtx__tcp_rank *r, int workers, char *err, size_t errlen) {
  waitspec ws = within(r->timeout_ms, r->cancel_fd);
  int differs = 0;
  for (size_t missing = rank_missing(r, workers); missing > 0;) {
    int rc = wait_fd(r->lfd, POLLIN, &ws);
    if (rc != 0 && differs) return WTX_EINVAL; /* that is the news, not the rest */
    if (rc != 0) {
      if (r->want_link && r->link < 0)
        snprintf(err, errlen, "tcp: rank 0 did not link to this rank's port %s",
                 rc == WTX_ECANCELED ? "(cancelled)" : "within the timeout");
      else
        snprintf(err, errlen, "tcp: %zu of %zu workers did not connect to this rank's data "
                 "port %s", missing, r->n_workers, rc == WTX_ECANCELED ? "(cancelled)"
                 : "within the timeout");
      return rc;
    }
    int fd = accept4(r->lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) continue; /* EINTR, ECONNABORTED, ...: wait again */
    uint64_t theirs = 0;
    int64_t w = read_worker(r, fd, &ws, &theirs);
    if (w == -4) {
      /* Rank 0 knows too, and starts no worker's session. */
      close(fd);
      snprintf(err, errlen, "%s", r->differs);
      return WTX_EINVAL;
    }
    if (w == -2) {
      /* Every worker is answered before this fails, so that each names
       * this rank's plan in its own error rather than a reset. */
      close(fd);
      snprintf(err, errlen, "tcp: a worker brings rank 0's plan (digest %016llx), and this "
               "rank's differs (%016llx): its metadata, ownership or view of the workers "
               "differ from rank 0's", (unsigned long long)theirs,
               (unsigned long long)r->digest);
      differs = 1;
      missing -= (size_t)workers;
      continue;
    }
    if (w == -3 && r->want_link) {
      if (r->link >= 0) close(r->link); /* rank 0 linked again: the old one is done */
      else missing--;
      r->link = fd;
      continue;
    }
    if (w < 0) {
      close(fd); /* not our peer, or silent */
      continue;
    }
    /* what the worker offers to take the bytes instead of the socket */
    int trc = r->shm_ring      ? take_ring(&r->c[w], fd, &ws, err, errlen)
              : r->cuda_region ? take_region(r, &r->c[w], fd, &ws, err, errlen)
                               : 0;
    if (trc != 0) {
      close(fd);
      return trc;
    }
    tune(fd);
    r->c[w].fd = fd;
    r->c[w].seq = 0; /* a new session numbers its chunks afresh */
    missing -= (size_t)workers; /* accept_link takes it, but waits for the link */
  }
  return differs ? WTX_EINVAL : 0;
}

int wtx__tcp_rank_accept(wtx__tcp_rank *r, char *err, size_t errlen) {
  return rank_accept(r, 1, err, errlen);
}

int wtx__tcp_rank_accept_link(wtx__tcp_rank *r, char *err, size_t errlen) {
  return rank_accept(r, 0, err, errlen);
}

int wtx__tcp_rank_connected(wtx__tcp_rank *r) {
  for (size_t w = 0; w < r->n_workers; w++) {
    /* Workers never write on these: readable means closed or reset. */
    struct pollfd p = {.fd = r->c[w].fd, .events = POLLIN | POLLRDHUP};
    if (r->c[w].fd < 0 || poll(&p, 1, 0) != 0) return 0;
  }
  return 1;
}

void wtx__tcp_rank_reset(wtx__tcp_rank *r) {
  for (size_t w = 0; r->c != NULL && w < r->n_workers; w++) {
    if (r->c[w].fd >= 0) close(r->c[w].fd);
    r->c[w].fd = -1;
    wtx__ring_close(r->c[w].ring);
    wtx__ring_destroy(r->c[w].ring);
    r->c[w].ring = NULL;
    wtx__ipc_region_free(r->c[w].region);
    r->c[w].region = NULL;
    wtx__host_region_free(r->c[w].hregion);
    r->c[w].hregion = NULL;
  }
  uint64_t v;
  ssize_t got = r->cancel_fd >= 0 ? read(r->cancel_fd, &v, sizeof v) : 0;
  (void)got; /* a cancel is spent by the reset */
}

void wtx__tcp_rank_cancel(wtx__tcp_rank *r) {
  uint64_t one = 1;
  ssize_t w = write(r->cancel_fd, &one, sizeof one);
  (void)w;
}

int wtx__tcp_rank_chunk(wtx__tcp_rank *r, size_t w, uint64_t stream_offset,
                        uint64_t first_offset, uint64_t bytes, const struct iovec *iov,
                        size_t n, const uint64_t *ends, size_t n_ends, int sums, char *err,
                        size_t errlen) {
  if (w >= r->n_workers || r->c[w].fd < 0 || (sums && (n_ends == 0 || ends[n_ends - 1] != bytes))) {
    snprintf(err, errlen, "tcp: worker %zu is not connected to this rank, or the chunk's "
             "spans do not end at its end", w);
    return WTX_ESTATE;
  }
  rank_conn *k = &r->c[w];
  if (sums && n_ends > k->sums_cap) {
    uint64_t *s = realloc(k->sums, n_ends * sizeof *s);
    if (s == NULL) return WTX_ENOMEM;
    k->sums = s;
    k->sums_cap = n_ends;
  }
  uint64_t seq = k->seq;
  outlet o = {k->fd, k->ring, r->cancel_fd, k->h, &k->trailer, &k->trailer_cap, k->region,
              k->hregion, stream_offset, NULL};
  wtx_chunk_sums cs = {.ends = ends, .n = n_ends, .out = k->sums};
  waitspec ws = within(r->timeout_ms, r->cancel_fd); /* the whole chunk */
  const char *why = "";
  int rc = send_chunk(&o, &(wtx__tcp_frame){seq, first_offset, bytes}, iov, n, sums ? &cs : NULL,
                      1, &ws, &why);
  if (rc != 0) {
    snprintf(err, errlen, "tcp: sending chunk %llu to worker %zu: %s",
             (unsigned long long)seq, w, why);
    return rc;
  }
  k->seq++;
  return 0;
}

/* Rank 0's side of the check where the digests differ: its parameters'
 * digests out, the rank's first difference and text back, as err. */
static int ask_difference(int fd, uint32_t rank, const char *addr, const wtx__tcp_params *p,
                          const waitspec *ws, char *err, size_t errlen) {
  uint8_t head[WTX__TCP_TRAILER_HEAD_BYTES], d[WTX__TCP_DIFF_BYTES];
  uint8_t *list = malloc(p->n * 8 + 1);
  char theirs[WTX__TCP_DIFF_TEXT_MAX + 1] = "", ours[WTX__TCP_DIFF_TEXT_MAX] = "";
  const char *why = "";
  uint64_t at = 0;
  uint32_t len = 0;
  if (list == NULL) return WTX_ENOMEM;
  wtx__tcp_trailer_encode(head, 0, (uint32_t)p->n);
  wtx__tcp_trailer_put_sums(list, p->digests, p->n);
  struct iovec v[2] = {{head, sizeof head}, {list, p->n * 8}};
  int rc = write_iov_full(fd, v, 2, ws, &why);
  free(list);
  if (rc == 0) rc = read_full(fd, d, sizeof d, ws, &why);
  if (rc == 0 && wtx__tcp_diff_decode(d, &at, &len) != 0) rc = WTX_EPROTO;
  if (rc == 0) rc = read_full(fd, theirs, len, ws, &why);
  int n = snprintf(err, errlen, "many senders: rank %u (%s) planned this sync differently "
                   "from rank 0", rank, addr);
  size_t k = n > 0 && (size_t)n < errlen ? (size_t)n : errlen;
  if (rc != 0 || k >= errlen) return WTX_EINVAL; /* it named nothing: the digests say enough */
  if (at < p->n) {
    p->describe(p->arg, (size_t)at, ours, sizeof ours);
    snprintf(err + k, errlen - k, ", first at parameter %llu: rank 0 has %s; rank %u has %s",
             (unsigned long long)at, ours, rank, theirs);
  } else if (at != UINT64_MAX) {
    snprintf(err + k, errlen - k, ": rank 0 has %zu parameters, and the first %llu agree; "
             "rank %u has %s", p->n, (unsigned long long)at, rank, theirs);
  } else {
    snprintf(err + k, errlen - k, ", though every parameter's metadata and ownership "
             "agree: their views of the workers' shard rules differ");
  }
  return WTX_EINVAL;
}

int wtx__tcp_rank_check(const char *addr, uint32_t rank, const uint8_t *token, size_t token_len,
                        uint64_t plan_digest, const wtx__tcp_params *params,
                        uint32_t timeout_ms, int *link, char *err, size_t errlen) {
  waitspec ws = within(timeout_ms, -1);
  uint8_t who[WTX__TCP_WHO_BYTES], plan[WTX__TCP_PLAN_BYTES];
  const char *why = "";
  uint64_t theirs = 0;
  int fd = -1;
  int rc = connect_rank(addr, NULL, &ws, &fd, err, errlen);
  if (rc != 0) return rc;
  wtx__tcp_who_encode(who, WTX__TCP_WHO_RANK0, plan_digest);
  if ((rc = send_hello(fd, token, token_len, &ws, &why)) == 0 &&
      (rc = write_full(fd, who, sizeof who, &ws, &why)) == 0 &&
      (rc = read_full(fd, plan, sizeof plan, &ws, &why)) == 0 &&
      wtx__tcp_plan_decode(plan, &theirs) != 0) {
    why = "its answer is not a plan record";
    rc = WTX_EPROTO;
  }
  if (rc != 0)
    snprintf(err, errlen, "many senders: checking rank %u's plan at %s: %s", rank, addr,
             why[0] ? why : "no answer with this session's token");
  else if (theirs != plan_digest)
    rc = ask_difference(fd, rank, addr, params, &ws, err, errlen);
  if (rc == 0 && link != NULL) *link = fd;
  else close(fd);
  return rc;
}

int wtx__tcp_link_alive(int link) {
  /* Ranks write on the link only a delta's answer, which rank 0 reads in
   * the same sync: readable between syncs means closed (a dead rank). */
  struct pollfd p = {.fd = link, .events = POLLIN | POLLRDHUP};
  return link >= 0 && poll(&p, 1, 0) == 0;
}

int wtx__tcp_link_go(int link, uint64_t generation, const uint8_t *payload, size_t len,
                     uint32_t timeout_ms, char *err, size_t errlen) {
  uint8_t g[WTX__TCP_GO_BYTES];
  const char *why = "";
  waitspec ws = within(timeout_ms, -1);
  wtx__tcp_go_encode(g, generation, (uint32_t)len);
  struct iovec v[2] = {{g, sizeof g}, {(void *)payload, len}};
  int rc = write_iov_full(link, v, len > 0 ? 2 : 1, &ws, &why);
  if (rc != 0) snprintf(err, errlen, "tcp: the go to a rank: %s", why);
  return rc;
}

int wtx__tcp_rank_go(wtx__tcp_rank *r, uint64_t *generation, uint8_t *payload, size_t cap,
                     size_t *len, char *err, size_t errlen) {
  uint8_t g[WTX__TCP_GO_BYTES];
  const char *why = "";
  uint32_t n = 0;
  waitspec ws = within(r->timeout_ms, r->cancel_fd);
  int rc = r->link >= 0 ? read_full(r->link, g, sizeof g, &ws, &why) : WTX_ESTATE;
  if (rc == 0 && (wtx__tcp_go_decode(g, generation, &n) != 0 || n > cap)) {
    why = "not a go record";
    rc = WTX_EPROTO;
  }
  if (rc == 0) rc = read_full(r->link, payload, n, &ws, &why);
  if (rc == 0) {
    *len = n;
    return 0;
  }
  snprintf(err, errlen, "tcp: waiting for rank 0's go: %s", r->link < 0 ? "no link" : why);
  wtx__tcp_rank_unlink(r); /* rank 0 links again when it can */
  return rc;
}

/* A delta record of kind with its len bytes of payload (may be NULL when
 * len is 0) on fd. */
static int delta_send(int fd, uint32_t kind, const uint8_t *payload, size_t len,
                      const waitspec *ws, const char **why) {
  uint8_t d[WTX__TCP_DELTA_BYTES];
  wtx__tcp_delta_encode(d, kind, len);
  struct iovec v[2] = {{d, sizeof d}, {(void *)payload, len}};
  return write_iov_full(fd, v, len > 0 ? 2 : 1, ws, why);
}

/* A delta record of kind into payload: its payload at least min and at
 * most cap bytes, *len of them. */
static int delta_take(int fd, uint32_t kind, uint8_t *payload, size_t min, size_t cap,
                      size_t *len, const waitspec *ws, const char **why) {
  uint8_t d[WTX__TCP_DELTA_BYTES];
  uint64_t n = 0;
  int rc = read_full(fd, d, sizeof d, ws, why);
  if (rc == 0 && (wtx__tcp_delta_decode(d, kind, &n) != 0 || n < min || n > cap)) {
    *why = "not the delta record expected, or not of the plan's size";
    rc = WTX_EPROTO;
  }
  if (rc == 0) *len = (size_t)n;
  return rc != 0 || n == 0 ? rc : read_full(fd, payload, (size_t)n, ws, why);
}

/* Rank 0: a delta record of kind on link; what: the step, for err. */
static int link_send(int link, uint32_t kind, const uint8_t *payload, size_t len,
                     uint32_t timeout_ms, const char *what, char *err, size_t errlen) {
  const char *why = "";
  waitspec ws = within(timeout_ms, -1);
  int rc = delta_send(link, kind, payload, len, &ws, &why);
  if (rc != 0) snprintf(err, errlen, "tcp: %s: %s", what, why);
  return rc;
}

int wtx__tcp_link_ask(int link, const uint8_t *ask, size_t len, uint32_t timeout_ms, char *err,
                      size_t errlen) {
  return link_send(link, WTX__TCP_DELTA_ASK, ask, len, timeout_ms,
                   "asking a rank what it changed", err, errlen);
}

int wtx__tcp_link_answer(int link, uint8_t *answer, size_t min, size_t cap, size_t *len,
                         uint32_t timeout_ms, char *err, size_t errlen) {
  const char *why = "";
  waitspec ws = within(timeout_ms, -1);
  int rc = delta_take(link, WTX__TCP_DELTA_ANSWER, answer, min, cap, len, &ws, &why);
  if (rc != 0) snprintf(err, errlen, "tcp: a rank's answer of what it changed: %s", why);
  return rc;
}

int wtx__tcp_link_tell(int link, const uint8_t *decision, size_t len, uint32_t timeout_ms,
                       char *err, size_t errlen) {
  return link_send(link, WTX__TCP_DELTA_DECISION, decision, len, timeout_ms,
                   "telling a rank what the delta sends", err, errlen);
}

/* A rank's side of the exchange failed: its link goes (rank 0 links again
 * when it can). */
static int rank_delta_failed(wtx__tcp_rank *r, int rc, const char *why, char *err,
                             size_t errlen) {
  snprintf(err, errlen, "tcp: the delta's exchange with rank 0: %s",
           r->link < 0 ? "no link" : why);
  wtx__tcp_rank_unlink(r);
  return rc;
}

int wtx__tcp_rank_asked(wtx__tcp_rank *r, uint8_t *ask, size_t len, char *err, size_t errlen) {
  const char *why = "";
  waitspec ws = within(r->timeout_ms, r->cancel_fd);
  size_t got = 0;
  int rc = r->link >= 0 ? delta_take(r->link, WTX__TCP_DELTA_ASK, ask, len, len, &got, &ws, &why)
                        : WTX_ESTATE;
  return rc == 0 ? 0 : rank_delta_failed(r, rc, why, err, errlen);
}

int wtx__tcp_rank_answer(wtx__tcp_rank *r, const uint8_t *mine, size_t len, uint8_t *decision,
                         size_t dmin, size_t dcap, size_t *dlen, char *err, size_t errlen) {
  const char *why = "";
  waitspec ws = within(r->timeout_ms, r->cancel_fd);
  int rc = r->link >= 0 ? delta_send(r->link, WTX__TCP_DELTA_ANSWER, mine, len, &ws, &why)
                        : WTX_ESTATE;
  if (rc == 0)
    rc = delta_take(r->link, WTX__TCP_DELTA_DECISION, decision, dmin, dcap, dlen, &ws, &why);
  return rc == 0 ? 0 : rank_delta_failed(r, rc, why, err, errlen);
}

/* The watch: until stop_fd is written, or rank 0 closes the link (its
 * sync failed, or it died), which cancels every wait of this rank. Only
 * POLLRDHUP of the link: a record waiting on it (the go) is no close. */
static void *watch_main(void *arg) {
  wtx__tcp_rank *r = arg;
  struct pollfd p[2] = {{.fd = r->link, .events = POLLRDHUP},
                        {.fd = r->watch_stop_fd, .events = POLLIN}};
  while (poll(p, 2, -1) < 0 && errno == EINTR) {
  }
  if (p[1].revents == 0 && p[0].revents != 0) {
    atomic_store(&r->ended, 1);
    wtx__tcp_rank_cancel(r);
  }
  return NULL;
}

int wtx__tcp_rank_watch(wtx__tcp_rank *r) {
  atomic_store(&r->ended, 0);
  if (r->link < 0 || r->watching) return 0;
  int rc = pthread_create(&r->watcher, NULL, watch_main, r);
  r->watching = rc == 0;
  return rc == 0 ? 0 : WTX_ENOMEM;
}

int wtx__tcp_rank_unwatch(wtx__tcp_rank *r) {
  if (!r->watching) return 0;
  uint64_t one = 1, v;
  ssize_t n = write(r->watch_stop_fd, &one, sizeof one);
  pthread_join(r->watcher, NULL);
  n = read(r->watch_stop_fd, &v, sizeof v); /* spent: the next watch waits anew */
  (void)n;
  r->watching = 0;
  return atomic_load(&r->ended);
}

int wtx__tcp_rank_linked(const wtx__tcp_rank *r) {
  /* POLLRDHUP and not POLLIN: a record waiting on the link is not a close. */
  struct pollfd p = {.fd = r->link, .events = POLLRDHUP};
  return r->link >= 0 && poll(&p, 1, 0) == 0;
}

void wtx__tcp_rank_unlink(wtx__tcp_rank *r) {
  if (r->link >= 0) close(r->link);
  r->link = -1;
}
