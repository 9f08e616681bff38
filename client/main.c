/* wtx: the command line for people. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "client/fsdp.h"
#include "client/on_gpu.h"
#include "common/clock.h"
#include "wtx/client.h"

#define STR_(x) #x
#define STR(x) STR_(x)
/* Bound on --repeat: a benchmark's or a smoke test's handful of syncs. */
#define MAX_REPEAT 1000

static const char usage[] =
    "usage: wtx push --workers HOST:PORT[,...] [options] SOURCE...\n"
    "       wtx info HOST:PORT [--params] [credentials]\n"
    "       wtx version HOST:PORT[,...] NEW_VERSION [credentials]\n"
    "       wtx abort HOST:PORT[,...] [REASON] [credentials]\n"
    "\n"
    "push: one weight sync of SOURCE to every worker (all replicas of a model;\n"
    "never load-balanced). SOURCE is one or more .safetensors files, or\n"
    "synthetic:SIZE for a GPT-style bf16 model of about SIZE bytes (K/M/G).\n"
    "  --backend NAME       data plane: shm (same host), tcp, cuda_ipc (same\n"
    "                       node, GPU) or nccl (GPU) (default shm)\n"
    "  --buffer-size BYTES  transfer buffer (K/M/G suffixes; default: shm 4M\n"
    "                       per worker up to 64M, the other backends 64M)\n"
    "  --num-buffers N      buffers in flight, 1.." STR(WTX_MAX_BUFFERS) " (default: "
    "shm 4, the others " STR(WTX_DEFAULT_NUM_BUFFERS) ")\n"
    "  --unpacked           one tensor per chunk (default: packed)\n"
    "  --no-checksum        skip per-tensor XXH3-64 verification (the default\n"
    "                       on cuda_ipc and nccl; --verify needs checksums)\n"
    "  --checksum           verify per-tensor XXH3-64 (default on shm, tcp)\n"
    "  --data-address H:P   tcp: where the trainer's data port listens\n"
    "                       (default 127.0.0.1:0)\n"
    "  --on-gpu             copy SOURCE to this process's GPU (WTX_CUDA_DEVICE)\n"
    "                       first, as a trainer's parameters are: the GPU\n"
    "                       backends then move device tensors device to device\n"
    "  --direct             cuda_ipc, nccl: land every chunk straight in a\n"
    "                       region the model's size on each worker's GPU (one\n"
    "                       copy per byte; buffers where a worker has no room)\n"
    "  --version LABEL      weight version to publish (default: the workers\n"
    "                       number it)\n"
    "  --draft              update the draft model instead of the main one\n"
    "  --seed N             content of a synthetic model (default 0)\n"
    "  --timeout-ms MS      bound on every call and data-plane step\n"
    "                       (" STR(WTX_DEFAULT_TIMEOUT_MS) ")\n"

    "  --verify             then compare every worker's checksums with ours\n"
    "                       (turns --checksum on)\n"
    "  --delta              send only the tensors whose XXH3-64 differs from\n"
    "                       what every worker serves (asked of the workers;\n"
    "                       then of this trainer's last sync): one hash pass\n"
    "                       over SOURCE; on cuda_ipc and nccl, with --checksum\n"
    "  --patches            --delta, and each changed tensor as a patch of the\n"
    "                       elements that changed where fewer bytes (with\n"
    "                       --repeat: keeps a host copy of the model)\n"
    "  --world N --rank R   many senders (any backend): this process is rank R of N,\n"
    "                       holding only its FSDP part of SOURCE (dim 0 of every\n"
    "                       tensor split over the ranks) and sending it straight\n"
    "                       to the workers; start all N ranks together\n"
    "  --shard-dim D        with --world: split dim D instead (1: a Megatron\n"
    "                       trainer's row-parallel cut; a tensor of no dim D\n"
    "                       splits dim 0)\n"
    "  --rank-addresses A,B,...  the N ranks' data ports, the same on every rank\n"
    "  --session-token T    a secret shared by the N ranks, 16..64 bytes\n"
    "                       (default: $WTX_SESSION_TOKEN)\n"
    "  --repeat N           N syncs, one after the other, from this one trainer\n"
    "                       (its buffers and connections kept, as a training\n"
    "                       loop's are), one summary line each; 1.." STR(MAX_REPEAT) "\n"
    "                       (default 1; not with --version)\n"
    "\n"
    "A progress bar (bytes/s, ETA) is drawn on a terminal; the last line is\n"
    "a summary: bytes, seconds, GB/s, version.\n"
    "\n"
    "credentials (every command):\n"
    "  --token TOKEN        sent as 'authorization: Bearer TOKEN'\n"
    "  --token-file FILE    the token is the first line of FILE\n"
    "                       (default: $WTX_TOKEN when set)\n"
    "  --tls-ca FILE        use TLS, trusting this CA bundle (PEM)\n"
    "  --tls-cert FILE, --tls-key FILE   client certificate (mutual TLS)\n";

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
  double dt = wtx__clock_s() - p->t0;
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

