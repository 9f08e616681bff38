/* TEST DOUBLE of the CUDA runtime and NCCL, for CI machines without a GPU.
 *
 * It stands in for libcudart and libnccl at the dlopen seam
 * (WTX_CUDART_LIB / WTX_NCCL_LIB, see cuda/cuda.h) and exports the symbols
 * wtx uses, with the real signatures and error codes, so the nccl and
 * cuda_ipc backends' own logic runs unchanged across real processes. It is
 * not CUDA, but it keeps the parts of CUDA and NCCL that code gets wrong:
 *  - device memory is a POSIX shared-memory object per allocation, so an
 *    IPC handle (which names it) opens in another process; never in the
 *    process that exported it (cudaErrorInvalidResourceHandle, as CUDA);
 *  - device memory cannot be touched from the host: the address handed out
 *    is mapped PROT_NONE, so code that reads or writes a device address on
 *    the CPU dies with SIGSEGV, as it would on a GPU, instead of passing.
 *    Only the double's own copies and broadcasts reach the bytes, through a
 *    second, private mapping. A copy whose kind does not match where its
 *    pointers are (host-to-device into host memory, ...) or that runs past
 *    the end of an allocation fails with cudaErrorInvalidValue;
 *  - copies are asynchronous. cudaMemcpyAsync lands on its stream after
 *    WTX_FAKE_CUDA_LAG_MS (default 2) or at cudaStreamSynchronize, and
 *    cudaStreamQuery says cudaErrorNotReady until then. A cudaMemcpy from
 *    pageable host memory to the device returns before the bytes land (the
 *    same lag), as CUDA documents: another process reading the buffer right
 *    after it sees the old bytes. From pinned memory (cudaMallocHost), and
 *    device to host, cudaMemcpy returns once the bytes are there. cudaFree
 *    and cudaFreeHost wait for the device's work first, as CUDA's do;
 *  - device memory is finite when WTX_FAKE_CUDA_MEMORY (bytes) is set: a
 *    cudaMalloc beyond what this process has free fails with
 *    cudaErrorMemoryAllocation, as on a full GPU;
 *  - with WTX_FAKE_CUDA_LOG set (a file), every cudaIpcOpenMemHandle that
 *    succeeds appends "<pid> open <allocation>" to it, and a process that
 *    exits appends "<pid> d2d <bytes>", the bytes it copied device to
 *    device, so a test can count the handles and copies of each process;
 *  - the current device is per thread (cudaSetDevice / cudaGetDevice), and
 *    a device's UUID is WTX_FAKE_CUDA_UUID (32 hex digits) when set, else
 *    "wtx-fake-gpu-" and the device number;
 *  - NCCL's communicator is a shared-memory control block named by the
 *    unique id. Joining (ncclCommInitRankConfig) waits for every rank with
 *    no timeout, as NCCL's bootstrap does: blocking, it never returns until
 *    they come; non-blocking (config.blocking = 0) it returns ncclInProgress
 *    and ncclCommGetAsyncError reports progress until they come or
 *    ncclCommAbort ends it. Two ranks on one GPU (same UUID) fail with
 *    ncclInvalidUsage and ncclGetLastError's "Duplicate GPU detected";
 *  - ncclSend / ncclRecv enqueue a kernel each that starts once the work
 *    before it on its stream is done, and runs until its peer's matching
 *    call (the k-th send from A to B meets B's k-th receive from A) has
 *    taken the bytes: a send nobody receives runs forever, as NCCL's
 *    rendezvous does, so an order that deadlocks on a GPU deadlocks here.
 *    Sizes that differ fail both (ncclInvalidArgument);
 *  - ncclBroadcast enqueues a kernel on the stream: a thread that runs
 *    until the bytes have crossed, with no timeout, and ends early only when
 *    the communicator is aborted or a peer process is gone (then the
 *    communicator's asynchronous error is ncclRemoteError). The stream is
 *    not ready while it runs. wtx_fake_cuda_running_kernels() (this
 *    double's own export) counts those still running in the process;
 *  - cudaGetDeviceCount is WTX_FAKE_CUDA_DEVICES (default 8), and a device
 *    beyond it is cudaErrorInvalidDevice.
 * The gentle parts above (a dead peer found at once, a size mismatch an
 * instant error, memory readable after its owner freed it or died, an IPC
 * handle opened on any device, calls that never fail) are where real
 * systems hang or fault instead. WTX_FAKE_CUDA_HARD=1 makes the double
 * behave as they do:
 *  - a dead peer is never noticed: NCCL's waits run until the communicator
 *    is aborted (wtx's own timeout must end them);
 *  - a broadcast, send or receive whose sizes differ hangs the same way;
 *  - cudaFree fills the bytes with 0xdb first, so a process that opened
 *    them through IPC reads garbage, and a copy touching memory opened from
 *    a process that exited fails with cudaErrorIllegalAddress;
 *  - cudaIpcOpenMemHandle on another device than the exporter's fails
 *    with cudaErrorPeerAccessUnsupported;
 *  - with WTX_FAKE_CUDA_FAIL_DIR set, a file named "copy" or "sync" there
 *    makes the next copy (cudaMemcpy, cudaMemcpyAsync) or synchronize
 *    (cudaStreamSynchronize, cudaDeviceSynchronize, or the cudaStreamQuery
 *    that would say done) of any process reading that variable fail with
 *    cudaErrorLaunchFailure; the call that fails removes the file (once).
 * Built as libwtx_fake_cuda.so (//cuda/testing:libwtx_fake_cuda.so). Never
 * shipped, never loaded unless a test points the variables at it. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
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

/* cudaError_t and ncclResult_t values, as the real headers define them. */
enum {
  OK = 0,
  ERR_INVALID = 1,      /* cudaErrorInvalidValue */
  ERR_MEMORY = 2,       /* cudaErrorMemoryAllocation */
  ERR_DEVICE = 101,     /* cudaErrorInvalidDevice */
  ERR_HANDLE = 400,     /* cudaErrorInvalidResourceHandle */
  ERR_PEER = 217,       /* cudaErrorPeerAccessUnsupported */
  ERR_NOT_READY = 600,  /* cudaErrorNotReady */
  ERR_ILLEGAL = 700,    /* cudaErrorIllegalAddress */
  ERR_LAUNCH = 719,     /* cudaErrorLaunchFailure */
  NCCL_SYSTEM = 2,
  NCCL_INVALID = 4,     /* ncclInvalidArgument */
  NCCL_USAGE = 5,       /* ncclInvalidUsage */
  NCCL_REMOTE = 6,      /* ncclRemoteError */
  NCCL_IN_PROGRESS = 7,
  KIND_H2D = 1,
  MAX_RANKS = 64,
};

