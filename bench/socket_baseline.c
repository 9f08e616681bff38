/* Same-run baseline for bench/run.sh: one loopback TCP stream, a plain C
 * sender and receiver (two threads, 1 MiB writes and reads, 4 MiB socket
 * buffers as the tcp backend sets), SIZE bytes, three times on a new
 * connection each. Prints the best in GB/s: what the tcp backend could at
 * best reach on this machine. With "lowat" after BYTES, the receiver also
 * asks to be woken only once a whole read's MiB is in (SO_RCVLOWAT), as
 * the tcp worker does (transport/tcp.c, wake_after); iperf3 does not.
 * With "chain N", the tcp chain's shape in plain C: the sender, N - 1
 * relays that each read a MiB and write it on, and a last receiver, a
 * thread each; it prints the GB/s each receiver got, which against the one
 * stream is what the machine's cores allow a relay chain. With "splice"
 * after N, each relay moves the stream through pipes instead of its own
 * buffer: splice from the socket into a pipe, tee into a second pipe,
 * splice that on downstream and read the first into its buffer, so the
 * kernel copies each byte once on a relay (into the buffer), not twice.
 * With "model" (after the rest), the same streams carry a model's bytes
 * as wtx does: the sender writes from a buffer of BYTES and every receiver
 * reads into its own buffer of BYTES (relays write on from there), each
 * touched before the clock starts and reused, as a worker reuses its
 * spare version; the 1 MiB buffer above stays in cache, these come from
 * and go to memory. Nothing is hashed: the ceiling for wtx's work on this
 * machine without checksums.
 * usage: socket_baseline BYTES [lowat | chain N [splice]] [model] */
/* splice, tee and F_SETPIPE_SZ: _GNU_SOURCE, which the build defines */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bench/pair.h"
#include "common/clock.h"

#define PIECE (1 << 20)
#define MAX_HOPS 8

static size_t total;
static int lowat, hops = 1, use_splice, use_model;
static char *model[MAX_HOPS + 1]; /* with "model": receiver i's at i, the sender's at hops */
static int lfds[MAX_HOPS], ports[MAX_HOPS]; /* receiver i listens on lfds[i] */
static size_t got[MAX_HOPS];

static void tune(int fd) {
  int one = 1, buf = 4 << 20;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
}

/* A loopback listener in *lfd, its port in *port; nonzero on failure. */
static int listen_on(int *lfd, int *port) {
  struct sockaddr_in a = {.sin_family = AF_INET};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  *lfd = socket(AF_INET, SOCK_STREAM, 0);
  if (*lfd < 0 || bind(*lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(*lfd, 1) != 0 ||
      getsockname(*lfd, (struct sockaddr *)&a, &len) != 0)
    return 1;
  *port = ntohs(a.sin_port);
  return 0;
}

/* A tuned connection to receiver i; the process exits when it fails. */
static int dial(int i) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)ports[i])};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  tune(fd);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) exit(1);
  return fd;
}

static void write_all(int fd, const char *p, size_t n) {
  for (ssize_t w; n > 0; p += w, n -= (size_t)w)
    if ((w = write(fd, p, n)) <= 0) exit(1);
}

/* Where side's bytes at off come from or go: with "model", its own model
 * buffer there; else its one hot buffer, over and over. */
static char *bytes_at(int side, char *buf, size_t off) {
  return use_model ? model[side] + off : buf;
}

static void *sender(void *arg) {
  (void)arg;
  int fd = dial(0);
  char *buf = calloc(1, PIECE);
  for (size_t sent = 0; buf != NULL && sent < total;) {
    size_t k = total - sent < PIECE ? total - sent : PIECE;
    write_all(fd, bytes_at(hops, buf, sent), k);
    sent += k;
  }
  close(fd);
  free(buf);
  return NULL;
}

/* A relay's piece through pipes a and b (blocking): up to PIECE bytes
 * from fd into a, teed into b and spliced on to down, then read out of a
 * into buf. The bytes it moved, 0 at the stream's end. */