/* How the CLI authenticates to workers. */
typedef struct creds {
  const char *token, *token_file, *tls_ca, *tls_cert, *tls_key;
} creds;

/* One credential option into cr; 0 when c is one, -1 when not. */
static int cred_option(int c, const char *arg, creds *cr) {
  switch (c) {
    case 'k': cr->token = arg; return 0;
    case 'T': cr->token_file = arg; return 0;
    case 'C': cr->tls_ca = arg; return 0;
    case 'R': cr->tls_cert = arg; return 0;
    case 'K': cr->tls_key = arg; return 0;
    default: return -1;
  }
}

#define CRED_LONGOPTS                           \
  {"token", required_argument, NULL, 'k'},      \
  {"token-file", required_argument, NULL, 'T'}, \
  {"tls-ca", required_argument, NULL, 'C'},     \
  {"tls-cert", required_argument, NULL, 'R'},   \
  {"tls-key", required_argument, NULL, 'K'}

typedef struct push_args {
  const char *workers, *version;
  creds cr;
  wtx_trainer_config cfg;
  uint64_t seed;
  int verify, draft, on_gpu;
  unsigned repeat; /* syncs from this one trainer (--repeat; 0: one) */
  char *rank_list;  /* --rank-addresses, split in place into ranks */
  uint32_t shard_dim; /* --shard-dim: the dim each rank's part splits */
  const char *ranks[WTX_MAX_SENDERS];
} push_args;

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

/* --on-gpu: *src becomes a source over device copies of its tensors
 * (*held owns them); the host source stays for the names. */
static int to_gpu(wtx_source **src, wtx_source **host, wtx__on_gpu **held) {
  char err[1024] = "";
  *host = *src;
  int rc = wtx__on_gpu_copy(*host, src, held, err, sizeof err);
  if (rc == 0) return 0;
  *src = *host;
  *host = NULL;
  fprintf(stderr, "wtx push: --on-gpu: %s\n", err[0] ? err : wtx_strerror(rc));
  return -1;
}

/* Reads a PEM file named by a flag into *out; an unreadable one is an
 * error naming the flag, never a silent fall back to plaintext. */
static int read_pem(const char *flag, const char *path, char **out) {
  *out = NULL;
  if (path == NULL) return 0;
  if ((*out = read_file(path)) != NULL) return 0;
  fprintf(stderr, "wtx: %s: cannot read %s\n", flag, path);
  return -1;
}

/* The bearer token: --token, else the first line of --token-file, else
 * $WTX_TOKEN. *buf (malloc'd) holds it when read from a file. */
static int resolve_token(const creds *cr, const char **token, char **buf) {
  *buf = NULL;
  *token = cr->token;
  if (*token == NULL && cr->token_file != NULL) {
    if (read_pem("--token-file", cr->token_file, buf) != 0) return -1;
    (*buf)[strcspn(*buf, "\r\n")] = '\0';
    if ((*buf)[0] == '\0') {
      fprintf(stderr, "wtx: --token-file: %s has no token on its first line\n",
              cr->token_file);
      return -1;
    }
    *token = *buf;
  }
  if (*token == NULL && getenv("WTX_TOKEN") != NULL && getenv("WTX_TOKEN")[0] != '\0')
    *token = getenv("WTX_TOKEN");
  return 0;
}

/* The client for a comma-separated worker list with cr's credentials;
 * timeout_ms 0: the inspection default. */