typedef struct { char bytes[64]; } ipc_handle;
typedef struct { char internal[128]; } nccl_id;
typedef struct {
  size_t size;
  unsigned magic, version;
  int blocking;
} nccl_config_head; /* the fields every ncclConfig_t version begins with */

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
  nanosleep(&ts, NULL);
}

/* WTX_FAKE_CUDA_HARD: behave as the real libraries where they hang or
 * fault (the header comment). */
static int hard(void) {
  const char *e = getenv("WTX_FAKE_CUDA_HARD");
  return e != NULL && e[0] != '\0' && strcmp(e, "0") != 0;
}

/* Whether an injected failure of kind ("copy", "sync") is due: its file in
 * WTX_FAKE_CUDA_FAIL_DIR, removed by the one call that fails. */
static int injected(const char *kind) {
  const char *dir = getenv("WTX_FAKE_CUDA_FAIL_DIR");
  if (dir == NULL || dir[0] == '\0') return 0;
  char path[4200];
  snprintf(path, sizeof path, "%s/%s", dir, kind);
  return unlink(path) == 0;
}

static int lag_ms(void) {
  const char *e = getenv("WTX_FAKE_CUDA_LAG_MS");
  return e != NULL && e[0] != '\0' ? atoi(e) : 2;
}

/* ---- memory ---- */

typedef struct alloc {
  void *ptr;  /* device allocations: the device address, PROT_NONE */
  void *view; /* device allocations: the same bytes, for the double only */
  size_t size;
  char name[48];
  int opened; /* mapped from another process's handle */
  int pinned; /* cudaMallocHost: plain memory, remembered as pinned */
  int device; /* cudaMalloc's current device */
  struct alloc *next;
} alloc;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static alloc *allocs;
static _Thread_local int current_device;
static atomic_uint counter;

/* Maps name (creating it of *size bytes when create, else *size gets its
 * size) readable and writable at *out; with device, also at *device with
 * no access at all (a device address). */
static int map_shm2(const char *name, int create, size_t *size, void **out, void **device) {
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
  size_t len = *size ? *size : 1;
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  void *d = device == NULL || p == MAP_FAILED ? NULL : mmap(NULL, len, PROT_NONE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED || d == MAP_FAILED) {
    if (p != MAP_FAILED) munmap(p, len);
    return ERR_MEMORY;
  }
  *out = p;
  if (device != NULL) *device = d;
  return OK;
}

static int map_shm(const char *name, int create, size_t *size, void **out) {
  return map_shm2(name, create, size, out, NULL);
}

static int device_count(void) {
  const char *e = getenv("WTX_FAKE_CUDA_DEVICES");
  int n = e != NULL && e[0] != '\0' ? atoi(e) : 8;
  return n > 0 && n <= 8 ? n : 8;
}

EXPORT int cudaGetDeviceCount(int *n) {
  *n = device_count();
  return OK;
}

EXPORT int cudaSetDevice(int device) {
  if (device < 0 || device >= device_count()) return ERR_DEVICE;
  current_device = device;
  return OK;
}

EXPORT int cudaGetDevice(int *device) {
  *device = current_device;
  return OK;
}

static void device_uuid(int device, unsigned char out[16]) {
  const char *env = getenv("WTX_FAKE_CUDA_UUID");
  if (env != NULL && strlen(env) == 32) {
    for (int i = 0; i < 16; i++) {
      unsigned v;
      sscanf(env + 2 * i, "%2x", &v);
      out[i] = (unsigned char)v;
    }
    return;
  }
  char u[17];
  snprintf(u, sizeof u, "wtx-fake-gpu-%03d", device);
  memcpy(out, u, 16);
}

EXPORT int cudaGetDeviceProperties(void *prop, int device) {
  if (device < 0 || device >= device_count()) return ERR_DEVICE;
  unsigned char *p = prop;
  memset(p, 0, 272);
  snprintf((char *)p, 256, "wtx fake CUDA device %d (test double)", device);
  device_uuid(device, p + 256);
  return OK;
}

static void remember(alloc *a) {
  pthread_mutex_lock(&mu);
  a->next = allocs;
  allocs = a;
  pthread_mutex_unlock(&mu);
}

