/* shm: same-host transfer through POSIX shared memory.
 *
 * The trainer writes each chunk into a shared-memory object it owns and names
 * it in the chunk's ShmUpdateInfo; the worker opens the object (once, while
 * the trainer keeps using it; only "/wtx-..." objects of its own user) and
 * reads the chunk once with pread, straight into the model's staging
 * memory, hashing it on the way.
 *
 * Trainer half: one object of num_buffers x buffer_size bytes; buffer k is
 * the range [k * buffer_size, +buffer_size). The bytes are in place once
 * packed (no connect, post or complete): the workers' UpdateWeights
 * returning is the end of the copy. */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "transport/transport.h"

/* Regions a worker reads: named by the project's prefix and owned by the
 * worker's own user (docs/security.md). */
#define REGION_PREFIX "/wtx-"
/* Bytes read per pread: the chunk lands in model memory piece by piece,
 * hashed right after while the piece is still in L2. */
#define PIECE ((size_t)256 << 10)
/* A tensor smaller than this is not read on its own: one pread fills a
 * bounce piece with it and the tensors after it, which the assembler then
 * copies out (a syscall per 16-byte tensor costs 100x its copy). */
#define SMALL ((size_t)16 << 10)

typedef struct shm_worker {
  wtx_wire_params wire;
  /* The trainer's region stays open across chunks; it is read with pread,
   * never mapped, so a region that shrinks or disappears mid-chunk is a
   * short read (an error), never SIGBUS. */
  char region[256];
  int fd;
  atomic_int cancelled;
  uint8_t *bounce; /* PIECE bytes, allocated at the first small tensor */
} shm_worker;

static void close_region(shm_worker *w) {
  if (w->fd >= 0) close(w->fd);
  w->fd = -1;
  w->region[0] = '\0';
}

static int shm_worker_init(const Wtx__V1__InitInfo *init, const wtx_wire_params *wire,
                           const wtx_worker_env *env, void **self, char *err,
                           size_t errlen) {
  (void)env; /* this backend connects nowhere */
  (void)init;
  (void)err;
  (void)errlen;
  shm_worker *w = calloc(1, sizeof *w);
  if (w == NULL) return WTX_ENOMEM;
  w->wire = *wire;
  w->fd = -1;
  atomic_init(&w->cancelled, 0);
  *self = w;
  return 0;
}

/* From any thread: the read stops before its next piece. */
static void shm_worker_cancel(void *self) {
  atomic_store(&((shm_worker *)self)->cancelled, 1);
}

/* After an abort the backend serves the next update. */
static void shm_worker_reset(void *self) {
  atomic_store(&((shm_worker *)self)->cancelled, 0);
}

/* A name this worker may open: the prefix, one component, at most 255. */
static int region_name_ok(const char *r) {
  return strncmp(r, REGION_PREFIX, strlen(REGION_PREFIX)) == 0 &&
         strchr(r + 1, '/') == NULL && strlen(r) <= 255;
}

/* Opens region and checks it is a regular object of the worker's user. */
static int open_region(shm_worker *w, const char *region, wtx_rx *rx) {
  close_region(w);
  int fd = shm_open(region, O_RDONLY | O_NOFOLLOW | O_CLOEXEC, 0);
  if (fd < 0) {
    wtx_rx_errorf(rx, "update_info.shm.region: cannot open '%s': %s", region,
                  strerror(errno));
    return WTX_EIO;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid()) {
    close(fd);
    wtx_rx_errorf(rx, "update_info.shm.region: '%s' is not a region of this "
                  "worker's user", region);
    return WTX_EPERM;
  }
  w->fd = fd;
  snprintf(w->region, sizeof w->region, "%s", region);
  return 0;
}

/* Where the next pread goes: straight into the tensor, or for a small one
 * into the bounce piece, as much of the chunk as it holds. */
static uint8_t *read_target(shm_worker *w, uint8_t *dst, size_t room, uint64_t left,
                            size_t *k, int *bounced) {
  *bounced = room < SMALL && (w->bounce != NULL || (w->bounce = malloc(PIECE)) != NULL);
  if (!*bounced) {
    *k = room < PIECE ? room : PIECE;
    return dst;
  }
  *k = left < PIECE ? (size_t)left : PIECE;
  return w->bounce;
}

