/* The seam probe: every CUDA runtime and NCCL function wtx loads
 * (cuda/cuda.h), called through the loader as the backends call them, on
 * the real libraries of a GPU machine (or the test double here). Run by
 * tests/gpu/device_check.sh.
 *
 *   probe calls          every function once; "PASS calls" or "FAIL ...: why"
 *   probe ipc N          N rounds: this process uploads a new pattern into an
 *                        exported device buffer (as the cuda_ipc trainer
 *                        does) and a second process (probe ipc-child, spawned)
 *                        reads it through the IPC handle at once: no round
 *                        may see stale bytes
 *   probe d2d BYTES      cudaMemcpy device to device of BYTES, best of 3, in
 *                        GB/s: the baseline of the GPU throughput figures
 *
 * Exit status 0 only when everything asked for passed. */
#include <errno.h>
#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "cuda/cuda.h"

extern char **environ;

static const wtx_cuda *c;

static int fail(const char *what, const char *why) {
  printf("FAIL %s: %s\n", what, why);
  return 1;
}

static int cu(const char *what, int e) {
  return e == WTX_CUDA_SUCCESS ? 0 : fail(what, c->GetErrorString(e));
}

/* Every runtime function, on device 0. */
static int runtime_calls(void) {
  int prev, dev = -1;
  uint8_t uuid[16];
  void *d = NULL, *d2 = NULL, *h = NULL, *s = NULL;
  int bad = cu("cudaGetDevice", c->GetDevice(&prev)) || cu("cudaSetDevice", c->SetDevice(0)) ||
            cu("cudaGetDevice", c->GetDevice(&dev)) ||
            (wtx__cuda_uuid(c, 0, uuid) != 0 && fail("cudaGetDeviceProperties", "no uuid")) ||
            cu("cudaMalloc", c->Malloc(&d, 1 << 20)) || cu("cudaMalloc", c->Malloc(&d2, 1 << 20)) ||
            cu("cudaMallocHost", c->MallocHost(&h, 1 << 20)) ||
            cu("cudaStreamCreate", c->StreamCreate(&s));
  if (!bad) {
    memset(h, 0x5a, 1 << 20);
    bad = cu("cudaMemcpyAsync", c->MemcpyAsync(d, h, 1 << 20, WTX_CUDA_H2D, s)) ||
          cu("cudaStreamSynchronize", c->StreamSynchronize(s)) ||
          cu("cudaMemcpy D2D", c->Memcpy(d2, d, 1 << 20, 3)) ||
          cu("cudaMemcpy D2H", c->Memcpy(h, d2, 1 << 20, WTX_CUDA_D2H)) ||
          ((((uint8_t *)h)[12345] != 0x5a) && fail("copies", "bytes did not arrive"));
  }
  if (!bad) {
    int q = c->StreamQuery(s);
    if (q != WTX_CUDA_SUCCESS) bad = fail("cudaStreamQuery", c->GetErrorString(q));
  }
  wtx_cuda_ipc_handle ih;
  if (!bad) bad = cu("cudaIpcGetMemHandle", c->IpcGetMemHandle(&ih, d));
  if (s != NULL) bad |= cu("cudaStreamDestroy", c->StreamDestroy(s));
  if (h != NULL) bad |= cu("cudaFreeHost", c->FreeHost(h));
  if (d2 != NULL) bad |= cu("cudaFree", c->Free(d2));
  if (d != NULL) bad |= cu("cudaFree", c->Free(d));
  c->SetDevice(prev);
  return bad;
}