/* Maps a's object (creating it when create) and records the mapping. */
static int track(alloc *a, int create, void **ptr) {
  int rc = map_shm2(a->name, create, &a->size, &a->view, &a->ptr);
  if (rc != OK) {
    free(a);
    return rc;
  }
  remember(a);
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

/* Device bytes this process holds (cudaMalloc), against WTX_FAKE_CUDA_MEMORY. */
static atomic_size_t in_use;

/* Takes size bytes of the device's memory; 0 when it has no room left. */
static int reserve(size_t size) {
  const char *env = getenv("WTX_FAKE_CUDA_MEMORY");
  size_t limit = env != NULL && env[0] != '\0' ? (size_t)strtoull(env, NULL, 10) : SIZE_MAX;
  size_t used = atomic_fetch_add(&in_use, size);
  if (used <= limit && size <= limit - used) return 1;
  atomic_fetch_sub(&in_use, size);
  return 0;
}

EXPORT int cudaMalloc(void **ptr, size_t size) {
  static pthread_once_t reaped = PTHREAD_ONCE_INIT;
  pthread_once(&reaped, reap_dead_owners);
  if (!reserve(size)) return ERR_MEMORY;
  alloc *a = calloc(1, sizeof *a);
  if (a == NULL) {
    atomic_fetch_sub(&in_use, size);
    return ERR_MEMORY;
  }
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  /* pid, start time and a counter: a reused pid never meets a leftover. */
  snprintf(a->name, sizeof a->name, "/wtxfake-%d-%lx-%u", (int)getpid(),
           (unsigned long)ts.tv_nsec ^ (unsigned long)ts.tv_sec, atomic_fetch_add(&counter, 1));
  a->size = size;
  a->device = current_device;
  int rc = track(a, 1, ptr);
  if (rc != OK) atomic_fetch_sub(&in_use, size);
  return rc;
}

EXPORT int cudaMallocHost(void **ptr, size_t size) {
  alloc *a = calloc(1, sizeof *a);
  if (a == NULL || (a->ptr = malloc(size ? size : 1)) == NULL) {
    free(a);
    return ERR_MEMORY;
  }
  a->size = size;
  a->pinned = 1;
  remember(a);
  *ptr = a->ptr;
  return OK;
}

static void unmap(alloc *a) {
  munmap(a->ptr, a->size ? a->size : 1);
  munmap(a->view, a->size ? a->size : 1);
}

/* Where the double itself reaches [p, +n): through the private mapping
 * when p is a device address (*on_device = 1), else p itself. NULL when
 * the range starts in a device allocation and runs past its end. */
static void *reach(const void *p, size_t n, int *on_device) {
  const char *c = p;
  void *out = (void *)p;
  *on_device = 0;
  pthread_mutex_lock(&mu);
  for (alloc *a = allocs; a != NULL; a = a->next) {
    const char *base = a->pinned ? NULL : a->ptr;
    if (base == NULL || c < base || c >= base + (a->size ? a->size : 1)) continue;
    *on_device = 1;
    out = (size_t)(c - base) + n <= a->size ? (char *)a->view + (c - base) : NULL;
    break;
  }
  pthread_mutex_unlock(&mu);
  return out;
}

enum { KIND_H2H = 0, KIND_D2H = 2, KIND_D2D = 3, KIND_DEFAULT = 4 };

/* Hard mode: whether [p, ...) is memory opened from a process that has
 * exited (the driver tore it down: touching it faults). */
static int orphaned(const void *p) {
  if (!hard()) return 0;
  int pid = 0;
  pthread_mutex_lock(&mu);
  for (alloc *a = allocs; a != NULL; a = a->next) {
    const char *base = a->ptr, *c = p;
    if (!a->opened || c < base || c >= base + (a->size ? a->size : 1)) continue;
    if (sscanf(a->name, "/wtxfake-%d-", &pid) != 1) pid = 0;
    break;
  }
  pthread_mutex_unlock(&mu);
  return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH;
}

/* Resolves a copy's pointers for the double (*dst_out, *src_out) and
 * checks them against kind as CUDA does: ERR_INVALID when a side is not
 * where kind says or runs past its allocation. */
static int resolve_copy(void *dst, const void *src, size_t n, int kind, void **dst_out,
                        const void **src_out) {
  int dd, sd;
  *dst_out = reach(dst, n, &dd);
  *src_out = reach(src, n, &sd);
  if (*dst_out == NULL || *src_out == NULL) return ERR_INVALID;
  if (orphaned(dst) || orphaned(src)) return ERR_ILLEGAL;
  int want_dd = kind == KIND_H2D || kind == KIND_D2D, want_sd = kind == KIND_D2H || kind == KIND_D2D;
  if (kind != KIND_DEFAULT && (dd != want_dd || sd != want_sd)) return ERR_INVALID;
  return OK;
}

/* Removes and returns the allocation at ptr of that kind. */
static alloc *take(void *ptr, int opened, int pinned) {
  pthread_mutex_lock(&mu);
  alloc **pp = &allocs, *a = NULL;
  for (; *pp != NULL; pp = &(*pp)->next)
    if ((*pp)->ptr == ptr && (*pp)->opened == opened && (*pp)->pinned == pinned) {
      a = *pp;
      *pp = a->next;
      break;
    }
  pthread_mutex_unlock(&mu);
  return a;
}

static void synchronize_all(void);

/* Like CUDA's, it waits for the device's work first. */
EXPORT int cudaFreeHost(void *ptr) {
  synchronize_all();
  alloc *a = take(ptr, 0, 1);
  if (a == NULL) return ERR_INVALID;
  free(a->ptr);
  free(a);
  return OK;
}

/* Whether [p, +n) lies in pinned host memory. */
static int is_pinned(const void *p, size_t n) {
  const char *c = p;
  pthread_mutex_lock(&mu);
  alloc *a = allocs;
  while (a != NULL && !(a->pinned && c >= (char *)a->ptr && c + n <= (char *)a->ptr + a->size))
    a = a->next;
  pthread_mutex_unlock(&mu);
  return a != NULL;
}

/* ---- streams: work lands later, as on a GPU ---- */

typedef struct kernel kernel;

typedef struct op {
  void *dst;
  const void *src;
  void *owned; /* a snapshot of pageable source bytes, freed on landing */
  size_t n;
  int64_t due_ms;
  kernel *k; /* a broadcast instead of a copy */
  struct op *next;
} op;

typedef struct stream {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  op *head, *tail;
  struct stream *next; /* in the lander's list */
} stream;

struct kernel {
  atomic_int done;
  int result;
};

static stream legacy = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, NULL, NULL};
static stream *streams = &legacy; /* every stream, for the lander */
static atomic_int running_kernels;

/* Lands the ops at the head of s that are due (all of them when force);
 * a kernel still running holds back what follows it. Caller holds s->mu. */
static void land(stream *s, int force) {
  int64_t now = now_ms();
  while (s->head != NULL) {
    op *o = s->head;
    if (o->k != NULL ? !atomic_load(&o->k->done) : !force && o->due_ms > now) break;
    if (o->k == NULL && o->n > 0) memcpy(o->dst, o->owned ? o->owned : o->src, o->n);
    s->head = o->next;
    if (s->head == NULL) s->tail = NULL;
    if (o->k != NULL) free(o->k);
    free(o->owned);
    free(o);
  }
  pthread_cond_broadcast(&s->cv);
}