/* Reads [offset, +length) of the open region into rx, piece by piece. */
static int read_region(shm_worker *w, uint64_t offset, uint64_t length, wtx_rx *rx) {
  uint64_t got = 0;
  for (;;) {
    uint8_t *dst;
    size_t room = wtx_rx_next(rx, &dst), k;
    if (room == 0) return 0;
    int bounced;
    dst = read_target(w, dst, room, length - got, &k, &bounced);
    if (atomic_load(&w->cancelled)) {
      wtx_rx_errorf(rx, "shm: cancelled after %llu of the chunk's %llu bytes",
                    (unsigned long long)got, (unsigned long long)length);
      return WTX_ECANCELED;
    }
    ssize_t n = pread(w->fd, dst, k, (off_t)(offset + got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      wtx_rx_errorf(rx, "update_info.shm.region: '%s' ended after %llu of the "
                    "chunk's %llu bytes (shrunk or removed while read)",
                    w->region, (unsigned long long)got, (unsigned long long)length);
      close_region(w);
      return WTX_EABORTED;
    }
    int rc = bounced ? wtx_rx_bytes(rx, dst, (size_t)n) : wtx_rx_commit(rx, (size_t)n);
    if (rc != 0) return rc;
    got += (uint64_t)n;
  }
}

static int shm_worker_receive(void *self, const Wtx__V1__UpdateInfo *info,
                              wtx_rx *rx) {
  shm_worker *w = self;
  const Wtx__V1__ShmUpdateInfo *u = info->shm;
  if (!region_name_ok(u->region)) {
    wtx_rx_errorf(rx, "update_info.shm.region: must be a POSIX shm name starting "
                  "'" REGION_PREFIX "' (one component, at most 255 bytes)");
    return WTX_EINVAL;
  }
  int rc = 0;
  if (w->fd < 0 || strcmp(w->region, u->region) != 0)
    rc = open_region(w, u->region, rx);
  if (rc != 0) return rc;
  /* The size is checked on every chunk: the region may have changed. */
  uint64_t length = wtx_rx_remaining(rx);
  struct stat st;
  if (fstat(w->fd, &st) != 0 || (uint64_t)st.st_size < u->offset ||
      (uint64_t)st.st_size - u->offset < length) {
    wtx_rx_errorf(rx, "update_info.shm: range [%llu, +%llu) is outside region "
                  "'%s'", (unsigned long long)u->offset, (unsigned long long)length,
                  u->region);
    close_region(w);
    return WTX_EINVAL;
  }
  return read_region(w, u->offset, length, rx);
}

static void shm_worker_destroy(void *self) {
  close_region(self);
  free(((shm_worker *)self)->bounce);
  free(self);
}

const wtx_worker_transport wtx_shm_worker_transport = {
    .name = "shm",
    .init_case = WTX__V1__INIT_INFO__BACKEND_SHM,
    .update_case = WTX__V1__UPDATE_INFO__BACKEND_SHM,
    .default_checksum = WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64,
    .supports_draft = 1,
    .init = shm_worker_init,
    .receive = shm_worker_receive,
    .cancel = shm_worker_cancel,
    .reset = shm_worker_reset,
    .destroy = shm_worker_destroy,
};

/* ---- trainer half ---- */

typedef struct shm_trainer {
  wtx_wire_params wire;
  char region[64];
  uint8_t *map;
  size_t len;
  Wtx__V1__ShmInitInfo shm;
  Wtx__V1__ShmUpdateInfo *su; /* one per buffer */
} shm_trainer;

static void shm_trainer_destroy(void *self) {
  shm_trainer *t = self;
  if (t == NULL) return;
  if (t->map != NULL) munmap(t->map, t->len);
  if (t->region[0] != '\0') shm_unlink(t->region);
  free(t->su);
  free(t);
}

static int shm_trainer_create(const wtx_trainer_args *args, void **self,
                              char *err, size_t errlen) {
  const wtx_wire_params *wire = &args->wire;
  shm_trainer *t = calloc(1, sizeof *t);
  if (t == NULL) return WTX_ENOMEM;
  t->wire = *wire;
  t->su = calloc(wire->num_buffers, sizeof *t->su);
  if (t->su == NULL) {
    free(t);
    return WTX_ENOMEM;
  }
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  snprintf(t->region, sizeof t->region, "/wtx-%d-%lx%lx", (int)getpid(),
           (long)ts.tv_sec, (long)ts.tv_nsec);
  t->len = (size_t)(wire->buffer_size * wire->num_buffers);
  int fd = shm_open(t->region, O_RDWR | O_CREAT | O_EXCL, 0600);
  if (fd < 0 || ftruncate(fd, (off_t)t->len) != 0 ||
      (t->map = mmap(NULL, t->len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)) ==
          MAP_FAILED) {
    snprintf(err, errlen, "shm: cannot create %s of %zu bytes: %s", t->region,
             t->len, strerror(errno));
    t->map = NULL;
    if (fd < 0) t->region[0] = '\0';
    if (fd >= 0) close(fd);
    shm_trainer_destroy(t);
    return WTX_EIO;
  }
  close(fd);
  for (uint32_t k = 0; k < wire->num_buffers; k++) {
    wtx__v1__shm_update_info__init(&t->su[k]);
    t->su[k].region = t->region;
    t->su[k].offset = k * wire->buffer_size;
  }
  wtx__v1__shm_init_info__init(&t->shm);
  *self = t;
  return 0;
}

static int shm_trainer_init_info(void *self, size_t i, const char *const *prev,
                                 Wtx__V1__InitInfo *out) {
  (void)i;
  (void)prev;
  out->backend_case = WTX__V1__INIT_INFO__BACKEND_SHM;
  out->shm = &((shm_trainer *)self)->shm;
  return 0;
}

static uint8_t *shm_trainer_buffer(void *self, uint32_t k) {
  shm_trainer *t = self;
  return t->map + k * t->wire.buffer_size;
}

static int shm_trainer_prepare(void *self, uint32_t k, const wtx_chunk *c,
                               Wtx__V1__UpdateInfo *ui, char *err, size_t errlen) {
  (void)c;
  (void)err;
  (void)errlen;
  shm_trainer *t = self;
  ui->backend_case = WTX__V1__UPDATE_INFO__BACKEND_SHM;
  ui->shm = &t->su[k];
  return 0;
}

const wtx_trainer_transport wtx_shm_trainer_transport = {
    .name = "shm",
    .init_case = WTX__V1__INIT_INFO__BACKEND_SHM,
    .update_case = WTX__V1__UPDATE_INFO__BACKEND_SHM,
    .default_checksum = WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64,
    .create = shm_trainer_create,
    .init_info = shm_trainer_init_info,
    .buffer = shm_trainer_buffer,
    .prepare = shm_trainer_prepare,
    .destroy = shm_trainer_destroy,
};
