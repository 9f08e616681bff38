/* shm: same-host transfer through POSIX shared memory.
 *
 * The trainer writes each chunk into a shared-memory object it owns and names
 * it in the chunk's ShmUpdateInfo; the worker maps the object read-only and
 * copies the chunk once, straight into the model's staging memory, hashing
 * it on the way. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "transport/transport.h"

typedef struct shm_worker {
  wtx_wire_params wire;
} shm_worker;


static int shm_worker_init(const Wtx__V1__InitInfo *init,
                           const wtx_wire_params *wire, void **self,
                           char *data_address, size_t addrlen, char *err,
                           size_t errlen) {
  (void)init;
  (void)err;
  (void)errlen;
  shm_worker *w = calloc(1, sizeof *w);
  if (w == NULL) return WTX_ENOMEM;
  w->wire = *wire;
  if (addrlen > 0) data_address[0] = '\0';
  *self = w;
  return 0;
}

static int shm_worker_receive(void *self, const Wtx__V1__UpdateInfo *info,
                              wtx_rx *rx) {
  (void)self;
  if (info->backend_case != WTX__V1__UPDATE_INFO__BACKEND_SHM) {
    wtx_rx_errorf(rx, "update_info.shm: missing (the session's backend is shm)");
    return WTX_EINVAL;
  }
  const Wtx__V1__ShmUpdateInfo *u = info->shm;
  if (u->region[0] != '/' || strchr(u->region + 1, '/') != NULL ||
      strlen(u->region) > 255) {
    wtx_rx_errorf(rx,
                  "update_info.shm.region: '%s' is not a POSIX shm name "
                  "('/name', at most 255 bytes)",
                  u->region);
    return WTX_EINVAL;
  }
  uint64_t length = wtx_rx_remaining(rx);
  int fd = shm_open(u->region, O_RDONLY, 0);
  if (fd < 0) {
    wtx_rx_errorf(rx, "update_info.shm.region: cannot open '%s': %s",
                  u->region, strerror(errno));
    return WTX_EIO;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || (uint64_t)st.st_size < u->offset ||
      (uint64_t)st.st_size - u->offset < length) {
    wtx_rx_errorf(rx,
                  "update_info.shm: range [%llu, +%llu) is outside region "
                  "'%s' (%lld bytes)",
                  (unsigned long long)u->offset, (unsigned long long)length,
                  u->region, (long long)st.st_size);
    close(fd);
    return WTX_EINVAL;
  }
  int rc = 0;
  if (length > 0) {
    long page = sysconf(_SC_PAGESIZE);
    uint64_t base = u->offset - u->offset % (uint64_t)page;
    size_t maplen = (size_t)(u->offset - base + length);
    void *map = mmap(NULL, maplen, PROT_READ, MAP_SHARED, fd, (off_t)base);
    if (map == MAP_FAILED) {
      wtx_rx_errorf(rx, "cannot map region '%s': %s", u->region,
                    strerror(errno));
      rc = WTX_EIO;
    } else {
      rc = wtx_rx_bytes(rx, (const uint8_t *)map + (u->offset - base),
                        (size_t)length);
      munmap(map, maplen);
    }
  }
  close(fd);
  return rc;
}

static void shm_worker_destroy(void *self) { free(self); }

const wtx_worker_transport wtx_shm_worker_transport = {
    .name = "shm",
    .supports_draft = 1,
    .init = shm_worker_init,
    .receive = shm_worker_receive,
    .destroy = shm_worker_destroy,
};