/* The lander: every millisecond, what is due lands on every stream. */
static void *lander(void *arg) {
  (void)arg;
  for (;;) {
    pthread_mutex_lock(&mu);
    for (stream *s = streams; s != NULL; s = s->next) {
      pthread_mutex_lock(&s->mu);
      land(s, 0);
      pthread_mutex_unlock(&s->mu);
    }
    pthread_mutex_unlock(&mu);
    sleep_ms(1);
  }
  return NULL;
}

static void start_lander(void) {
  pthread_t t;
  if (pthread_create(&t, NULL, lander, NULL) == 0) pthread_detach(t);
}

static void enqueue(stream *s, op *o) {
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, start_lander);
  pthread_mutex_lock(&s->mu);
  if (s->tail != NULL) s->tail->next = o;
  else s->head = o;
  s->tail = o;
  pthread_mutex_unlock(&s->mu);
}

/* A copy of n bytes to dst on s, landing after the lag; pageable source
 * bytes are taken now (CUDA stages them), pinned and device ones when it
 * lands. */
static int enqueue_copy(stream *s, void *dst, const void *src, size_t n, int snapshot) {
  op *o = calloc(1, sizeof *o);
  if (o == NULL) return ERR_MEMORY;
  *o = (op){.dst = dst, .src = src, .n = n, .due_ms = now_ms() + lag_ms()};
  if (snapshot && n > 0) {
    if ((o->owned = malloc(n)) == NULL) {
      free(o);
      return ERR_MEMORY;
    }
    memcpy(o->owned, src, n);
  }
  enqueue(s, o);
  return OK;
}

static void drain(stream *s) {
  pthread_mutex_lock(&s->mu);
  land(s, 1);
  while (s->head != NULL) { /* a kernel: wait for it, however long */
    pthread_cond_wait(&s->cv, &s->mu);
    land(s, 1);
  }
  pthread_mutex_unlock(&s->mu);
}

EXPORT int cudaStreamCreate(void **out) {
  stream *s = calloc(1, sizeof *s);
  if (s == NULL) return ERR_MEMORY;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);
  pthread_mutex_lock(&mu);
  s->next = streams;
  streams = s;
  pthread_mutex_unlock(&mu);
  *out = s;
  return OK;
}

EXPORT int cudaStreamSynchronize(void *sp) {
  drain(sp != NULL ? sp : &legacy);
  return injected("sync") ? ERR_LAUNCH : OK;
}

static void synchronize_all(void) {
  pthread_mutex_lock(&mu);
  stream *all = streams;
  pthread_mutex_unlock(&mu);
  for (stream *s = all; s != NULL; s = s->next) drain(s);
}

EXPORT int cudaDeviceSynchronize(void) {
  synchronize_all();
  return injected("sync") ? ERR_LAUNCH : OK;
}

/* Like CUDA, it waits for the stream's work, then frees it. */
EXPORT int cudaStreamDestroy(void *sp) {
  stream *s = sp;
  drain(s);
  pthread_mutex_lock(&mu);
  for (stream **pp = &streams; *pp != NULL; pp = &(*pp)->next)
    if (*pp == s) {
      *pp = s->next;
      break;
    }
  pthread_mutex_unlock(&mu);
  pthread_mutex_destroy(&s->mu);
  pthread_cond_destroy(&s->cv);
  free(s);
  return OK;
}

EXPORT int cudaStreamQuery(void *sp) {
  stream *s = sp != NULL ? sp : &legacy;
  pthread_mutex_lock(&s->mu);
  land(s, 0);
  int rc = s->head != NULL ? ERR_NOT_READY : OK;
  pthread_mutex_unlock(&s->mu);
  return rc == OK && injected("sync") ? ERR_LAUNCH : rc;
}

/* Appends "<pid> <what> <detail>" to WTX_FAKE_CUDA_LOG, when set: one write
 * of one line with O_APPEND, so lines of processes never mix. */
static void log_line(const char *what, const char *detail) {
  const char *log = getenv("WTX_FAKE_CUDA_LOG");
  if (log == NULL || log[0] == '\0') return;
  char line[160];
  int n = snprintf(line, sizeof line, "%d %s %s\n", (int)getpid(), what, detail);
  int fd = open(log, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (fd >= 0 && n > 0 && write(fd, line, (size_t)n) < 0) n = 0;
  if (fd >= 0) close(fd);
}

/* Bytes this process copied device to device. */
static atomic_uint_fast64_t d2d_bytes;

__attribute__((destructor)) static void log_d2d(void) {
  char n[32];
  snprintf(n, sizeof n, "%llu", (unsigned long long)atomic_load(&d2d_bytes));
  log_line("d2d", n);
}

EXPORT int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *sp) {
  if (injected("copy")) return ERR_LAUNCH;
  int rc = resolve_copy(dst, src, n, kind, &dst, &src);
  if (rc != OK) return rc;
  if (kind == KIND_D2D) atomic_fetch_add(&d2d_bytes, n);
  int pageable = kind == KIND_H2D && !is_pinned(src, n);
  return enqueue_copy(sp != NULL ? sp : &legacy, dst, src, n, pageable);
}

EXPORT int cudaMemcpy(void *dst, const void *src, size_t n, int kind) {
  if (injected("copy")) return ERR_LAUNCH;
  int rc = resolve_copy(dst, src, n, kind, &dst, &src);
  if (rc != OK) return rc;
  if (kind == KIND_D2D) atomic_fetch_add(&d2d_bytes, n);
  if (kind == KIND_H2D && !is_pinned(src, n))
    return enqueue_copy(&legacy, dst, src, n, 1); /* returns before it lands */
  drain(&legacy); /* ordered after earlier work of the default stream */
  if (n > 0) memcpy(dst, src, n);
  return OK;
}

