/* TEST DOUBLE of the CUDA runtime and NCCL, for CI machines without a GPU.
 *
 * It stands in for libcudart and libnccl at the dlopen seam
 * (WTX_CUDART_LIB / WTX_NCCL_LIB, see transport/cuda.h) and exports the few
 * symbols wtx uses, with the real signatures, so the nccl and cuda_ipc
 * backends' own logic (packing, chunk order, handle routing, errors,
 * timeouts) runs unchanged across real processes. It is not CUDA:
 *  - "device memory" is host memory in a POSIX shared-memory object, so
 *    cudaIpcGetMemHandle can export it (the handle names the object) and
 *    cudaIpcOpenMemHandle in another process maps it;
 *  - copies are memcpy, streams complete at once;
 *  - a device's UUID is WTX_FAKE_CUDA_UUID (32 hex digits) when set, else
 *    "wtx-fake-gpu-" plus the device number;
 *  - NCCL's communicator is a shared-memory control block named by the
 *    unique id; ncclBroadcast is synchronous: the root posts the bytes in a
 *    shared-memory object and waits until every other rank has copied them.
 *    Every wait gives up after WTX_FAKE_NCCL_TIMEOUT_MS (default 10000) and
 *    fails with ncclSystemError, as a dead peer would make real NCCL fail
 *    under a watchdog.
 * Built as libwtx_fake_cuda.so (//cuda/testing:fake_cuda). Never
 * shipped, never loaded unless a test points the variables at it. */
#include <dirent.h>
#include <signal.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

enum { OK = 0, ERR_INVALID = 1, ERR_MEMORY = 2, NCCL_SYSTEM = 2, NCCL_INVALID = 4 };

typedef struct { char bytes[64]; } ipc_handle;
typedef struct { char internal[128]; } nccl_id;

/* ---- memory ---- */

typedef struct alloc {
  void *ptr;
  size_t size;
  char name[48];
  int opened; /* mapped from another process's handle */
  struct alloc *next;
} alloc;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static alloc *allocs;
static _Thread_local int current_device;
static atomic_uint counter;