static int make_client(const char *workers, const creds *cr, int64_t timeout_ms,
                       wtx_client **cl) {
  char *list = strdup(workers);
  const char *targets[WTX_MAX_WORKERS + 1];
  size_t nt = list ? split_list(list, targets, WTX_MAX_WORKERS + 1) : 0;
  wtx_client_options co = WTX_CLIENT_OPTIONS_INIT;
  co.timeout_ms = timeout_ms > 0 ? timeout_ms : 10000;
  co.retries = 2;
  char *ca = NULL, *cert = NULL, *key = NULL, *tok = NULL, err[600] = "";
  int rc = -1;
  if (resolve_token(cr, &co.token, &tok) != 0 || read_pem("--tls-ca", cr->tls_ca, &ca) != 0 ||
      read_pem("--tls-cert", cr->tls_cert, &cert) != 0 ||
      read_pem("--tls-key", cr->tls_key, &key) != 0)
    goto done;
  co.tls_ca_pem = ca;
  co.tls_cert_pem = cert;
  co.tls_key_pem = key;
  /* One past the limit was kept, so too many is an error, never a drop. */
  rc = wtx_client_create(targets, nt, &co, cl, err, sizeof err);
  if (rc != 0) fprintf(stderr, "wtx: --workers '%s': %s\n", workers, err);
done:
  free(ca);
  free(cert);
  free(key);
  free(tok);
  free(list);
  return rc == 0 ? 0 : -1;
}

/* --world: *src becomes this rank's FSDP part of it (*held owns the
 * copies); the full source goes. */
static int to_part(const push_args *a, wtx_source **src, wtx__fsdp **held) {
  char err[1024] = "";
  wtx_source *part = NULL;
  int rc = wtx__fsdp_part(*src, a->cfg.rank, a->cfg.world, a->shard_dim, &part, held, err,
                          sizeof err);
  if (rc != 0) {
    fprintf(stderr, "wtx push: --world: %s\n", err);
    return -1;
  }
  wtx_source_destroy(*src);
  *src = part;
  return 0;
}