/* Like CUDA's, it waits for the device's work first. */
EXPORT int cudaFree(void *ptr) {
  if (ptr == NULL) return OK;
  synchronize_all();
  alloc *a = take(ptr, 0, 0);
  if (a == NULL) return ERR_INVALID;
  atomic_fetch_sub(&in_use, a->size);
  if (hard() && a->size > 0) memset(a->view, 0xdb, a->size); /* what an opener reads now */
  unmap(a);
  shm_unlink(a->name);
  free(a);
  return OK;
}

EXPORT int cudaIpcGetMemHandle(ipc_handle *h, void *ptr) {
  memset(h, 0, sizeof *h);
  pthread_mutex_lock(&mu);
  alloc *a = allocs;
  while (a != NULL && (a->ptr != ptr || a->opened || a->pinned)) a = a->next;
  if (a != NULL) {
    memcpy(h->bytes, "FAKEIPC", 8);
    memcpy(h->bytes + 8, a->name, strlen(a->name));
    h->bytes[sizeof h->bytes - 1] = (char)a->device;
  }
  pthread_mutex_unlock(&mu);
  return a != NULL ? OK : ERR_INVALID;
}

EXPORT int cudaIpcOpenMemHandle(void **ptr, ipc_handle h, unsigned flags) {
  (void)flags;
  int pid = 0;
  if (memcmp(h.bytes, "FAKEIPC", 8) != 0 || sscanf(h.bytes + 8, "/wtxfake-%d-", &pid) != 1)
    return ERR_INVALID;
  if (pid == (int)getpid()) return ERR_HANDLE; /* CUDA: not in the exporting process */
  if (hard() && h.bytes[sizeof h.bytes - 1] != (char)current_device) return ERR_PEER;
  alloc *a = calloc(1, sizeof *a);
  if (a == NULL) return ERR_MEMORY;
  memcpy(a->name, h.bytes + 8, sizeof a->name - 1);
  a->opened = 1;
  int rc = track(a, 0, ptr);
  if (rc == OK) log_line("open", a->name);
  return rc;
}

EXPORT int cudaIpcCloseMemHandle(void *ptr) {
  alloc *a = take(ptr, 1, 0);
  if (a == NULL) return ERR_INVALID;
  unmap(a);
  free(a);
  return OK;
}

EXPORT const char *cudaGetErrorString(int err) {
  switch (err) {
    case OK: return "no error (fake CUDA)";
    case ERR_INVALID: return "invalid argument (fake CUDA)";
    case ERR_MEMORY: return "out of memory (fake CUDA)";
    case ERR_DEVICE: return "invalid device ordinal (fake CUDA)";
    case ERR_HANDLE: return "invalid resource handle (fake CUDA)";
    case ERR_NOT_READY: return "device not ready (fake CUDA)";
    case ERR_PEER: return "peer access is not supported between these two devices (fake CUDA)";
    case ERR_ILLEGAL: return "an illegal memory access was encountered (fake CUDA)";
    case ERR_LAUNCH: return "unspecified launch failure (fake CUDA)";
    default: return "unknown error (fake CUDA)";
  }
}

/* This double's own: kernels (broadcasts) of this process still running. */
EXPORT int wtx_fake_cuda_running_kernels(void) { return atomic_load(&running_kernels); }

/* ---- NCCL ---- */

/* One communicator's state shared by its ranks' processes. */
typedef struct control {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  atomic_int ready;
  int nranks, joined;
  int pid[MAX_RANKS];
  unsigned char uuid[MAX_RANKS][16];
  int device[MAX_RANKS];
  uint64_t posted; /* broadcasts posted by the root */
  int done;        /* ranks that copied the last one */
  size_t bytes;
  /* Point to point, per (sender, receiver): sends posted, the last one's
   * bytes, and sends the receiver took. */
  uint64_t p2p_posted[MAX_RANKS][MAX_RANKS];
  size_t p2p_bytes[MAX_RANKS][MAX_RANKS];
  uint64_t p2p_taken[MAX_RANKS][MAX_RANKS];
} control;

typedef struct comm {
  control *ctl;
  char name[64];
  int rank, nranks, device;
  uint64_t seq;
  uint64_t sent[MAX_RANKS], received[MAX_RANKS]; /* point to point, per peer */
  atomic_int state;   /* NCCL_IN_PROGRESS while joining, then a result */
  atomic_int aborted; /* ncclCommAbort: every wait ends */
  atomic_int kernels; /* its broadcasts still running */
  pthread_t joiner;
  int has_joiner;
  char last[300]; /* ncclGetLastError */
} comm;

static _Thread_local char last_error[300];

static void lock(control *c) {
  if (pthread_mutex_lock(&c->mu) == EOWNERDEAD) pthread_mutex_consistent(&c->mu);
}

/* Waits on the control block for up to 5 ms (then the caller looks at
 * aborts and dead peers again). */
static void wait_a_little(control *c) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_nsec += 5000000;
  if (ts.tv_nsec >= 1000000000) {
    ts.tv_sec++;
    ts.tv_nsec -= 1000000000;
  }
  if (pthread_cond_timedwait(&c->cv, &c->mu, &ts) == EOWNERDEAD)
    pthread_mutex_consistent(&c->mu);
}

/* A rank whose process is gone, or -1 (always, in hard mode: NCCL never
 * notices). Caller holds the control lock. */
static int dead_peer(const comm *cm) {
  if (hard()) return -1;
  for (int r = 0; r < cm->nranks; r++)
    if (r != cm->rank && cm->ctl->pid[r] > 0 && kill(cm->ctl->pid[r], 0) != 0 && errno == ESRCH)
      return r;
  return -1;
}

/* Hard mode's answer to sizes that differ: NCCL hangs (or corrupts), so
 * wait, lock held, until the communicator is aborted. */
static int hang(comm *cm) {
  while (!atomic_load(&cm->aborted)) wait_a_little(cm->ctl);
  return NCCL_SYSTEM;
}

/* Records msg as the communicator's last error (ncclGetLastError). */
static int fail_with(comm *cm, int result, const char *msg) {
  snprintf(cm->last, sizeof cm->last, "%s", msg);
  snprintf(last_error, sizeof last_error, "%s", msg);
  return result;
}

/* Waits until every rank has joined; no timeout (NCCL's bootstrap has
 * none either): ends early only on abort or a dead peer. */