/* Every NCCL function on a communicator of one rank (any GPU count). */
static int nccl_calls(void) {
  wtx_nccl_id id;
  void *comm = NULL, *buf = NULL, *s = NULL;
  char err[400];
  int e = c->GetUniqueId(&id);
  if (e != WTX_NCCL_SUCCESS) return fail("ncclGetUniqueId", c->NcclErrorString(e));
  c->SetDevice(0);
  if (wtx__nccl_join(c, &comm, 1, &id, 0, 60000, NULL, err, sizeof err) != 0)
    return fail("ncclCommInitRankConfig (non-blocking, 1 rank)", err);
  int bad = cu("cudaMalloc", c->Malloc(&buf, 4096)) || cu("cudaStreamCreate", c->StreamCreate(&s));
  if (!bad && (e = c->Broadcast(buf, buf, 4096, WTX_NCCL_UINT8, 0, comm, s)) != WTX_NCCL_SUCCESS)
    bad = fail("ncclBroadcast", wtx__nccl_error(c, comm, e, err, sizeof err));
  if (!bad && wtx__cuda_wait(c, s, comm, 30000, NULL, err, sizeof err) != 0)
    bad = fail("ncclBroadcast (wait)", err);
  int ae = 0;
  if (!bad && (c->CommGetAsyncError(comm, &ae) != WTX_NCCL_SUCCESS || ae != WTX_NCCL_SUCCESS))
    bad = fail("ncclCommGetAsyncError", c->NcclErrorString(ae));
  (void)c->NcclLastError(comm); /* callable; the text is NCCL's */
  if ((e = c->CommDestroy(comm)) != WTX_NCCL_SUCCESS) bad = fail("ncclCommDestroy", c->NcclErrorString(e));
  /* Abort on a second communicator, as the backends do on failure. */
  if (!bad && c->GetUniqueId(&id) == WTX_NCCL_SUCCESS &&
      wtx__nccl_join(c, &comm, 1, &id, 0, 60000, NULL, err, sizeof err) == 0 &&
      (e = c->CommAbort(comm)) != WTX_NCCL_SUCCESS)
    bad = fail("ncclCommAbort", c->NcclErrorString(e));
  if (s != NULL) c->StreamDestroy(s);
  if (buf != NULL) c->Free(buf);
  return bad;
}

/* ---- cross-process IPC, no stale reads ---- */

static uint8_t pattern(uint32_t round, size_t i) { return (uint8_t)(round * 131 + i * 7); }

static int child(void) {
  wtx_cuda_ipc_handle h;
  uint64_t size;
  if (fread(&h, sizeof h, 1, stdin) != 1 || fread(&size, sizeof size, 1, stdin) != 1) return 2;
  c->SetDevice(0);
  void *d = NULL;
  if (c->IpcOpenMemHandle(&d, h, WTX_CUDA_IPC_LAZY_PEER) != WTX_CUDA_SUCCESS) return 3;
  uint8_t *buf = malloc(size);
  uint32_t round;
  while (buf != NULL && fread(&round, sizeof round, 1, stdin) == 1) {
    int ok = c->Memcpy(buf, d, size, WTX_CUDA_D2H) == WTX_CUDA_SUCCESS;
    for (size_t i = 0; ok && i < size; i += 4093) ok = buf[i] == pattern(round, i);
    ok = ok && buf[size - 1] == pattern(round, size - 1);
    char r = ok ? 'y' : 'n';
    if (fwrite(&r, 1, 1, stdout) != 1 || fflush(stdout) != 0) break;
  }
  c->IpcCloseMemHandle(d);
  free(buf);
  return 0;
}