static const struct option push_longopts[] = {
    {"workers", required_argument, NULL, 'w'},
    {"backend", required_argument, NULL, 'b'},
    {"buffer-size", required_argument, NULL, 's'},
    {"num-buffers", required_argument, NULL, 'n'},
    {"unpacked", no_argument, NULL, 'u'},
    {"no-checksum", no_argument, NULL, 'x'},
    {"checksum", no_argument, NULL, 'X'},
    {"data-address", required_argument, NULL, 'a'},
    {"direct", no_argument, NULL, 'D'},
    {"on-gpu", no_argument, NULL, 'G'},
    {"version", required_argument, NULL, 'v'},
    {"draft", no_argument, NULL, 'd'},
    {"seed", required_argument, NULL, 'e'},
    {"timeout-ms", required_argument, NULL, 't'},
    {"verify", no_argument, NULL, 'c'},
    {"delta", no_argument, NULL, 'L'},
    {"patches", no_argument, NULL, 'Q'},
    {"repeat", required_argument, NULL, 'r'},
    {"world", required_argument, NULL, 'W'},
    {"shard-dim", required_argument, NULL, 'H'},
    {"rank", required_argument, NULL, 'P'},
    {"rank-addresses", required_argument, NULL, 'A'},
    {"session-token", required_argument, NULL, 'S'},
    CRED_LONGOPTS,
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

/* One option of push into a; 1 when its value is not valid. */
static int push_option(int c, const char *arg, push_args *a) {
  uint64_t v = 0;
  wtx_trainer_config *cfg = &a->cfg;
  switch (c) {
    case 'w': a->workers = arg; return 0;
    case 'b': cfg->backend = arg; return 0;
    case 's': return parse_size(arg, &cfg->buffer_size) != 0;
    case 'n':
      if (parse_size(arg, &v) != 0 || v < 1 || v > WTX_MAX_BUFFERS) return 1;
      cfg->num_buffers = (uint32_t)v;
      return 0;
    case 'u': cfg->unpacked = 1; return 0;
    case 'x': cfg->checksum = WTX_CHECKSUM_NONE; return 0;
    case 'X': cfg->checksum = WTX_CHECKSUM_XXH3_64; return 0;
    case 'a': cfg->data_address = arg; return 0;
    case 'D': cfg->direct = 1; return 0;
    case 'G': a->on_gpu = 1; return 0;
    case 'v': a->version = arg; return 0;
    case 'd': a->draft = 1; return 0;
    case 'e': return parse_size(arg, &a->seed) != 0;
    case 't':
      if (parse_size(arg, &v) != 0 || v == 0 || v > UINT32_MAX) return 1;
      cfg->timeout_ms = (uint32_t)v;
      return 0;
    case 'c': a->verify = 1; return 0;
    case 'L': cfg->delta = cfg->delta ? cfg->delta : WTX_DELTA_TENSORS; return 0;
    case 'Q': cfg->delta = WTX_DELTA_PATCHES; return 0;
    case 'r':
      if (parse_size(arg, &v) != 0 || v < 1 || v > MAX_REPEAT) return 1;
      a->repeat = (unsigned)v;
      return 0;
    case 'W':
    case 'P':
      if (parse_size(arg, &v) != 0 || v >= WTX_MAX_SENDERS) return 1;
      *(c == 'W' ? &cfg->world : &cfg->rank) = (uint32_t)v;
      return 0;
    case 'H':
      if (parse_size(arg, &v) != 0 || v >= WTX_MAX_DIMS) return 1;
      a->shard_dim = (uint32_t)v;
      return 0;
    case 'A': return (a->rank_list = strdup(arg)) == NULL;
    case 'S': cfg->session_token = arg; return 0;
    default: return cred_option(c, arg, &a->cr) != 0;
  }
}

/* --world N: the N rank addresses, and the session token. */
static int parse_ranks(push_args *a) {
  uint32_t n = 0;
  for (char *save = NULL, *p = a->rank_list ? strtok_r(a->rank_list, ",", &save) : NULL;
       p != NULL && n < WTX_MAX_SENDERS; p = strtok_r(NULL, ",", &save))
    a->ranks[n++] = p;
  if (n != a->cfg.world || a->cfg.rank >= n) {
    fprintf(stderr, "wtx push: --world %u needs --rank below it and --rank-addresses "
            "with %u entries (%u given)\n", a->cfg.world, a->cfg.world, n);
    return -1;
  }
  a->cfg.rank_addresses = a->ranks;
  if (a->cfg.session_token == NULL) a->cfg.session_token = getenv("WTX_SESSION_TOKEN");
  return 0;
}

/* Parses push's flags: 0 to go on, else the exit status (help: 0 via -1). */
static int parse_push(int argc, char **argv, push_args *a) {
  int c, li = 0;
  while ((c = getopt_long(argc, argv, "h", push_longopts, &li)) != -1) {
    if (c == 'h') {
      fputs(usage, stdout);
      return -1;
    }
    if (c == '?') {
      fputs(usage, stderr);
      return 2;
    }
    if (push_option(c, optarg, a) != 0) {
      fprintf(stderr, "wtx push: --%s: '%s' is not valid\n", push_longopts[li].name,
              optarg);
      return 2;
    }
  }
  if (a->workers == NULL || optind >= argc) {
    fprintf(stderr, "wtx push: --workers and a SOURCE are required\n%s", usage);
    return 2;
  }
  if (a->version != NULL && a->repeat > 1) {
    fprintf(stderr, "wtx push: --version names one sync; drop it or --repeat\n");
    return 2;
  }
  if (a->cfg.world > 1 && parse_ranks(a) != 0) return 2;
  /* --verify needs checksums: on unless --no-checksum said otherwise. */
  if (a->verify && a->cfg.checksum == WTX_CHECKSUM_DEFAULT)
    a->cfg.checksum = WTX_CHECKSUM_XXH3_64;
  return 0;
}

/* One sync from tr and its summary line (and the comparison, --verify). */
static int push_once(const push_args *a, wtx_trainer *tr, wtx_client *cl,
                     double *seconds) {
  progress pr = {wtx__clock_s(), isatty(2)};
  wtx_send_options so = WTX_SEND_OPTIONS_INIT;
  so.version = a->version;
  so.target = a->draft ? WTX_TARGET_DRAFT : WTX_TARGET_MAIN;
  so.progress = on_progress;
  so.progress_arg = &pr;
  wtx_send_result res;
  size_t nw = wtx_client_size(cl);
  int rc = wtx_trainer_send_weights(tr, &so, &res);
  if (rc != 0) {
    if (pr.tty) fputc('\n', stderr);
    fprintf(stderr, "wtx push: failed: %s\n", wtx_trainer_last_error(tr));
    return rc;
  }
  *seconds = res.seconds;
  printf("pushed %zu params, %llu bytes to %zu worker(s) over %s%s in %.4g s "
         "(%.2f GB/s), %llu control bytes, version %s\n", res.params,
         (unsigned long long)res.bytes, nw, a->cfg.backend, res.direct ? " (direct)" : "",
         res.seconds, res.bytes / res.seconds / 1e9, (unsigned long long)res.control_bytes,
         res.version);
  if (res.delta)
    printf("delta: %zu params, %llu bytes unchanged on every worker, not sent; %zu params "
           "sent as patches (%llu bytes whole)\n", res.skipped_params,
           (unsigned long long)res.skipped_bytes, res.patched_params,
           (unsigned long long)res.patched_whole_bytes);
  else if (res.full_reason != NULL)
    printf("whole model sent: %s\n", res.full_reason);
  fflush(stdout);
  if (a->verify && (rc = wtx_trainer_verify(tr)) == WTX_ESTATE) {
    fprintf(stderr, "wtx push: --verify needs checksums (drop --no-checksum)\n");
    rc = WTX_EINVAL;
  } else if (a->verify && rc != 0) {
    fprintf(stderr, "wtx push: verify failed: %s\n", wtx_trainer_last_error(tr));
  } else if (a->verify) {
    printf("verified: %zu checksums equal on %zu worker(s)\n",
           res.params + res.skipped_params, nw);
  }
  return rc;
}

/* CPU seconds of this process so far, every thread's. */
static double cpu_s(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
         (ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
}

static int cmp_double(const void *x, const void *y) {
  double a = *(const double *)x, b = *(const double *)y;
  return (a > b) - (a < b);
}

/* --repeat: syncs 2..N of one trainer, its steady state (sorts s). */
static void steady_line(double *s, unsigned n, double cpu_per_sync) {
  qsort(s, n, sizeof *s, cmp_double);
  printf("syncs 2-%u of this trainer: best %.4g s, median %.4g s; its CPU %.4g s per sync\n",
         n + 1, s[0], n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2, cpu_per_sync);
}

/* --repeat syncs (at least one) from one trainer; stops at the first failure. */
static int push_sync(const push_args *a, wtx_client *cl, wtx_source *src) {
  wtx_trainer *tr = NULL;
  char err[2048] = "";
  int rc = wtx_trainer_init(&a->cfg, cl, src, &tr, err, sizeof err);
  if (rc != 0) {
    fprintf(stderr, "wtx push: init: %s\n", err);
    return rc;
  }
  unsigned n = a->repeat ? a->repeat : 1;
  double *s = calloc(n, sizeof *s), cpu0 = 0;
  if (s == NULL) rc = WTX_ENOMEM;
  for (unsigned i = 0; rc == 0 && i < n; i++) {
    if (i == 1) cpu0 = cpu_s();
    rc = push_once(a, tr, cl, &s[i]);
  }
  if (rc == 0 && n > 1) steady_line(s + 1, n - 1, (cpu_s() - cpu0) / (n - 1));
  free(s);
  wtx_trainer_shutdown(tr);
  return rc;
}

static int cmd_push(int argc, char **argv) {
  push_args a = {.cfg = WTX_TRAINER_CONFIG_INIT};
  a.cfg.backend = "shm";
  a.cfg.timeout_ms = WTX_DEFAULT_TIMEOUT_MS;
  int st = parse_push(argc, argv, &a);
  if (st != 0) return st < 0 ? 0 : st;
  wtx_source *src = NULL, *host = NULL;
  wtx__on_gpu *held = NULL;
  wtx_client *cl = NULL;
  int rc = 2;
  wtx__fsdp *part = NULL;
  if (open_source(argc - optind, argv + optind, &a, &src) != 0) return 2;
  if (a.cfg.world > 1 && to_part(&a, &src, &part) != 0) goto done;
  if ((!a.on_gpu || to_gpu(&src, &host, &held) == 0) &&
      make_client(a.workers, &a.cr, a.cfg.timeout_ms, &cl) == 0)
    rc = push_sync(&a, cl, src) == 0 ? 0 : 1;
done:
  wtx_client_destroy(cl);
  wtx_source_destroy(src);
  wtx__fsdp_free(part);
  free(a.rank_list);
  wtx__on_gpu_free(held);
  wtx_source_destroy(host);
  return rc;
}

/* The options of info, version and abort: credentials (and info's
 * --params); the positional arguments are left in argv[optind..]. 0 to go
 * on, else the exit status. */
static int parse_common(int argc, char **argv, creds *cr, int *params) {
  static const struct option longopts[] = {
      {"params", no_argument, NULL, 'p'}, {"help", no_argument, NULL, 'h'},
      CRED_LONGOPTS, {NULL, 0, NULL, 0}};
  int c;
  optind = 1;
  while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    if (c == 'p' && params != NULL) {
      *params = 1;
    } else if (c == 'h') {
      fputs(usage, stdout);
      return -1;
    } else if (cred_option(c, optarg, cr) != 0) {
      fputs(usage, stderr);
      return 2;
    }
  }
  return 0;
}

static void print_info(const char *target, const wtx_weight_info *info) {
  printf("%s: version %s  generation %llu  params %zu  bytes %llu  state "
         "SESSION_STATE_%s  backend %s%s\n", target,
         info->version[0] ? info->version : "(none)",
         (unsigned long long)info->generation, info->num_params,
         (unsigned long long)info->total_bytes, wtx_session_state_name(info->state),
         info->backend[0] ? info->backend : "-", info->paused ? "  paused" : "");
  if (info->tp_size > 0)
    printf("  tensor-parallel rank %u of %u, %zu shard rule(s): holds only its parts\n",
           info->tp_rank, info->tp_size, info->n_shard_rules);
  for (size_t j = 0; j < info->n_params; j++) {
    const wtx_param_info *p = &info->params[j];
    char sum[24] = "-";
    if (p->has_xxh3) snprintf(sum, sizeof sum, "%016llx", (unsigned long long)p->xxh3);
    printf("  %s  %llu bytes  xxh3 %s\n", p->meta.name, (unsigned long long)p->meta.nbytes,
           sum);
  }
}

static int cmd_info(int argc, char **argv) {
  creds cr = {0};
  int params = 0, st = parse_common(argc, argv, &cr, &params);
  if (st != 0) return st < 0 ? 0 : st;
  if (argc - optind != 1) {
    fputs(usage, stderr);
    return 2;
  }
  wtx_client *cl;
  if (make_client(argv[optind], &cr, 0, &cl) != 0) return 2;
  int rc = 0;
  for (size_t i = 0; i < wtx_client_size(cl); i++) {
    wtx_weight_info info;
    int e = wtx_client_weight_info(cl, i, params, &info);
    if (e != 0) {
      fprintf(stderr, "wtx info: %s\n", wtx_client_last_error(cl));
      rc = e;
    } else {
      print_info(wtx_client_target(cl, i), &info);
    }
    wtx_weight_info_free(&info);
  }
  wtx_client_destroy(cl);
  return rc == 0 ? 0 : 1;
}

static int cmd_version(int argc, char **argv) {
  creds cr = {0};
  int st = parse_common(argc, argv, &cr, NULL);
  if (st != 0) return st < 0 ? 0 : st;
  if (argc - optind != 2) {
    fputs(usage, stderr);
    return 2;
  }
  wtx_client *cl;
  if (make_client(argv[optind], &cr, 0, &cl) != 0) return 2;
  char prev[WTX_MAX_VERSION_BYTES + 1];
  int rc = wtx_client_set_version(cl, argv[optind + 1], prev, sizeof prev);
  if (rc != 0)
    fprintf(stderr, "wtx version: %s\n", wtx_client_last_error(cl));
  else
    printf("version %s (was %s) on %zu worker(s)\n", argv[optind + 1],
           prev[0] ? prev : "(none)", wtx_client_size(cl));
  wtx_client_destroy(cl);
  return rc == 0 ? 0 : 1;
}

static int cmd_abort(int argc, char **argv) {
  creds cr = {0};
  int st = parse_common(argc, argv, &cr, NULL);
  if (st != 0) return st < 0 ? 0 : st;
  if (argc - optind < 1 || argc - optind > 2) {
    fputs(usage, stderr);
    return 2;
  }
  wtx_client *cl;
  if (make_client(argv[optind], &cr, 0, &cl) != 0) return 2;
  /* An operator's abort: the worker's current session, whatever it is. */
  size_t n = wtx_client_size(cl);
  int *aborted = calloc(n, sizeof *aborted);
  const char *reason = argc - optind == 2 ? argv[optind + 1] : "wtx abort";
  int rc = aborted ? wtx_client_abort_any(cl, reason, aborted) : WTX_ENOMEM;
  if (rc != 0) fprintf(stderr, "wtx abort: %s\n", wtx_client_last_error(cl));
  for (size_t i = 0; aborted != NULL && i < n; i++)
    if (aborted[i] >= 0)
      printf("%s: %s\n", wtx_client_target(cl, i),
             aborted[i] ? "update aborted" : "no update was active");
  free(aborted);
  wtx_client_destroy(cl);
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