static int join(comm *cm) {
  control *c = cm->ctl;
  lock(c);
  int rc = OK, dead = -1;
  while (c->joined < cm->nranks && rc == OK) {
    if (atomic_load(&cm->aborted)) rc = NCCL_SYSTEM;
    else if ((dead = dead_peer(cm)) >= 0) rc = NCCL_REMOTE;
    else wait_a_little(c);
  }
  int dup = -1;
  for (int r = 0; rc == OK && r < cm->nranks; r++)
    if (r != cm->rank && memcmp(c->uuid[r], c->uuid[cm->rank], 16) == 0) dup = r;
  int dev = c->device[cm->rank];
  pthread_mutex_unlock(&c->mu);
  char msg[200];
  if (rc == NCCL_SYSTEM) return fail_with(cm, rc, "communicator aborted during init");
  if (rc == NCCL_REMOTE) {
    snprintf(msg, sizeof msg, "rank %d is gone (its process exited)", dead);
    return fail_with(cm, rc, msg);
  }
  if (dup >= 0) {
    snprintf(msg, sizeof msg, "Duplicate GPU detected : rank %d and rank %d both on CUDA "
             "device %x", cm->rank < dup ? cm->rank : dup, cm->rank < dup ? dup : cm->rank, dev);
    return fail_with(cm, NCCL_USAGE, msg);
  }
  return OK;
}

static void *joiner(void *arg) {
  comm *cm = arg;
  atomic_store(&cm->state, join(cm));
  return NULL;
}

/* Maps (creating it when first) the control block of id. */
static int attach(comm *cm) {
  size_t size = sizeof(control);
  void *p = NULL;
  int created = map_shm(cm->name, 1, &size, &p) == OK;
  while (!created) { /* the creator may not have sized it yet */
    size = 0;
    if (map_shm(cm->name, 0, &size, &p) == OK && size >= sizeof(control)) break;
    if (p != NULL) munmap(p, size ? size : 1);
    p = NULL;
    if (atomic_load(&cm->aborted)) return NCCL_SYSTEM;
    sleep_ms(1);
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
    c->nranks = cm->nranks;
    atomic_store(&c->ready, 1);
  }
  while (!atomic_load(&c->ready)) sleep_ms(1);
  lock(c);
  c->pid[cm->rank] = (int)getpid();
  device_uuid(cm->device, c->uuid[cm->rank]);
  c->device[cm->rank] = cm->device;
  c->joined++;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  return OK;
}

