/* wtx: the command line for people. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "client/client.h"
#include "transport/transport.h"

static const char usage[] =
    "usage: wtx push --workers HOST:PORT[,...] [options] SOURCE...\n"
    "       wtx info HOST:PORT [--params]\n"
    "       wtx version HOST:PORT[,...] NEW_VERSION\n"
    "       wtx abort HOST:PORT[,...] [REASON]\n"
    "\n"
    "push: one weight sync of SOURCE to every worker (all replicas of a model;\n"
    "never load-balanced). SOURCE is one or more .safetensors files, or\n"
    "synthetic:SIZE for a GPT-style bf16 model of about SIZE bytes (K/M/G).\n"
    "  --backend NAME       data plane: shm (same host), tcp, cuda_ipc (same\n"
    "                       node, GPU) or nccl (GPU) (default shm)\n"
    "  --buffer-size BYTES  transfer buffer (default 64M; K/M/G suffixes)\n"
    "  --num-buffers N      buffers in flight, 1..64 (default 2)\n"
    "  --unpacked           one tensor per chunk (default: packed)\n"
    "  --no-checksum        skip per-tensor XXH3-64 verification (the default\n"
    "                       on cuda_ipc and nccl; --verify needs checksums)\n"
    "  --checksum           verify per-tensor XXH3-64 (default on shm, tcp)\n"
    "  --data-address H:P   tcp: where the trainer's data port listens\n"
    "                       (default 127.0.0.1:0)\n"
    "  --version LABEL      weight version to publish (default: the workers\n"
    "                       number it)\n"
    "  --draft              update the draft model instead of the main one\n"
    "  --seed N             content of a synthetic model (default 0)\n"
    "  --timeout-ms MS      bound on every call and data-plane step (300000)\n"
    "  --token TOKEN        sent as 'authorization: Bearer TOKEN'\n"
    "  --tls-ca FILE        use TLS, trusting this CA bundle (PEM)\n"
    "  --tls-cert FILE, --tls-key FILE   client certificate (mutual TLS)\n"
    "  --verify             then compare every worker's checksums with ours\n"
    "                       (turns --checksum on)\n"
    "\n"
    "A progress bar (bytes/s, ETA) is drawn on a terminal; the last line is\n"
    "a summary: bytes, seconds, GB/s, version.\n";

static int parse_size(const char *s, uint64_t *out) {
  char *end;
  unsigned long long v = strtoull(s, &end, 10);
  if (end == s) return -1;
  if (*end == 'K' || *end == 'k') v <<= 10, end++;
  else if (*end == 'M' || *end == 'm') v <<= 20, end++;
  else if (*end == 'G' || *end == 'g') v <<= 30, end++;
  if (*end != '\0') return -1;
  *out = v;
  return 0;
}

static char *read_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (f == NULL) return NULL;
  char *buf = NULL;
  size_t len = 0, cap = 0, k;
  char tmp[4096];
  while ((k = fread(tmp, 1, sizeof tmp, f)) > 0) {
    if (len + k + 1 > cap) {
      cap = (len + k + 1) * 2;
      char *nb = realloc(buf, cap);
      if (nb == NULL) break;
      buf = nb;
    }
    memcpy(buf + len, tmp, k);
    len += k;
  }
  fclose(f);
  if (buf != NULL) buf[len] = '\0';
  return buf;
}

/* Splits a comma-separated list in place. */
static size_t split_list(char *list, const char **out, size_t max) {
  size_t n = 0;
  for (char *t = strtok(list, ","); t != NULL && n < max; t = strtok(NULL, ","))
    out[n++] = t;
  return n;
}

typedef struct progress {
  double t0;
  int tty;
} progress;