static int map_shm(const char *name, int create, size_t *size, void **out) {
  int fd = shm_open(name, create ? O_RDWR | O_CREAT | O_EXCL : O_RDWR, 0600);
  if (fd < 0) return ERR_INVALID;
  struct stat st;
  if (create && ftruncate(fd, (off_t)(*size ? *size : 1)) != 0) {
    close(fd);
    shm_unlink(name);
    return ERR_MEMORY;
  }
  if (!create) {
    fstat(fd, &st);
    *size = (size_t)st.st_size;
  }
  void *p = mmap(NULL, *size ? *size : 1, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return ERR_MEMORY;
  *out = p;
  return OK;
}

EXPORT int cudaSetDevice(int device) {
  if (device < 0 || device > 7) return ERR_INVALID;
  current_device = device;
  return OK;
}

EXPORT int cudaGetDeviceProperties(void *prop, int device) {
  unsigned char *p = prop;
  memset(p, 0, 272);
  snprintf((char *)p, 256, "wtx fake CUDA device %d (test double)", device);
  const char *env = getenv("WTX_FAKE_CUDA_UUID");
  if (env != NULL && strlen(env) == 32) {
    for (int i = 0; i < 16; i++) {
      unsigned v;
      sscanf(env + 2 * i, "%2x", &v);
      p[256 + i] = (unsigned char)v;
    }
  } else {
    char u[17];
    snprintf(u, sizeof u, "wtx-fake-gpu-%03d", device);
    memcpy(p + 256, u, 16);
  }
  return OK;
}

/* Maps a's object (creating it when create) and records the mapping. */
static int track(alloc *a, int create, void **ptr) {
  int rc = map_shm(a->name, create, &a->size, &a->ptr);
  if (rc != OK) {
    free(a);
    return rc;
  }
  pthread_mutex_lock(&mu);
  a->next = allocs;
  allocs = a;
  pthread_mutex_unlock(&mu);
  *ptr = a->ptr;
  return OK;
}

/* What the driver does for a process that died: its device memory goes.
 * The double's device memory is POSIX shm named after the owner's pid; a
 * process killed mid-test leaves it behind, so the first allocation of
 * each process removes the objects of pids that no longer run. */
static void reap_dead_owners(void) {
  DIR *d = opendir("/dev/shm");
  if (d == NULL) return;
  for (struct dirent *e; (e = readdir(d)) != NULL;) {
    int pid = 0;
    if (sscanf(e->d_name, "wtxfake-%d-", &pid) != 1 || pid <= 0) continue;
    if (kill(pid, 0) != 0 && errno == ESRCH) {
      char name[300];
      snprintf(name, sizeof name, "/%s", e->d_name);
      shm_unlink(name);
    }
  }
  closedir(d);
}

EXPORT int cudaMalloc(void **ptr, size_t size) {
  static pthread_once_t reaped = PTHREAD_ONCE_INIT;
  pthread_once(&reaped, reap_dead_owners);
  alloc *a = calloc(1, sizeof *a);
  if (a == NULL) return ERR_MEMORY;
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  /* pid, start time and a counter: a reused pid never meets a leftover. */
  snprintf(a->name, sizeof a->name, "/wtxfake-%d-%lx-%u", (int)getpid(),
           (unsigned long)ts.tv_nsec ^ (unsigned long)ts.tv_sec, atomic_fetch_add(&counter, 1));
  a->size = size;
  return track(a, 1, ptr);
}

/* Removes and returns the allocation at ptr. */
static alloc *take(void *ptr, int opened) {
  pthread_mutex_lock(&mu);
  alloc **pp = &allocs, *a = NULL;
  for (; *pp != NULL; pp = &(*pp)->next)
    if ((*pp)->ptr == ptr && (*pp)->opened == opened) {
      a = *pp;
      *pp = a->next;
      break;
    }
  pthread_mutex_unlock(&mu);
  return a;
}

EXPORT int cudaFree(void *ptr) {
  if (ptr == NULL) return OK;
  alloc *a = take(ptr, 0);
  if (a == NULL) return ERR_INVALID;
  munmap(a->ptr, a->size ? a->size : 1);
  shm_unlink(a->name);
  free(a);
  return OK;
}

EXPORT int cudaMemcpy(void *dst, const void *src, size_t n, int kind) {
  (void)kind;
  if (n > 0) memcpy(dst, src, n);
  return OK;
}

EXPORT int cudaStreamCreate(void **stream) {
  *stream = malloc(1);
  return *stream ? OK : ERR_MEMORY;
}
EXPORT int cudaStreamDestroy(void *stream) {
  free(stream);
  return OK;
}
EXPORT int cudaStreamQuery(void *stream) {
  (void)stream;
  return OK;
}
EXPORT int cudaStreamSynchronize(void *stream) {
  (void)stream;
  return OK;
}

EXPORT int cudaIpcGetMemHandle(ipc_handle *h, void *ptr) {
  memset(h, 0, sizeof *h);
  pthread_mutex_lock(&mu);
  alloc *a = allocs;
  while (a != NULL && (a->ptr != ptr || a->opened)) a = a->next;
  if (a != NULL) {
    memcpy(h->bytes, "FAKEIPC", 8);
    memcpy(h->bytes + 8, a->name, strlen(a->name));
  }
  pthread_mutex_unlock(&mu);
  return a != NULL ? OK : ERR_INVALID;
}

EXPORT int cudaIpcOpenMemHandle(void **ptr, ipc_handle h, unsigned flags) {
  (void)flags;
  if (memcmp(h.bytes, "FAKEIPC", 8) != 0) return ERR_INVALID;
  alloc *a = calloc(1, sizeof *a);
  if (a == NULL) return ERR_MEMORY;
  memcpy(a->name, h.bytes + 8, sizeof a->name - 1);
  a->opened = 1;
  return track(a, 0, ptr);
}

EXPORT int cudaIpcCloseMemHandle(void *ptr) {
  alloc *a = take(ptr, 1);
  if (a == NULL) return ERR_INVALID;
  munmap(a->ptr, a->size ? a->size : 1);
  free(a);
  return OK;
}

EXPORT const char *cudaGetErrorString(int err) {
  switch (err) {
    case OK: return "no error (fake CUDA)";
    case ERR_INVALID: return "invalid argument (fake CUDA)";
    case ERR_MEMORY: return "out of memory (fake CUDA)";
    default: return "unknown error (fake CUDA)";
  }
}

/* ---- NCCL ---- */

typedef struct control {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  atomic_int ready;
  int joined;
  int nranks;
  uint64_t posted; /* broadcasts posted by the root */
  int done;        /* ranks that copied the last one */
  size_t bytes;
} control;

typedef struct comm {
  control *ctl;
  char name[64];
  int rank, nranks;
  uint64_t seq;
  int failed;
} comm;

static int timeout_ms(void) {
  const char *e = getenv("WTX_FAKE_NCCL_TIMEOUT_MS");
  return e != NULL && atoi(e) > 0 ? atoi(e) : 10000;
}

static struct timespec deadline(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  int ms = timeout_ms();
  ts.tv_sec += ms / 1000;
  ts.tv_nsec += (long)(ms % 1000) * 1000000;
  if (ts.tv_nsec >= 1000000000) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000;
  }
  return ts;
}