static void comm_free(comm *cm) {
  if (cm->ctl != NULL) munmap(cm->ctl, sizeof(control));
  shm_unlink(cm->name);
  free(cm);
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

EXPORT int ncclCommInitRankConfig(void **out, int nranks, nccl_id id, int rank,
                                  nccl_config_head *config) {
  *out = NULL;
  if (strncmp(id.internal, "/wtxfakenccl-", 13) != 0 || rank < 0 || rank >= nranks ||
      nranks > MAX_RANKS)
    return NCCL_INVALID;
  if (config != NULL && (config->magic != 0xcafebeef || config->size < sizeof *config))
    return NCCL_INVALID;
  comm *cm = calloc(1, sizeof *cm);
  if (cm == NULL) return NCCL_SYSTEM;
  snprintf(cm->name, sizeof cm->name, "%.60s", id.internal);
  cm->rank = rank;
  cm->nranks = nranks;
  cm->device = current_device;
  atomic_init(&cm->state, NCCL_IN_PROGRESS);
  int rc = attach(cm);
  if (rc != OK) {
    comm_free(cm);
    return rc;
  }
  int blocking = config == NULL || config->blocking != 0;
  if (blocking) { /* the defect non-blocking init fixes: no way out */
    rc = join(cm);
    if (rc != OK) {
      comm_free(cm);
      return rc;
    }
    atomic_store(&cm->state, OK);
    *out = cm;
    return OK;
  }
  if (pthread_create(&cm->joiner, NULL, joiner, cm) != 0) {
    comm_free(cm);
    return NCCL_SYSTEM;
  }
  cm->has_joiner = 1;
  *out = cm;
  return NCCL_IN_PROGRESS;
}

EXPORT int ncclCommInitRank(void **out, int nranks, nccl_id id, int rank) {
  return ncclCommInitRankConfig(out, nranks, id, rank, NULL);
}

EXPORT int ncclCommGetAsyncError(void *commp, int *err) {
  if (commp == NULL) return NCCL_INVALID;
  *err = atomic_load(&((comm *)commp)->state);
  return OK;
}

EXPORT const char *ncclGetLastError(void *commp) {
  return commp != NULL ? ((comm *)commp)->last : last_error;
}

/* A kernel's end: a failure (not an abort's) recorded as the
 * communicator's asynchronous error, then its result on its stream. The
 * count of running kernels drops first, so a waiter sees it gone. */
static void kernel_end(comm *cm, stream *s, kernel *k, int rc, const char *why) {
  if (rc != OK && !atomic_load(&cm->aborted)) {
    fail_with(cm, rc, why);
    atomic_store(&cm->state, rc);
  }
  atomic_fetch_sub(&running_kernels, 1);
  pthread_mutex_lock(&s->mu);
  k->result = rc;
  atomic_store(&k->done, 1);
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

/* Queues a kernel on s (what follows it on s waits for it) and runs
 * fn(arg) on a thread of its own; *slot (in arg) is the kernel's. On
 * NCCL_SYSTEM nothing runs and arg is the caller's to free. */
static int launch(comm *cm, stream *s, kernel **slot, void *(*fn)(void *), void *arg) {
  op *o = calloc(1, sizeof *o);
  kernel *k = calloc(1, sizeof *k);
  if (o == NULL || k == NULL) {
    free(o);
    free(k);
    return NCCL_SYSTEM;
  }
  *slot = o->k = k;
  enqueue(s, o);
  atomic_fetch_add(&running_kernels, 1);
  atomic_fetch_add(&cm->kernels, 1);
  pthread_t t;
  if (pthread_create(&t, NULL, fn, arg) != 0) {
    atomic_fetch_sub(&running_kernels, 1);
    atomic_fetch_sub(&cm->kernels, 1);
    atomic_store(&k->done, 1);
    return NCCL_SYSTEM;
  }
  pthread_detach(t);
  return OK;
}

typedef struct bcast {
  comm *cm;
  kernel *k;
  stream *s;
  const void *send;
  void *recv;
  size_t count;
  int root;
  uint64_t seq;
} bcast;

/* The broadcast's "kernel" on the root: post the bytes, wait until every
 * rank took them. */
static int bcast_root(bcast *b, const char *data_name) {
  comm *cm = b->cm;
  control *c = cm->ctl;
  void *p = NULL;
  size_t size = b->count;
  if (map_shm(data_name, 1, &size, &p) != OK) return NCCL_SYSTEM;
  if (b->count > 0) memcpy(p, b->send, b->count);
  munmap(p, b->count ? b->count : 1);
  lock(c);
  c->bytes = b->count;
  c->done = 0;
  c->posted = b->seq + 1;
  pthread_cond_broadcast(&c->cv);
  int rc = OK;
  while (c->done < cm->nranks - 1 && rc == OK) {
    if (atomic_load(&cm->aborted)) rc = NCCL_SYSTEM;
    else if (dead_peer(cm) >= 0) rc = NCCL_REMOTE;
    else wait_a_little(c);
  }
  pthread_mutex_unlock(&c->mu);
  shm_unlink(data_name);
  return rc;
}

/* On the other ranks: wait for the root's bytes, take them. */
static int bcast_leaf(bcast *b, const char *data_name) {
  comm *cm = b->cm;
  control *c = cm->ctl;
  lock(c);
  int rc = OK;
  while (c->posted < b->seq + 1 && rc == OK) {
    if (atomic_load(&cm->aborted)) rc = NCCL_SYSTEM;
    else if (dead_peer(cm) >= 0) rc = NCCL_REMOTE;
    else wait_a_little(c);
  }
  size_t bytes = c->bytes;
  if (rc == OK && bytes != b->count && hard()) rc = hang(cm);
  pthread_mutex_unlock(&c->mu);
  if (rc == OK && bytes != b->count) rc = NCCL_INVALID;
  void *p = NULL;
  size_t size = 0;
  if (rc == OK && map_shm(data_name, 0, &size, &p) != OK) rc = NCCL_SYSTEM;
  if (rc == OK) {
    if (b->count > 0) memcpy(b->recv, p, b->count);
    munmap(p, size ? size : 1);
    lock(c);
    c->done++;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
  }
  return rc;
}

static void *bcast_kernel(void *arg) {
  bcast *b = arg;
  char data_name[100];
  snprintf(data_name, sizeof data_name, "%s-%llu", b->cm->name, (unsigned long long)b->seq);
  int rc = b->cm->rank == b->root ? bcast_root(b, data_name) : bcast_leaf(b, data_name);
  comm *cm = b->cm;
  kernel_end(cm, b->s, b->k, rc, "broadcast: a peer process is gone");
  free(b);
  atomic_fetch_sub(&cm->kernels, 1); /* last: an abort may free cm now */
  return NULL;
}

EXPORT int ncclBroadcast(const void *send, void *recv, size_t count, int dtype, int root,
                         void *commp, void *sp) {
  (void)dtype;
  comm *cm = commp;
  if (cm == NULL || atomic_load(&cm->state) != OK) return NCCL_INVALID;
  /* Both buffers in device memory (send only matters on the root); dtype:
   * bytes (ncclUint8) is all wtx uses. */
  int on_device = 1;
  if (cm->rank == root) send = reach(send, count, &on_device);
  if (cm->rank == root && (send == NULL || !on_device)) return NCCL_INVALID;
  recv = reach(recv, count, &on_device);
  if (recv == NULL || !on_device) return NCCL_INVALID;
  bcast *b = calloc(1, sizeof *b);
  if (b == NULL) return NCCL_SYSTEM;
  stream *s = sp != NULL ? sp : &legacy;
  *b = (bcast){cm, NULL, s, send, recv, count, root, cm->seq++};
  int rc = launch(cm, s, &b->k, bcast_kernel, b);
  if (rc != OK) free(b);
  return rc;
}

typedef struct p2p {
  comm *cm;
  kernel *k;
  stream *s;
  void *buf; /* the double's view of the device buffer */
  size_t count;
  int peer, send;
  uint64_t seq;
} p2p;

/* Waits, lock held, until cond (an expression over c) holds, the
 * communicator is aborted or a peer is gone. */
#define AWAIT(cm, c, cond)                                      \
  do {                                                          \
    while (!(cond) && rc == OK) {                               \
      if (atomic_load(&(cm)->aborted)) rc = NCCL_SYSTEM;        \
      else if (dead_peer(cm) >= 0) rc = NCCL_REMOTE;            \
      else wait_a_little(c);                                    \
    }                                                           \
  } while (0)

/* A send's "kernel": its bytes posted to the peer, then held until the
 * peer's matching receive took them (NCCL's rendezvous: a send whose
 * receive never comes runs forever). */
static int p2p_send(p2p *x, const char *data_name) {
  comm *cm = x->cm;
  control *c = cm->ctl;
  void *p = NULL;
  size_t size = x->count;
  if (map_shm(data_name, 1, &size, &p) != OK) return NCCL_SYSTEM;
  if (x->count > 0) memcpy(p, x->buf, x->count);
  munmap(p, x->count ? x->count : 1);
  lock(c);
  int rc = OK;
  /* the peer took the send before this one (both ends are streams) */
  AWAIT(cm, c, c->p2p_taken[cm->rank][x->peer] >= x->seq);
  if (rc == OK) { /* the peer took the one before: its size may change */
    c->p2p_bytes[cm->rank][x->peer] = x->count;
    c->p2p_posted[cm->rank][x->peer] = x->seq + 1;
  }
  pthread_cond_broadcast(&c->cv);
  AWAIT(cm, c, c->p2p_taken[cm->rank][x->peer] >= x->seq + 1);
  pthread_mutex_unlock(&c->mu);
  shm_unlink(data_name);
  return rc;
}

/* A receive's: waits for the peer's matching send, which must carry as
 * many bytes (NCCL's sizes must match), and takes it. */
static int p2p_recv(p2p *x, const char *data_name) {
  comm *cm = x->cm;
  control *c = cm->ctl;
  lock(c);
  int rc = OK;
  AWAIT(cm, c, c->p2p_posted[x->peer][cm->rank] >= x->seq + 1);
  size_t bytes = c->p2p_bytes[x->peer][cm->rank];
  if (rc == OK && bytes != x->count && hard()) rc = hang(cm);
  pthread_mutex_unlock(&c->mu);
  if (rc == OK && bytes != x->count) rc = NCCL_INVALID;
  void *p = NULL;
  size_t size = 0;
  if (rc == OK && map_shm(data_name, 0, &size, &p) != OK) rc = NCCL_SYSTEM;
  if (rc != OK) return rc;
  if (x->count > 0) memcpy(x->buf, p, x->count);
  munmap(p, size ? size : 1);
  lock(c);
  c->p2p_taken[x->peer][cm->rank] = x->seq + 1;
  pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
  return OK;
}

static void *p2p_kernel(void *arg) {
  p2p *x = arg;
  comm *cm = x->cm;
  /* A kernel starts once the work queued before it on its stream is done:
   * woken when a kernel ends, and each millisecond for copies falling due
   * (and an abort). */
  int rc = OK;
  pthread_mutex_lock(&x->s->mu);
  for (land(x->s, 0); x->s->head->k != x->k && !atomic_load(&cm->aborted); land(x->s, 0)) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 1000000;
    if (ts.tv_nsec >= 1000000000) {
      ts.tv_sec++;
      ts.tv_nsec -= 1000000000;
    }
    pthread_cond_timedwait(&x->s->cv, &x->s->mu, &ts);
  }
  pthread_mutex_unlock(&x->s->mu);
  if (atomic_load(&cm->aborted)) rc = NCCL_SYSTEM;
  char data_name[120];
  int from = x->send ? cm->rank : x->peer, to = x->send ? x->peer : cm->rank;
  snprintf(data_name, sizeof data_name, "%s-p%d-%d-%llu", cm->name, from, to,
           (unsigned long long)x->seq);
  if (rc == OK) rc = x->send ? p2p_send(x, data_name) : p2p_recv(x, data_name);
  kernel_end(cm, x->s, x->k, rc, rc == NCCL_INVALID ? "send and receive sizes differ"
                                                     : "point to point: a peer process is gone");
  free(x);
  atomic_fetch_sub(&cm->kernels, 1); /* last: an abort may free cm now */
  return NULL;
}

static int p2p_enqueue(void *buf, size_t count, int peer, void *commp, void *sp, int send) {
  comm *cm = commp;
  if (cm == NULL || atomic_load(&cm->state) != OK || peer < 0 || peer >= cm->nranks ||
      peer == cm->rank)
    return NCCL_INVALID;
  int on_device = 1;
  void *view = reach(buf, count, &on_device);
  if (view == NULL || !on_device) return NCCL_INVALID; /* device memory only */
  p2p *x = calloc(1, sizeof *x);
  if (x == NULL) return NCCL_SYSTEM;
  stream *s = sp != NULL ? sp : &legacy;
  uint64_t seq = send ? cm->sent[peer]++ : cm->received[peer]++;
  *x = (p2p){cm, NULL, s, view, count, peer, send, seq};
  int rc = launch(cm, s, &x->k, p2p_kernel, x);
  if (rc != OK) free(x);
  return rc;
}

/* dtype: bytes (ncclUint8) is all wtx uses, so count is bytes. */
EXPORT int ncclSend(const void *send, size_t count, int dtype, int peer, void *commp, void *sp) {
  (void)dtype;
  return p2p_enqueue((void *)send, count, peer, commp, sp, 1);
}

EXPORT int ncclRecv(void *recv, size_t count, int dtype, int peer, void *commp, void *sp) {
  (void)dtype;
  return p2p_enqueue(recv, count, peer, commp, sp, 0);
}

/* Ends every wait of the communicator (init, kernels), then frees it. */
EXPORT int ncclCommAbort(void *commp) {
  comm *cm = commp;
  if (cm == NULL) return NCCL_INVALID;
  atomic_store(&cm->aborted, 1);
  if (cm->has_joiner) pthread_join(cm->joiner, NULL);
  while (atomic_load(&cm->kernels) > 0) sleep_ms(1); /* they see the abort within 5 ms */
  comm_free(cm);
  return OK;
}

EXPORT int ncclCommDestroy(void *commp) {
  comm *cm = commp;
  if (cm == NULL) return NCCL_INVALID;
  if (cm->has_joiner) { /* a destroy during init: NCCL requires an abort */
    atomic_store(&cm->aborted, 1);
    pthread_join(cm->joiner, NULL);
  }
  while (atomic_load(&cm->kernels) > 0) sleep_ms(1); /* destroy waits for its work */
  comm_free(cm);
  return OK;
}

/* This double's own export, for tests that must act once a root has
 * posted a broadcast (and not before): the broadcasts comm's root has
 * posted so far. */
EXPORT uint64_t wtx_fake_cuda_posted(void *commp) {
  comm *cm = commp;
  lock(cm->ctl);
  uint64_t n = cm->ctl->posted;
  pthread_mutex_unlock(&cm->ctl->mu);
  return n;
}

EXPORT const char *ncclGetErrorString(int err) {
  switch (err) {
    case OK: return "no error (fake NCCL)";
    case NCCL_SYSTEM: return "unhandled system error (fake NCCL)";
    case NCCL_INVALID: return "invalid argument (fake NCCL)";
    case NCCL_USAGE: return "invalid usage (fake NCCL)";
    case NCCL_REMOTE: return "remote process exited or there was a network error (fake NCCL)";
    case NCCL_IN_PROGRESS: return "NCCL operation in progress (fake NCCL)";
    default: return "unknown error (fake NCCL)";
  }
}