static void on_progress(void *arg, uint64_t done, uint64_t total) {
  progress *p = arg;
  if (!p->tty || total == 0) return;
  double dt = wtx_clock_s() - p->t0;
  double rate = dt > 0 ? done / dt : 0;
  double eta = rate > 0 ? (total - done) / rate : 0;
  int width = 30, fill = (int)(width * (double)done / total);
  char bar[64];
  for (int i = 0; i < width; i++) bar[i] = i < fill ? '=' : (i == fill ? '>' : ' ');
  bar[width] = '\0';
  fprintf(stderr, "\r[%s] %5.1f%%  %9.1f MB  %8.1f MB/s  ETA %5.1fs", bar,
          100.0 * done / total, done / 1e6, rate / 1e6, eta);
  if (done == total) fputc('\n', stderr);
}

typedef struct push_args {
  const char *workers, *backend, *version, *data_address, *token;
  const char *tls_ca, *tls_cert, *tls_key;
  uint64_t buffer, seed, timeout_ms;
  uint64_t num_buffers;
  int verify, unpacked, no_checksum, draft;
} push_args;

/* The init info the trainer brings: the backend's oneof and wire params. */
typedef struct init_msgs {
  Wtx__V1__InitInfo ii;
  Wtx__V1__PackingParams pk;
  Wtx__V1__ShmInitInfo shm;
  Wtx__V1__TcpInitInfo tcp;
  Wtx__V1__NcclInitInfo nccl;
  Wtx__V1__CudaIpcInitInfo cuda_ipc;
} init_msgs;

static int build_init(const push_args *a, init_msgs *m) {
  Wtx__V1__InitInfo *ii = &m->ii;
  Wtx__V1__PackingParams *pk = &m->pk;
  pk->packed = !a->unpacked;
  pk->buffer_size_bytes = a->buffer;
  pk->num_buffers = (uint32_t)a->num_buffers;
  Wtx__V1__ChecksumAlgorithm ck =
      a->no_checksum > 0    ? WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE
      : a->no_checksum == 0 ? WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64
                            : WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_UNSPECIFIED;
  uint32_t to = (uint32_t)a->timeout_ms;
  /* Every backend's init message has packing, checksum and timeout_ms. */
#define BACKEND(NAME, field, msg, INIT, CASE)          \
  if (strcmp(a->backend, NAME) == 0) {                 \
    m->field = (msg)INIT;                              \
    m->field.packing = pk;                             \
    m->field.checksum = ck;                            \
    m->field.timeout_ms = to;                          \
    ii->backend_case = WTX__V1__INIT_INFO__BACKEND_##CASE; \
    ii->field = &m->field;                             \
    ok = 1;                                            \
  }
  int ok = 0;
  BACKEND("shm", shm, Wtx__V1__ShmInitInfo, WTX__V1__SHM_INIT_INFO__INIT, SHM)
  BACKEND("tcp", tcp, Wtx__V1__TcpInitInfo, WTX__V1__TCP_INIT_INFO__INIT, TCP)
  BACKEND("nccl", nccl, Wtx__V1__NcclInitInfo, WTX__V1__NCCL_INIT_INFO__INIT, NCCL)
  BACKEND("cuda_ipc", cuda_ipc, Wtx__V1__CudaIpcInitInfo,
          WTX__V1__CUDA_IPC_INIT_INFO__INIT, CUDA_IPC)
#undef BACKEND
  if (ok && ii->backend_case == WTX__V1__INIT_INFO__BACKEND_TCP)
    m->tcp.upstream_address = (char *)(a->data_address ? a->data_address : "");
  if (!ok) {
    char names[256];
    wtx_transports_register_builtin();
    wtx_trainer_transport_names(names, sizeof names);
    fprintf(stderr, "wtx push: --backend %s: not available here (available: %s)\n",
            a->backend, names);
    return -1;
  }
  return 0;
}