static int ipc(const char *self, int rounds) {
  const uint64_t size = 16u << 20;
  wtx__cuda_trainer t;
  char err[600];
  if (wtx__cuda_trainer_open(&t, "probe", 0, 1, size, 30000, err, sizeof err) != 0)
    return fail("ipc", err);
  wtx_cuda_ipc_handle h;
  c->SetDevice(t.device);
  int e = c->IpcGetMemHandle(&h, t.bufs.dev[0]);
  if (e != WTX_CUDA_SUCCESS) return fail("ipc: cudaIpcGetMemHandle", c->GetErrorString(e));
  int to[2], from[2];
  /* close-on-exec: the child keeps only its dup2'd ends, so it sees EOF */
  if (pipe2(to, O_CLOEXEC) != 0 || pipe2(from, O_CLOEXEC) != 0) return fail("ipc", strerror(errno));
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, to[0], 0);
  posix_spawn_file_actions_adddup2(&fa, from[1], 1);
  /* Bundled, the probe runs through a wrapper (tests/gpu/bundle.sh) that
   * names itself in WTX_PROBE_SELF. */
  const char *exe = getenv("WTX_PROBE_SELF") != NULL ? getenv("WTX_PROBE_SELF") : self;
  char *argv[] = {(char *)exe, "ipc-child", NULL};
  pid_t pid;
  if (posix_spawn(&pid, exe, &fa, NULL, argv, environ) != 0) return fail("ipc", "spawn");
  close(to[0]);
  close(from[1]);
  FILE *w = fdopen(to[1], "w"), *r = fdopen(from[0], "r");
  fwrite(&h, sizeof h, 1, w);
  fwrite(&size, sizeof size, 1, w);
  int stale = 0, done = 0;
  for (uint32_t round = 1; round <= (uint32_t)rounds; round++, done++) {
    uint8_t *host = wtx__cuda_trainer_host(&t, 0);
    for (size_t i = 0; i < size; i++) host[i] = pattern(round, i);
    if (wtx__cuda_trainer_upload(&t, 0, size, err, sizeof err) != 0) return fail("ipc", err);
    char ans = 0;
    if (fwrite(&round, sizeof round, 1, w) != 1 || fflush(w) != 0 || fread(&ans, 1, 1, r) != 1)
      break;
    stale += ans != 'y';
  }
  fclose(w);
  fclose(r);
  int st = 0;
  waitpid(pid, &st, 0);
  wtx__cuda_trainer_close(&t);
  if (done != rounds) return fail("ipc", "the reading process stopped early");
  if (stale > 0) {
    printf("FAIL ipc: %d of %d rounds read stale bytes\n", stale, rounds);
    return 1;
  }
  printf("PASS ipc: %d rounds across processes, no stale read\n", rounds);
  return 0;
}

static int d2d(uint64_t bytes) {
  void *a = NULL, *b = NULL;
  c->SetDevice(0);
  if (cu("cudaMalloc", c->Malloc(&a, bytes)) || cu("cudaMalloc", c->Malloc(&b, bytes))) return 1;
  double best = 0;
  for (int i = 0; i < 4; i++) {
    double t0 = wtx__clock_s();
    if (cu("cudaMemcpy D2D", c->Memcpy(b, a, bytes, 3))) return 1;
    /* a D2D cudaMemcpy may return before it completes: read one byte back */
    uint8_t x;
    if (cu("cudaMemcpy D2H", c->Memcpy(&x, (uint8_t *)b + bytes - 1, 1, WTX_CUDA_D2H))) return 1;
    double s = wtx__clock_s() - t0;
    if (i > 0 && (best == 0 || s < best)) best = s; /* the first warms up */
  }
  printf("d2d %.3f GB/s\n", (double)bytes / best / 1e9);
  c->Free(a);
  c->Free(b);
  return 0;
}

int main(int argc, char **argv) {
  char err[600];
  if (argc < 2) {
    fprintf(stderr, "usage: probe calls | ipc N | d2d BYTES\n");
    return 2;
  }
  int nccl = strcmp(argv[1], "calls") == 0;
  if (wtx__cuda_load(nccl, &c, err, sizeof err) != 0) return fail(argv[1], err);
  if (strcmp(argv[1], "ipc-child") == 0) return child();
  if (strcmp(argv[1], "ipc") == 0) return ipc(argv[0], argc > 2 ? atoi(argv[2]) : 200);
  if (strcmp(argv[1], "d2d") == 0) return d2d(argc > 2 ? strtoull(argv[2], NULL, 10) : 1u << 30);
  if (!nccl) return fail(argv[1], "unknown mode");
  int bad = runtime_calls();
  bad |= nccl_calls();
  if (!bad) printf("PASS calls: every CUDA runtime and NCCL function wtx loads\n");
  return bad;
}