static ssize_t splice_piece(int fd, int down, const int a[2], const int b[2], char *buf) {
  ssize_t r = splice(fd, NULL, a[1], NULL, PIECE, SPLICE_F_MOVE);
  if (r <= 0) return r;
  for (ssize_t t = 0, n; t < r; t += n)
    if ((n = tee(a[0], b[1], (size_t)(r - t), 0)) <= 0) exit(1);
  for (ssize_t s = 0, n; s < r; s += n)
    if ((n = splice(b[0], NULL, down, NULL, (size_t)(r - s), SPLICE_F_MOVE)) <= 0) exit(1);
  for (ssize_t g = 0, n; g < r; g += n)
    if ((n = read(a[0], buf + g, (size_t)(r - g))) <= 0) exit(1);
  return r;
}

/* Receiver i: takes the stream on lfds[i], writes each read on to the
 * next receiver unless it is the last, and counts in got[i]. */
static void *receiver(void *arg) {
  int i = (int)(intptr_t)arg;
  int fd = accept(lfds[i], NULL, NULL), down = i + 1 < hops ? dial(i + 1) : -1;
  tune(fd);
  int want = PIECE;
  if (lowat) setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want);
  char *buf = malloc(PIECE);
  got[i] = 0;
  int a[2], b[2], piped = down >= 0 && use_splice;
  /* Each pipe holds a whole piece: tee gives b a reference to every page
   * in a and leaves them there for the read. */
  if (piped && (pipe(a) != 0 || pipe(b) != 0 || fcntl(a[1], F_SETPIPE_SZ, PIECE) < 0 ||
                fcntl(b[1], F_SETPIPE_SZ, PIECE) < 0))
    exit(1);
  for (ssize_t r; buf != NULL; got[i] += (size_t)r) {
    char *to = bytes_at(i, buf, got[i]);
    size_t room = use_model && total - got[i] < PIECE ? total - got[i] : PIECE;
    r = room == 0 ? 0 : piped ? splice_piece(fd, down, a, b, to) : read(fd, to, room);
    if (r <= 0) break;
    if (down >= 0 && !piped) write_all(down, to, (size_t)r);
  }
  for (int k = 0; piped && k < 2; k++) close(a[k]), close(b[k]);
  if (down >= 0) close(down);
  close(fd);
  free(buf);
  return NULL;
}

/* Seconds to stream total bytes once through every receiver, each on a
 * new connection; -1 on failure. */
static double stream_once(void *arg) {
  (void)arg;
  pthread_t t[MAX_HOPS + 1];
  double t0 = wtx__clock_s();
  int n = 0;
  for (; n < hops; n++)
    if (pthread_create(&t[n], NULL, receiver, (void *)(intptr_t)n) != 0) break;
  int sending = n == hops && pthread_create(&t[n], NULL, sender, NULL) == 0;
  if (!sending) exit(1); /* started receivers wait in accept */
  for (int i = 0; i <= hops; i++) pthread_join(t[i], NULL);
  double dt = wtx__clock_s() - t0;
  for (int i = 0; i < hops; i++)
    if (got[i] != total) return -1;
  return dt;
}

/* With "model": every model buffer allocated and touched; nonzero on failure. */
static int make_models(void) {
  for (int i = 0; i <= hops; i++) {
    if ((model[i] = malloc(total)) == NULL) return 1;
    memset(model[i], i + 1, total);
  }
  return 0;
}

int main(int argc, char **argv) {
  total = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)1 << 30;
  for (int a = 2; a < argc; a++) {
    if (strcmp(argv[a], "lowat") == 0) lowat = 1;
    else if (strcmp(argv[a], "chain") == 0 && a + 1 < argc) hops = atoi(argv[++a]);
    else if (strcmp(argv[a], "splice") == 0) use_splice = 1;
    else if (strcmp(argv[a], "model") == 0) use_model = 1;
    else return 2;
  }
  if (hops < 1 || hops > MAX_HOPS || total == 0) return 2;
  if (use_model && make_models() != 0) return 1;
  for (int i = 0; i < hops; i++)
    if (listen_on(&lfds[i], &ports[i]) != 0) return 1;
  double best = wtx__bench_best_s(stream_once, NULL, 0, 3); /* as wtx's figures */
  if (best < 0) return 1;
  const char *m = use_model ? "_model" : "";
  if (hops > 1)
    printf("socket_chain%d%s%s_gbps %.3f\n", hops, use_splice ? "_splice" : "", m,
           total / best / 1e9);
  else
    printf("socket_stream%s_gbps %.3f\n", m, total / best / 1e9);
  return 0;
}