static int open_source(int argc, char **argv, const push_args *a, wtx_source **src) {
  char err[1024] = "";
  uint64_t size;
  int rc;
  if (argc == 1 && strncmp(argv[0], "synthetic:", 10) == 0) {
    if (parse_size(argv[0] + 10, &size) != 0 || size == 0) {
      fprintf(stderr, "wtx push: source '%s': expected synthetic:SIZE\n", argv[0]);
      return -1;
    }
    rc = wtx_source_synthetic(size, a->seed, src);
    /* Materialize it now, as a trainer holds its weights before a sync:
     * the sync's time is the transfer, not the generator. */
    void *it = NULL;
    if (rc == 0 && (rc = wtx_source_open(*src, &it)) == 0) wtx_source_close(*src, it);
  } else {
    rc = wtx_source_safetensors((const char *const *)argv, (size_t)argc, src, err,
                                sizeof err);
  }
  if (rc != 0) {
    fprintf(stderr, "wtx push: source: %s\n", err[0] ? err : wtx_strerror(rc));
    return -1;
  }
  return 0;
}

static int make_client(const char *workers, const push_args *a, wtx_client **cl,
                       char **list_out) {
  char *list = strdup(workers);
  const char *targets[256];
  size_t nt = split_list(list, targets, 256);
  wtx_client_options co = WTX_CLIENT_OPTIONS_INIT;
  co.timeout_ms = a ? (int64_t)a->timeout_ms : 10000;
  co.retries = 2;
  char *ca = NULL, *cert = NULL, *key = NULL;
  if (a != NULL) {
    co.token = a->token;
    if (a->tls_ca && (co.tls_ca_pem = ca = read_file(a->tls_ca)) == NULL) {
      fprintf(stderr, "wtx: --tls-ca: cannot read %s\n", a->tls_ca);
      free(list);
      return -1;
    }
    if (a->tls_cert) co.tls_cert_pem = cert = read_file(a->tls_cert);
    if (a->tls_key) co.tls_key_pem = key = read_file(a->tls_key);
  }
  int rc = nt == 0 ? WTX_EINVAL : wtx_client_create(targets, nt, &co, cl);
  free(ca);
  free(cert);
  free(key);
  if (rc != 0) {
    fprintf(stderr, "wtx: workers '%s': %s\n", workers, wtx_strerror(rc));
    free(list);
    return -1;
  }
  *list_out = list;
  return 0;
}