static void lock(control *c) {
  if (pthread_mutex_lock(&c->mu) == EOWNERDEAD) pthread_mutex_consistent(&c->mu);
}

/* Waits on the condition; 0 on a wake-up, ETIMEDOUT past the deadline. */
static int wait_until(control *c, const struct timespec *until) {
  int r = pthread_cond_timedwait(&c->cv, &c->mu, until);
  if (r == EOWNERDEAD) {
    pthread_mutex_consistent(&c->mu);
    r = 0;
  }
  return r == ETIMEDOUT ? ETIMEDOUT : 0;
}

EXPORT int ncclGetUniqueId(nccl_id *id) {
  memset(id, 0, sizeof *id);
  unsigned char r[12];
  int fd = open("/dev/urandom", O_RDONLY);
  if (fd < 0 || read(fd, r, sizeof r) != (ssize_t)sizeof r) {
    if (fd >= 0) close(fd);
    return NCCL_SYSTEM;
  }
  close(fd);
  int o = snprintf(id->internal, sizeof id->internal, "/wtxfakenccl-");
  for (size_t i = 0; i < sizeof r; i++)
    o += snprintf(id->internal + o, sizeof id->internal - (size_t)o, "%02x", r[i]);
  return OK;
}

EXPORT int ncclCommInitRank(void **out, int nranks, nccl_id id, int rank) {
  if (strncmp(id.internal, "/wtxfakenccl-", 13) != 0 || rank < 0 || rank >= nranks)
    return NCCL_INVALID;
  comm *cm = calloc(1, sizeof *cm);
  if (cm == NULL) return NCCL_SYSTEM;
  snprintf(cm->name, sizeof cm->name, "%.60s", id.internal);
  cm->rank = rank;
  cm->nranks = nranks;
  size_t size = sizeof(control);
  void *p = NULL;
  int created = map_shm(cm->name, 1, &size, &p) == OK;
  if (!created) {
    struct timespec until = deadline(), now;
    for (;;) { /* the creator may not have sized it yet */
      size = 0;
      if (map_shm(cm->name, 0, &size, &p) == OK && size >= sizeof(control)) break;
      if (p != NULL) munmap(p, size ? size : 1), p = NULL;
      clock_gettime(CLOCK_REALTIME, &now);
      if (now.tv_sec > until.tv_sec) {
        free(cm);
        return NCCL_SYSTEM;
      }
      usleep(1000);
    }
  }
  control *c = cm->ctl = p;
  if (created) {
    pthread_mutexattr_t ma;
    pthread_mutexattr_init(&ma);
    pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&ma, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&c->mu, &ma);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
    pthread_cond_init(&c->cv, &ca);
    c->nranks = nranks;
    atomic_store(&c->ready, 1);
  }
  while (!atomic_load(&c->ready)) usleep(100);
  struct timespec until = deadline();
  lock(c);
  c->joined++;
  pthread_cond_broadcast(&c->cv);
  int rc = OK;
  while (c->joined < nranks && rc == OK)
    if (wait_until(c, &until) == ETIMEDOUT) rc = NCCL_SYSTEM;
  pthread_mutex_unlock(&c->mu);
  if (rc != OK) {
    munmap(c, sizeof *c);
    shm_unlink(cm->name);
    free(cm);
    return rc;
  }
  *out = cm;
  return OK;
}

