/* shm: same-host transfer through POSIX shared memory.
 *
 * The trainer writes each chunk into a shared-memory object it owns and names
 * it in the chunk's ShmUpdateInfo; the worker opens the object (once, while
 * the trainer keeps using it; only "/wtx-..." objects of its own user), maps
 * it read-only and copies the chunk once, straight into the model's staging
 * memory (non-temporal stores: see wtx_rx_bytes), hashing what it copies in
 * the same pass (wtx__copy_hash).
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

#include "transport/sigbus.h"
#include "transport/transport.h"

/* Regions a worker reads: named by the project's prefix and owned by the
 * worker's own user (docs/security.md). */
#define REGION_PREFIX "/wtx-"
/* Bytes copied (and hashed) at a time; cancel is checked between. */
#define PIECE ((size_t)256 << 10)

typedef struct shm_worker {
  wtx_wire_params wire;
  /* The trainer's region stays open and mapped across chunks. Its size is
   * checked before every chunk; a region that shrinks while a chunk is
   * copied raises SIGBUS in the copy, which the guard (sigbus.h) turns into
   * an error: never a crash. */
  char region[256];
  int fd;
  const uint8_t *map;
  size_t map_len;
  uint64_t populated; /* [0, populated) of the mapping was populated */
  atomic_int cancelled;
} shm_worker;

static void close_region(shm_worker *w) {
  if (w->map != NULL) munmap((void *)w->map, w->map_len);
  if (w->fd >= 0) close(w->fd);
  w->map = NULL;
  w->map_len = 0;
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

/* Maps the open region's first len bytes (its size now), replacing a
 * shorter mapping. Not populated here: a region may be far larger than
 * what is sent through it, and populating it all would cost every new
 * trainer the whole region; each chunk's range is, before its copy. */
static int map_region(shm_worker *w, size_t len, wtx_rx *rx) {
  if (w->map != NULL && w->map_len >= len) return 0;
  if (w->map != NULL) munmap((void *)w->map, w->map_len);
  w->map = NULL;
  void *m = mmap(NULL, len, PROT_READ, MAP_SHARED, w->fd, 0);
  if (m == MAP_FAILED) {
    wtx_rx_errorf(rx, "update_info.shm.region: cannot map '%s' (%zu bytes): %s",
                  w->region, len, strerror(errno));
    close_region(w);
    return WTX_EIO;
  }
  w->map = m;
  w->map_len = len;
  w->populated = 0;
  return 0;
}

/* One chunk's copy out of the mapping, run under the SIGBUS guard: it only
 * copies and hashes (the assembler), and counts what it got. */
typedef struct copy_job {
  shm_worker *w;
  const uint8_t *src;
  uint64_t length, got;
  wtx_rx *rx;
} copy_job;

static int copy_pieces(void *arg) {
  copy_job *j = arg;
  while (j->got < j->length) {
    if (atomic_load(&j->w->cancelled)) return WTX_ECANCELED;
    uint64_t left = j->length - j->got;
    size_t k = left < PIECE ? (size_t)left : PIECE;
    int rc = wtx_rx_bytes(j->rx, j->src + j->got, k);
    if (rc != 0) return rc;
    j->got += k;
  }
  return 0;
}

/* Copies [offset, +length) of the mapped region into rx. */
static int read_region(shm_worker *w, uint64_t offset, uint64_t length, wtx_rx *rx) {
  copy_job j = {.w = w, .src = w->map + offset, .length = length, .rx = rx};
  /* The page tables of a range not read before in one call instead of a
   * fault per page (a hint: where the kernel lacks it, or the region
   * shrank, the copy below faults or fails as it would anyway). Buffers are
   * used from the region's start, so one mark says what is done. */
  if (offset + length > w->populated) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), at = (uintptr_t)j.src & ~(page - 1);
    madvise((void *)at, (uintptr_t)j.src + length - at, MADV_POPULATE_READ);
    w->populated = offset + length;
  }
  int rc = wtx__sigbus_guard(j.src, (size_t)length, copy_pieces, &j);
  if (rc == WTX_ECANCELED) {
    wtx_rx_errorf(rx, "shm: cancelled after %llu of the chunk's %llu bytes",
                  (unsigned long long)j.got, (unsigned long long)length);
  } else if (rc == WTX_EIO) {
    wtx_rx_errorf(rx, "update_info.shm.region: '%s' ended after %llu of the "
                  "chunk's %llu bytes (shrunk or removed while read)",
                  w->region, (unsigned long long)j.got, (unsigned long long)length);
    close_region(w);
    return WTX_EABORTED;
  }
  return rc;
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
  if ((uint64_t)st.st_size > SIZE_MAX) {
    wtx_rx_errorf(rx, "update_info.shm.region: '%s' is larger than this worker can map",
                  u->region);
    close_region(w);
    return WTX_EINVAL;
  }
  if (length == 0) return 0;
  rc = map_region(w, (size_t)st.st_size, rx);
  return rc != 0 ? rc : read_region(w, u->offset, length, rx);
}

static void shm_worker_destroy(void *self) {
  close_region(self);
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
    /* Smaller pieces in flight than the protocol's 64 MiB x 2: what the
     * trainer packs is still in cache when the worker copies it out. But
     * each chunk costs a call to every worker, so chunks grow with them. */
    .default_buffer_per_worker = UINT64_C(4) << 20,
    .default_num_buffers = 4,
    .create = shm_trainer_create,
    .init_info = shm_trainer_init_info,
    .buffer = shm_trainer_buffer,
    .prepare = shm_trainer_prepare,
    .destroy = shm_trainer_destroy,
};