static int cmd_push(int argc, char **argv) {
  push_args a = {.backend = "shm", .timeout_ms = 300000, .num_buffers = 2,
                 .no_checksum = -1};
  static const struct option longopts[] = {
      {"workers", required_argument, NULL, 'w'},
      {"backend", required_argument, NULL, 'b'},
      {"buffer-size", required_argument, NULL, 's'},
      {"num-buffers", required_argument, NULL, 'n'},
      {"unpacked", no_argument, NULL, 'u'},
      {"no-checksum", no_argument, NULL, 'x'},
      {"checksum", no_argument, NULL, 'X'},
      {"data-address", required_argument, NULL, 'a'},
      {"version", required_argument, NULL, 'v'},
      {"draft", no_argument, NULL, 'd'},
      {"seed", required_argument, NULL, 'e'},
      {"timeout-ms", required_argument, NULL, 't'},
      {"token", required_argument, NULL, 'k'},
      {"tls-ca", required_argument, NULL, 'C'},
      {"tls-cert", required_argument, NULL, 'R'},
      {"tls-key", required_argument, NULL, 'K'},
      {"verify", no_argument, NULL, 'c'},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0},
  };
  int c, li = 0;
  while ((c = getopt_long(argc, argv, "h", longopts, &li)) != -1) {
    int bad = 0;
    switch (c) {
      case 'w': a.workers = optarg; break;
      case 'b': a.backend = optarg; break;
      case 's': bad = parse_size(optarg, &a.buffer) != 0; break;
      case 'n': bad = parse_size(optarg, &a.num_buffers) != 0 ||
                      a.num_buffers < 1 || a.num_buffers > 64; break;
      case 'u': a.unpacked = 1; break;
      case 'x': a.no_checksum = 1; break;
      case 'X': a.no_checksum = 0; break;
      case 'a': a.data_address = optarg; break;
      case 'v': a.version = optarg; break;
      case 'd': a.draft = 1; break;
      case 'e': bad = parse_size(optarg, &a.seed) != 0; break;
      case 't': bad = parse_size(optarg, &a.timeout_ms) != 0 || a.timeout_ms == 0 ||
                      a.timeout_ms > UINT32_MAX; break;
      case 'k': a.token = optarg; break;
      case 'C': a.tls_ca = optarg; break;
      case 'R': a.tls_cert = optarg; break;
      case 'K': a.tls_key = optarg; break;
      case 'c': a.verify = 1; break;
      case 'h': fputs(usage, stdout); return 0;
      default: fputs(usage, stderr); return 2;
    }
    if (bad) {
      fprintf(stderr, "wtx push: --%s: '%s' is not valid\n", longopts[li].name,
              optarg);
      return 2;
    }
  }
  if (a.workers == NULL || optind >= argc) {
    fprintf(stderr, "wtx push: --workers and a SOURCE are required\n%s", usage);
    return 2;
  }
  if (a.verify && a.no_checksum < 0) a.no_checksum = 0; /* --verify needs them */
  init_msgs im = {.ii = WTX__V1__INIT_INFO__INIT, .pk = WTX__V1__PACKING_PARAMS__INIT};
  if (build_init(&a, &im) != 0) return 2;
  wtx_source *src = NULL;
  if (open_source(argc - optind, argv + optind, &a, &src) != 0) return 2;
  wtx_client *cl = NULL;
  char *list = NULL;
  if (make_client(a.workers, &a, &cl, &list) != 0) {
    wtx_source_destroy(src);
    return 2;
  }
  size_t nw = wtx_client_size(cl);
  wtx_trainer_init_info ti = {.rank = 0, .init = &im.ii};
  wtx_trainer *tr = NULL;
  char err[2048] = "";
  int rc = wtx_trainer_init(&ti, cl, src, &tr, err, sizeof err);
  wtx_send_result res;
  memset(&res, 0, sizeof res);
  if (rc != 0) {
    fprintf(stderr, "wtx push: init: %s\n", err);
  } else {
    progress pr = {wtx_clock_s(), isatty(2)};
    wtx_send_options so = WTX_SEND_OPTIONS_INIT;
    so.version = a.version;
    so.target = a.draft ? WTX__V1__UPDATE_TARGET__UPDATE_TARGET_DRAFT : 0;
    so.progress = on_progress;
    so.progress_arg = &pr;
    rc = wtx_trainer_send_weights(tr, &so, &res);
    if (rc != 0) {
      if (pr.tty) fputc('\n', stderr);
      fprintf(stderr, "wtx push: failed: %s\n", wtx_trainer_last_error(tr));
    } else {
      printf("pushed %zu params, %llu bytes to %zu worker(s) over %s in %.2f s "
             "(%.2f GB/s), version %s\n", res.params, (unsigned long long)res.bytes,
             nw, a.backend, res.seconds, res.bytes / res.seconds / 1e9, res.version);
      if (a.verify && res.xxh3 == NULL) {
        fprintf(stderr, "wtx push: --verify needs checksums (drop --no-checksum)\n");
        rc = WTX_EINVAL;
      } else if (a.verify && (rc = wtx_client_verify(cl, src, res.xxh3)) != 0) {
        fprintf(stderr, "wtx push: verify failed: %s\n", wtx_client_last_error(cl));
      } else if (a.verify) {
        printf("verified: %zu checksums equal on %zu worker(s)\n", res.params, nw);
      }
    }
  }
  wtx_trainer_shutdown(tr);
  wtx_client_destroy(cl);
  wtx_source_destroy(src);
  free(list);
  return rc == 0 ? 0 : 1;
}

