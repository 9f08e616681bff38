/* A worker's receive region in host shared memory (host_region.h). */
#include "transport/host_region.h"

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "transport/sigbus.h"

struct wtx__host_region {
  uint8_t *base;
  uint64_t bytes;
  char name[96]; /* "" once unlinked, or on the sender's side */
};

int wtx__shm_object_make(const char *kind, size_t len, char *name, size_t nlen, int *fd,
                         char *err, size_t errlen) {
  static _Atomic unsigned counter;
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  snprintf(name, nlen, "/wtx-%s-%d-%u-%lx", kind, (int)getpid(),
           atomic_fetch_add(&counter, 1), (long)ts.tv_nsec);
  *fd = shm_open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (*fd >= 0 && ftruncate(*fd, (off_t)len) == 0) return 0;
  snprintf(err, errlen, "shm %s: cannot make %s of %zu bytes: %s", kind, name, len,
           strerror(errno));
  if (*fd >= 0) {
    close(*fd);
    shm_unlink(name);
  }
  *fd = -1;
  return WTX_EIO;
}

int wtx__shm_object_open(const char *name, int *fd, uint64_t *size) {
  struct stat st;
  *fd = strncmp(name, "/wtx-", 5) == 0 && strchr(name + 1, '/') == NULL
            ? shm_open(name, O_RDWR | O_NOFOLLOW | O_CLOEXEC, 0)
            : -1;
  if (*fd < 0) return WTX_EIO;
  if (fstat(*fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
    close(*fd);
    *fd = -1;
    return WTX_EPERM;
  }
  *size = (uint64_t)st.st_size;
  return 0;
}

/* Maps fd's bytes shared; NULL when it cannot. */
static uint8_t *map(int fd, uint64_t bytes) {
  if (bytes > SIZE_MAX) return NULL;
  void *m = mmap(NULL, (size_t)bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  return m == MAP_FAILED ? NULL : m;
}

/* Whether the file system fd is on can hold bytes at all: a region
 * larger than shared memory (a container's /dev/shm: 64 MiB by default)
 * is declined at init, not left to fail page by page in the senders'
 * copies. Its pages are not taken now: a new session's region is made
 * while the last one's still stands, and taking both would need twice
 * the room. */
static int fits(int fd, uint64_t bytes, char *err, size_t errlen) {
  struct statvfs fs;
  if (fstatvfs(fd, &fs) != 0 || (uint64_t)fs.f_blocks * fs.f_frsize >= bytes) return 1;
  snprintf(err, errlen, "shm region: shared memory holds %llu bytes in all, less than the "
           "region's %llu", (unsigned long long)fs.f_blocks * fs.f_frsize,
           (unsigned long long)bytes);
  return 0;
}

int wtx__host_region_make(uint64_t bytes, uint64_t max_bytes, wtx__host_region **out,
                          char *err, size_t errlen) {
  if (bytes == 0) bytes = 1;
  if (max_bytes > 0 && bytes > max_bytes) {
    snprintf(err, errlen, "init_info.tcp.shm_region_bytes: %llu, over --max-model-bytes "
             "(%llu)", (unsigned long long)bytes, (unsigned long long)max_bytes);
    return WTX_EUNAVAIL;
  }
  wtx__host_region *r = calloc(1, sizeof *r);
  if (r == NULL) return WTX_ENOMEM;
  int fd = -1;
  int rc = bytes > SIZE_MAX ? WTX_EIO
                            : wtx__shm_object_make("region", (size_t)bytes, r->name,
                                                   sizeof r->name, &fd, err, errlen);
  if (rc == 0 && !fits(fd, bytes, err, errlen)) rc = WTX_EIO;
  if (rc == 0 && (r->base = map(fd, bytes)) == NULL) {
    snprintf(err, errlen, "shm region: cannot map %llu bytes: %s", (unsigned long long)bytes,
             strerror(errno));
    rc = WTX_EIO;
  }
  if (fd >= 0) close(fd);
  r->bytes = bytes;
  if (rc != 0) {
    wtx__host_region_free(r);
    return WTX_EUNAVAIL;
  }
  *out = r;
  return 0;
}

const char *wtx__host_region_name(const wtx__host_region *r) { return r->name; }

void wtx__host_region_unlink(wtx__host_region *r) {
  if (r == NULL || r->name[0] == '\0') return;
  shm_unlink(r->name);
  r->name[0] = '\0';
}

int wtx__host_region_get(const wtx__host_region *r, uint8_t **base, uint64_t *bytes) {
  *base = r->base;
  *bytes = r->bytes;
  return 0;
}

int wtx__host_region_out(wtx__host_region *r, uint64_t at, wtx_rx *rx) {
  int rc = wtx_rx_in_region(rx, at, r->bytes, "tcp");
  if (rc != 0) return rc;
  uint8_t *dst;
  for (size_t k; rc == 0 && (k = wtx_rx_next(rx, &dst)) > 0; at += k) {
    const uint8_t *src = r->base + at;
    rc = dst == src ? wtx_rx_commit(rx, k) : wtx_rx_bytes(rx, src, k);
  }
  return rc; /* what is missing, the chunk's end says */
}

int wtx__host_region_open(const char *name, uint64_t bytes, wtx__host_region **out, char *err,
                          size_t errlen) {
  int fd;
  uint64_t size = 0;
  int rc = wtx__shm_object_open(name, &fd, &size);
  wtx__host_region *r = NULL;
  if (rc == 0 && size != bytes) rc = WTX_EPROTO;
  if (rc == 0 && (r = calloc(1, sizeof *r)) == NULL) rc = WTX_ENOMEM;
  if (rc == 0 && (r->base = map(fd, bytes)) == NULL) rc = WTX_EIO;
  if (fd >= 0) close(fd);
  if (rc != 0) {
    snprintf(err, errlen, "shm: cannot open the worker's receive region: %s",
             rc == WTX_EIO     ? strerror(errno)
             : rc == WTX_EPERM ? "not a region of this user"
             : rc == WTX_EPROTO ? "not the size the worker said"
                               : "out of memory");
    free(r);
    return rc;
  }
  r->bytes = bytes;
  *out = r;
  return 0;
}

typedef struct put_job {
  uint8_t *dst;
  const struct iovec *iov;
  size_t n;
} put_job;

static int put_pieces(void *arg) {
  put_job *j = arg;
  uint8_t *d = j->dst;
  for (size_t i = 0; i < j->n; d += j->iov[i].iov_len, i++)
    memcpy(d, j->iov[i].iov_base, j->iov[i].iov_len);
  return 0;
}

int wtx__host_region_put(wtx__host_region *r, uint64_t *at, const struct iovec *iov, size_t n,
                         const char **why) {
  uint64_t end = *at;
  for (size_t i = 0; i < n; i++) end += iov[i].iov_len;
  if (end > r->bytes || end < *at) {
    *why = "the chunk ends past the worker's receive region";
    return WTX_EINVAL;
  }
  /* A page of shared memory with no room left behind it (or cut off by a
   * truncate) raises SIGBUS in the copy: an error of this chunk, not the
   * end of the trainer. */
  put_job j = {r->base + *at, iov, n};
  if (wtx__sigbus_guard(r->base, (size_t)r->bytes, put_pieces, &j) != 0) {
    *why = "shared memory has no room left for the worker's receive region (/dev/shm)";
    return WTX_EIO;
  }
  *at = end;
  return 0;
}

void wtx__host_region_free(wtx__host_region *r) {
  if (r == NULL) return;
  wtx__host_region_unlink(r);
  if (r->base != NULL) munmap(r->base, (size_t)r->bytes);
  free(r);
}
