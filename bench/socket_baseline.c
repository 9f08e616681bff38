/* Same-run baseline for bench/run.sh: one loopback TCP stream, a plain C
 * sender and receiver (two threads, 1 MiB writes and reads, 4 MiB socket
 * buffers as the tcp backend sets), SIZE bytes, three times on a new
 * connection each. Prints the best in GB/s: what the tcp backend could at
 * best reach on this machine. With "lowat" after BYTES, the receiver also
 * asks to be woken only once a whole read's MiB is in (SO_RCVLOWAT), as
 * the tcp worker does (transport/tcp.c, wake_after); iperf3 does not.
 * usage: socket_baseline BYTES [lowat] */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "bench/pair.h"
#include "common/clock.h"

#define PIECE (1 << 20)

static size_t total;
static int port, lowat;

static void tune(int fd) {
  int one = 1, buf = 4 << 20;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
}

static void *sender(void *arg) {
  (void)arg;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  tune(fd);
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) exit(1);
  char *buf = calloc(1, PIECE);
  for (size_t sent = 0; sent < total;) {
    size_t k = total - sent < PIECE ? total - sent : PIECE;
    ssize_t w = write(fd, buf, k);
    if (w <= 0) exit(1);
    sent += (size_t)w;
  }
  close(fd);
  free(buf);
  return NULL;
}

/* Seconds to stream total bytes once over a new connection to the
 * listening socket *arg; -1 on failure. */
static double stream_once(void *arg) {
  int lfd = *(const int *)arg;
  pthread_t t;
  double t0 = wtx_clock_s();
  if (pthread_create(&t, NULL, sender, NULL) != 0) return -1;
  int fd = accept(lfd, NULL, NULL);
  tune(fd);
  int want = PIECE;
  if (lowat) setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want);
  char *buf = malloc(PIECE);
  size_t got = 0;
  for (ssize_t r; buf != NULL && (r = read(fd, buf, PIECE)) > 0;) got += (size_t)r;
  double dt = wtx_clock_s() - t0;
  pthread_join(t, NULL);
  close(fd);
  free(buf);
  return got == total ? dt : -1;
}

int main(int argc, char **argv) {
  total = argc > 1 ? strtoull(argv[1], NULL, 10) : (size_t)1 << 30;
  lowat = argc > 2 && strcmp(argv[2], "lowat") == 0;
  int lfd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (bind(lfd, (struct sockaddr *)&a, sizeof a) != 0 || listen(lfd, 1) != 0 ||
      getsockname(lfd, (struct sockaddr *)&a, &len) != 0)
    return 1;
  port = ntohs(a.sin_port);
  double best = wtx__bench_best_s(stream_once, &lfd, 0, 3); /* as wtx's figures */
  if (best < 0) return 1;
  printf("socket_stream_gbps %.3f\n", total / best / 1e9);
  return 0;
}