static int cmd_info(int argc, char **argv) {
  if (argc < 2 || argc > 3 || (argc == 3 && strcmp(argv[2], "--params") != 0)) {
    fputs(usage, stderr);
    return 2;
  }
  wtx_client *cl;
  char *list;
  if (make_client(argv[1], NULL, &cl, &list) != 0) return 2;
  int rc = 0;
  for (size_t i = 0; i < wtx_client_size(cl); i++) {
    Wtx__V1__GetWeightInfoResponse *resp = NULL;
    int e = wtx_client_weight_info(cl, i, argc == 3, &resp);
    if (e != 0) {
      fprintf(stderr, "wtx info: %s\n", wtx_client_last_error(cl));
      rc = e;
      continue;
    }
    const ProtobufCEnumValue *sv = protobuf_c_enum_descriptor_get_value(
        &wtx__v1__session_state__descriptor, resp->state);
    printf("%s: version %s  generation %llu  params %u  bytes %llu  state %s  "
           "backend %s%s\n", wtx_client_target(cl, i),
           resp->weight_version[0] ? resp->weight_version : "(none)",
           (unsigned long long)resp->generation, resp->num_params,
           (unsigned long long)resp->total_bytes, sv ? sv->name : "?",
           resp->backend[0] ? resp->backend : "-", resp->paused ? "  paused" : "");
    for (size_t j = 0; j < resp->n_params; j++)
      printf("  %s  %llu bytes  xxh3 %016llx\n", resp->params[j]->meta->name,
             (unsigned long long)resp->params[j]->nbytes,
             (unsigned long long)resp->params[j]->xxh3_64);
    protobuf_c_message_free_unpacked(&resp->base, NULL);
  }
  wtx_client_destroy(cl);
  free(list);
  return rc == 0 ? 0 : 1;
}

static int cmd_version(int argc, char **argv) {
  if (argc != 3) {
    fputs(usage, stderr);
    return 2;
  }
  wtx_client *cl;
  char *list;
  if (make_client(argv[1], NULL, &cl, &list) != 0) return 2;
  char *prev = NULL;
  int rc = wtx_client_set_version(cl, argv[2], &prev);
  if (rc != 0)
    fprintf(stderr, "wtx version: %s\n", wtx_client_last_error(cl));
  else
    printf("version %s (was %s) on %zu worker(s)\n", argv[2],
           prev && prev[0] ? prev : "(none)", wtx_client_size(cl));
  free(prev);
  wtx_client_destroy(cl);
  free(list);
  return rc == 0 ? 0 : 1;
}

static int cmd_abort(int argc, char **argv) {
  if (argc < 2 || argc > 3) {
    fputs(usage, stderr);
    return 2;
  }
  wtx_client *cl;
  char *list;
  if (make_client(argv[1], NULL, &cl, &list) != 0) return 2;
  /* An operator's abort: the worker's current session, whatever it is. */
  size_t n = wtx_client_size(cl);
  int *aborted = calloc(n, sizeof *aborted);
  int rc = aborted ? wtx_client_abort_any(cl, argc == 3 ? argv[2] : "wtx abort",
                                          aborted) : WTX_ENOMEM;
  if (rc != 0) fprintf(stderr, "wtx abort: %s\n", wtx_client_last_error(cl));
  for (size_t i = 0; aborted != NULL && i < n; i++)
    if (aborted[i] >= 0)
      printf("%s: %s\n", wtx_client_target(cl, i),
             aborted[i] ? "update aborted" : "no update was active");
  free(aborted);
  wtx_client_destroy(cl);
  free(list);
  return rc == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
  if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
    fputs(usage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (strcmp(argv[1], "push") == 0) return cmd_push(argc - 1, argv + 1);
  if (strcmp(argv[1], "info") == 0) return cmd_info(argc - 1, argv + 1);
  if (strcmp(argv[1], "version") == 0) return cmd_version(argc - 1, argv + 1);
  if (strcmp(argv[1], "abort") == 0) return cmd_abort(argc - 1, argv + 1);
  fprintf(stderr, "wtx: unknown command '%s'\n%s", argv[1], usage);
  return 2;
}