EXPORT int ncclBroadcast(const void *send, void *recv, size_t count, int dtype,
                         int root, void *commp, void *stream) {
  (void)dtype;
  (void)stream;
  comm *cm = commp;
  control *c = cm->ctl;
  if (cm->failed) return NCCL_SYSTEM;
  char data_name[100];
  snprintf(data_name, sizeof data_name, "%s-%llu", cm->name,
           (unsigned long long)cm->seq);
  struct timespec until = deadline();
  int rc = OK;
  if (cm->rank == root) {
    void *p = NULL;
    size_t size = count;
    if (map_shm(data_name, 1, &size, &p) != OK) return NCCL_SYSTEM;
    if (count > 0) memcpy(p, send, count);
    munmap(p, count ? count : 1);
    lock(c);
    c->bytes = count;
    c->done = 0;
    c->posted = cm->seq + 1;
    pthread_cond_broadcast(&c->cv);
    while (c->done < cm->nranks - 1 && rc == OK)
      if (wait_until(c, &until) == ETIMEDOUT) rc = NCCL_SYSTEM;
    pthread_mutex_unlock(&c->mu);
    shm_unlink(data_name);
  } else {
    lock(c);
    while (c->posted < cm->seq + 1 && rc == OK)
      if (wait_until(c, &until) == ETIMEDOUT) rc = NCCL_SYSTEM;
    size_t bytes = c->bytes;
    pthread_mutex_unlock(&c->mu);
    if (rc == OK && bytes != count) rc = NCCL_INVALID;
    if (rc == OK) {
      void *p = NULL;
      size_t size = 0;
      if (map_shm(data_name, 0, &size, &p) != OK) {
        rc = NCCL_SYSTEM;
      } else {
        if (count > 0) memcpy(recv, p, count);
        munmap(p, size ? size : 1);
      }
    }
    if (rc == OK) {
      lock(c);
      c->done++;
      pthread_cond_broadcast(&c->cv);
      pthread_mutex_unlock(&c->mu);
    }
  }
  cm->seq++;
  if (rc != OK) cm->failed = 1;
  return rc;
}

EXPORT int ncclCommGetAsyncError(void *commp, int *err) {
  *err = ((comm *)commp)->failed ? NCCL_SYSTEM : OK;
  return OK;
}

static int comm_free(void *commp) {
  comm *cm = commp;
  if (cm == NULL) return NCCL_INVALID;
  munmap(cm->ctl, sizeof(control));
  shm_unlink(cm->name);
  free(cm);
  return OK;
}

EXPORT int ncclCommAbort(void *commp) { return comm_free(commp); }
EXPORT int ncclCommDestroy(void *commp) { return comm_free(commp); }

EXPORT const char *ncclGetErrorString(int err) {
  switch (err) {
    case OK: return "no error (fake NCCL)";
    case NCCL_SYSTEM: return "unhandled system error: a peer did not answer "
                             "within WTX_FAKE_NCCL_TIMEOUT_MS (fake NCCL)";
    case NCCL_INVALID: return "invalid argument (fake NCCL)";
    default: return "unknown error (fake NCCL)";
  }
}
