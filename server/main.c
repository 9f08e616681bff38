/* wtx-worker: the worker daemon. libuv drives the process: signals
 * (SIGTERM/SIGINT: stop accepting, abort the active update, exit 0) and the
 * session watchdog timer; gRPC calls run on the server's own threads. */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>
#include <uv.h>

#include "common/log.h"
#include "wtx/worker.h"

#define STR_(x) #x
#define STR(x) STR_(x)

static const char usage[] =
    "usage: wtx-worker [options]\n"
    "\n"
    "Receives weight updates from an RL trainer over wtx.v1.WeightTransfer.\n"
    "Every option can also be set by the environment variable in brackets.\n"
    "\n"
    "  --listen HOST:PORT     where to serve gRPC [WTX_LISTEN] (default\n"
    "                         127.0.0.1:50051; port 0 picks a free port)\n"
    "  --world-size N         receiving ranks behind this endpoint, as\n"
    "                         GetWorldSize reports [WTX_WORLD_SIZE] (default 1)\n"
    "  --watchdog-ms MS       abort an update idle this long\n"
    "                         [WTX_WATCHDOG_MS] (default " STR(WTX_DEFAULT_WATCHDOG_MS) ")\n"
    "  --max-message-bytes N  largest gRPC request [WTX_MAX_MESSAGE_BYTES]\n"
    "                         (default 67108864)\n"
    "  --grace-ms MS          on SIGTERM, how long running calls may finish\n"
    "                         [WTX_GRACE_MS] (default " STR(WTX_DEFAULT_GRACE_MS) "); the\n"
    "                         process exits at the latest 1 s after it\n"
    "  --model-spec FILE      a safetensors file whose header declares the\n"
    "                         expected names, dtypes and shapes (data unread)\n"
    "                         [WTX_MODEL_SPEC]; default: the first complete\n"
    "                         update defines the layout\n"
    "  --publish-dir DIR      write every published version to\n"
    "                         DIR/<version>.safetensors (atomic) and name it in\n"
    "                         DIR/LATEST [WTX_PUBLISH_DIR]\n"
    "  --publish-keep N       published files kept [WTX_PUBLISH_KEEP] (default "
    STR(WTX_DEFAULT_PUBLISH_KEEP) ")\n"
    "  --log-level LEVEL      debug, info, warn, error or off [WTX_LOG_LEVEL]\n"
    "                         (default info); logs are logfmt lines on stderr\n"
    "  --port-file FILE       write the bound port to FILE once serving\n"
    "\n"
    "Security (docs/security.md):\n"
    "  --token-file FILE      every call but health needs 'authorization:\n"
    "                         Bearer <first line of FILE>'; the file is re-read\n"
    "                         when it changes [WTX_TOKEN_FILE]\n"
    "  --tls-cert FILE, --tls-key FILE   serve TLS with this certificate and\n"
    "                         key (PEM) [WTX_TLS_CERT, WTX_TLS_KEY]\n"
    "  --tls-client-ca FILE   mutual TLS: admit only clients whose certificate\n"
    "                         this CA signed [WTX_TLS_CLIENT_CA]\n"
    "  --reflection MODE      open (default: anyone), token (as every call) or\n"
    "                         off [WTX_REFLECTION]\n"
    "  --max-model-bytes N, --max-params N   what one update may stage; more\n"
    "                         is RESOURCE_EXHAUSTED [WTX_MAX_MODEL_BYTES,\n"
    "                         WTX_MAX_PARAMS] (default: no limit)\n"
    "  --allow-upstream LIST  networks, addresses or hosts the tcp backend may\n"
    "                         connect to, e.g. 10.0.0.0/8,trainer.ns.svc\n"
    "                         [WTX_ALLOW_UPSTREAM] (default: anywhere)\n"
    "  --max-calls N          calls served at once; more get RESOURCE_EXHAUSTED\n"
    "                         [WTX_MAX_CALLS] (default " STR(WTX_DEFAULT_MAX_CALLS) ")\n"
    "  --relay-port N         tcp backend: the port this worker's relay listens\n"
    "                         on for the next worker [WTX_RELAY_PORT] (default:\n"
    "                         one the system picks)\n"
    "  --metrics-listen H:P   serve GET /metrics (Prometheus text format) there\n"
    "                         [WTX_METRICS_LISTEN] (default: no metrics)\n"
    "\n"
    "Tensor-parallel ranks (docs/data-plane.md, \"Sharded workers\"):\n"
    "  --shard-rules FILE     hold only this rank's parts of the model: one rule\n"
    "                         a line, 'PATTERN whole|skip|expert E|dim D [unit U]'\n"
    "                         [WTX_SHARD_RULES] (default: whole tensors)\n"
    "  --tp-rank N, --tp-size N   this rank's place [WTX_TP_RANK, WTX_TP_SIZE]\n"
    "                         (default 0 of 1)\n"
    "\n"
    "Sidecar bridge into a stock vLLM (docs/vllm.md):\n"
    "  --vllm-url URL         vLLM's HTTP server (started with\n"
    "                         VLLM_SERVER_DEV_MODE=1): every published version is\n"
    "                         written to --vllm-dir and vLLM reloads it\n"
    "                         [WTX_VLLM_URL] (default: no bridge)\n"
    "  --vllm-dir DIR         where versions are written, <version>/model.\n"
    "                         safetensors; share it with vLLM on a memory volume\n"
    "                         [WTX_VLLM_DIR] (default /dev/shm/wtx-vllm)\n"
    "  --vllm-pause-mode M    abort, wait or keep: vLLM's /pause mode while it\n"
    "                         reloads [WTX_VLLM_PAUSE_MODE] (default wait)\n"
    "  --vllm-timeout-ms MS   bound on every request to vLLM\n"
    "                         [WTX_VLLM_TIMEOUT_MS] (default " STR(WTX_DEFAULT_TIMEOUT_MS) ")\n"
    "  --vllm-disk            load through newer vLLM's \"disk\" weight-transfer\n"
    "                         backend and its RL routes instead of /collective_rpc\n"
    "\n"
    "  -h, --help             this text\n"
    "\n"
    "GPU backends (nccl, cuda_ipc) load CUDA and NCCL at run time:\n"
    "  WTX_CUDA_DEVICE        the GPU this worker uses (default 0)\n"
    "  WTX_CUDART_LIB, WTX_NCCL_LIB   paths of libcudart / libnccl (default:\n"
    "                         the system's libcudart.so.13|12, libnccl.so.2)\n"
    "\n"
    "Also served: grpc.health.v1.Health (NOT_SERVING once draining) and\n"
    "server reflection v1 and v1alpha (grpcurl list / describe).\n";

typedef struct daemon {
  wtx_worker *w;
  uv_signal_t sigterm, sigint;
  uv_timer_t watchdog;
  int64_t grace_ms;
} daemon_t;

/* The bound on a drain: every wait the worker owns is cancelled by it, but
 * a call blocked where nothing can cancel it (a host callback, a blocking
 * NCCL rendezvous) would hold the shutdown forever. Past the grace period
 * and one more second the process exits anyway: the published files are
 * written atomically, so --publish-dir stays whole. */
static void *drain_deadline(void *arg) {
  int64_t ms = *(const int64_t *)arg + 1000;
  struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
  while (nanosleep(&ts, &ts) != 0) {
  }
  wtx__log(WTX__LOG_WARN, "event=forced_exit reason=\"calls still running past the grace "
          "period\"");
  _exit(0);
  return NULL;
}

static void on_signal(uv_signal_t *h, int signum) {
  daemon_t *d = h->data;
  wtx__log(WTX__LOG_INFO, "event=signal signal=%d action=drain grace_ms=%lld",
          signum, (long long)d->grace_ms);
  pthread_t t;
  if (pthread_create(&t, NULL, drain_deadline, &d->grace_ms) == 0) pthread_detach(t);
  wtx_worker_drain(d->w, d->grace_ms);
  uv_close((uv_handle_t *)&d->sigterm, NULL);
  uv_close((uv_handle_t *)&d->sigint, NULL);
  uv_close((uv_handle_t *)&d->watchdog, NULL);
}

static void on_watchdog(uv_timer_t *t) {
  daemon_t *d = t->data;
  wtx_worker_watchdog(d->w);
}

static const char *env_or(const char *name, const char *dflt) {
  const char *v = getenv(name);
  return v != NULL && v[0] != '\0' ? v : dflt;
}

static int parse_i64(const char *flag, const char *s, int64_t lo, int64_t hi,
                     int64_t *out) {
  char *end;
  long long v = strtoll(s, &end, 10);
  if (*s == '\0' || *end != '\0' || v < lo || v > hi) {
    fprintf(stderr, "wtx-worker: %s: '%s' is not an integer in %lld..%lld\n",
            flag, s, (long long)lo, (long long)hi);
    return -1;
  }
  *out = v;
  return 0;
}

/* Every flag's value, from the command line, else the environment, else
 * the default. */
typedef struct flags {
  const char *listen, *world, *watchdog, *maxmsg, *grace, *port_file;
  const char *model_spec, *publish_dir, *publish_keep, *log_level;
  const char *token_file, *tls_cert, *tls_key, *tls_client_ca, *reflection;
  const char *max_calls, *max_model_bytes, *max_params, *allow_upstream;
  const char *vllm_url, *vllm_dir, *vllm_pause_mode, *vllm_timeout, *metrics_listen;
  const char *relay_port, *shard_rules, *tp_rank, *tp_size;
  int vllm_disk;
} flags;

_Static_assert(WTX_DEFAULT_MAX_MESSAGE_BYTES == 67108864, "--max-message-bytes default");

static const struct option longopts[] = {
    {"listen", required_argument, NULL, 'l'},
    {"world-size", required_argument, NULL, 'w'},
    {"watchdog-ms", required_argument, NULL, 'd'},
    {"max-message-bytes", required_argument, NULL, 'm'},
    {"grace-ms", required_argument, NULL, 'g'},
    {"port-file", required_argument, NULL, 'p'},
    {"model-spec", required_argument, NULL, 's'},
    {"publish-dir", required_argument, NULL, 'P'},
    {"publish-keep", required_argument, NULL, 'k'},
    {"log-level", required_argument, NULL, 'L'},
    {"token-file", required_argument, NULL, 't'},
    {"tls-cert", required_argument, NULL, 'C'},
    {"tls-key", required_argument, NULL, 'K'},
    {"tls-client-ca", required_argument, NULL, 'A'},
    {"reflection", required_argument, NULL, 'r'},
    {"max-calls", required_argument, NULL, 'c'},
    {"max-model-bytes", required_argument, NULL, 'B'},
    {"max-params", required_argument, NULL, 'N'},
    {"allow-upstream", required_argument, NULL, 'U'},
    {"vllm-url", required_argument, NULL, 'V'},
    {"vllm-dir", required_argument, NULL, 'D'},
    {"vllm-pause-mode", required_argument, NULL, 'M'},
    {"vllm-timeout-ms", required_argument, NULL, 'T'},
    {"vllm-disk", no_argument, NULL, 'X'},
    {"metrics-listen", required_argument, NULL, 'O'},
    {"relay-port", required_argument, NULL, 'R'},
    {"shard-rules", required_argument, NULL, 'S'},
    {"tp-rank", required_argument, NULL, 'Q'},
    {"tp-size", required_argument, NULL, 'Z'},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

/* 0 to go on; otherwise the exit status + 1 (so help's 0 is 1). */
static int parse_flags(int argc, char **argv, flags *f) {
  *f = (flags){
      .listen = env_or("WTX_LISTEN", "127.0.0.1:50051"),
      .world = env_or("WTX_WORLD_SIZE", "1"),
      .watchdog = env_or("WTX_WATCHDOG_MS", STR(WTX_DEFAULT_WATCHDOG_MS)),
      .maxmsg = env_or("WTX_MAX_MESSAGE_BYTES", "67108864"), /* the default */
      .grace = env_or("WTX_GRACE_MS", STR(WTX_DEFAULT_GRACE_MS)),
      .model_spec = env_or("WTX_MODEL_SPEC", NULL),
      .publish_dir = env_or("WTX_PUBLISH_DIR", NULL),
      .publish_keep = env_or("WTX_PUBLISH_KEEP", STR(WTX_DEFAULT_PUBLISH_KEEP)),
      .log_level = env_or("WTX_LOG_LEVEL", "info"),
      .token_file = env_or("WTX_TOKEN_FILE", NULL),
      .tls_cert = env_or("WTX_TLS_CERT", NULL),
      .tls_key = env_or("WTX_TLS_KEY", NULL),
      .tls_client_ca = env_or("WTX_TLS_CLIENT_CA", NULL),
      .reflection = env_or("WTX_REFLECTION", "open"),
      .max_calls = env_or("WTX_MAX_CALLS", STR(WTX_DEFAULT_MAX_CALLS)),
      .max_model_bytes = env_or("WTX_MAX_MODEL_BYTES", "0"),
      .max_params = env_or("WTX_MAX_PARAMS", "0"),
      .allow_upstream = env_or("WTX_ALLOW_UPSTREAM", NULL),
      .vllm_url = env_or("WTX_VLLM_URL", NULL),
      .vllm_dir = env_or("WTX_VLLM_DIR", "/dev/shm/wtx-vllm"),
      .vllm_pause_mode = env_or("WTX_VLLM_PAUSE_MODE", "wait"),
      .vllm_timeout = env_or("WTX_VLLM_TIMEOUT_MS", STR(WTX_DEFAULT_TIMEOUT_MS)),
      .metrics_listen = env_or("WTX_METRICS_LISTEN", NULL),
      .relay_port = env_or("WTX_RELAY_PORT", "0"),
      .shard_rules = env_or("WTX_SHARD_RULES", NULL),
      .tp_rank = env_or("WTX_TP_RANK", "0"),
      .tp_size = env_or("WTX_TP_SIZE", "1"),
  };
  const char **slot[128] = {
      ['l'] = &f->listen, ['w'] = &f->world, ['d'] = &f->watchdog,
      ['m'] = &f->maxmsg, ['g'] = &f->grace, ['p'] = &f->port_file,
      ['s'] = &f->model_spec, ['P'] = &f->publish_dir, ['k'] = &f->publish_keep,
      ['L'] = &f->log_level, ['t'] = &f->token_file, ['C'] = &f->tls_cert,
      ['K'] = &f->tls_key, ['A'] = &f->tls_client_ca, ['r'] = &f->reflection,
      ['c'] = &f->max_calls, ['B'] = &f->max_model_bytes, ['N'] = &f->max_params,
      ['U'] = &f->allow_upstream, ['V'] = &f->vllm_url, ['D'] = &f->vllm_dir,
      ['M'] = &f->vllm_pause_mode, ['T'] = &f->vllm_timeout, ['O'] = &f->metrics_listen,
      ['R'] = &f->relay_port, ['S'] = &f->shard_rules, ['Q'] = &f->tp_rank,
      ['Z'] = &f->tp_size,
  };
  int c;
  while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    if (c == 'h') {
      fputs(usage, stdout);
      return 1;
    }
    if (c == 'X') {
      f->vllm_disk = 1;
      continue;
    }
    if (c < 0 || c >= 128 || slot[c] == NULL) {
      fputs(usage, stderr);
      return 3;
    }
    *slot[c] = optarg;
  }
  if (optind < argc) {
    fprintf(stderr, "wtx-worker: unexpected argument '%s'\n%s", argv[optind], usage);
    return 3;
  }
  return 0;
}

/* The whole of a file named by a flag (a PEM, the shard rules); an
 * unreadable one is an error naming the flag, never a silent fall back to
 * plaintext or whole tensors. An empty one is an error where empty may
 * not be (a PEM). */
static int read_file(const char *flag, const char *path, int may_be_empty, char **out) {
  *out = NULL;
  if (path == NULL) return 0;
  FILE *f = fopen(path, "rb");
  long n = -1;
  if (f != NULL && fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 &&
      fseek(f, 0, SEEK_SET) == 0 && (*out = calloc(1, (size_t)n + 1)) != NULL &&
      fread(*out, 1, (size_t)n, f) != (size_t)n) {
    free(*out);
    *out = NULL;
  }
  if (f != NULL) fclose(f);
  if (*out != NULL && (n > 0 || may_be_empty)) return 0;
  free(*out);
  *out = NULL;
  fprintf(stderr, "wtx-worker: %s: cannot read %s\n", flag, path);
  return -1;
}

static int parse_reflection(const char *s, wtx_reflection *out) {
  static const char *const names[] = {"open", "token", "off"};
  for (int i = 0; i < 3; i++)
    if (strcmp(s, names[i]) == 0) {
      *out = (wtx_reflection)i;
      return 0;
    }
  fprintf(stderr, "wtx-worker: --reflection: '%s' is not open, token or off\n", s);
  return -1;
}

/* The security options: token file, TLS material (read here), reflection,
 * call cap. pems[3] receive the PEMs read (freed by the caller). */
static int security_from_flags(const flags *f, wtx_worker_options *o, char *pems[3]) {
  int64_t max_calls, max_bytes, max_params;
  if (parse_reflection(f->reflection, &o->reflection) != 0 ||
      parse_i64("--max-calls", f->max_calls, 1, 1 << 20, &max_calls) != 0 ||
      parse_i64("--max-model-bytes", f->max_model_bytes, 0, INT64_MAX, &max_bytes) != 0 ||
      parse_i64("--max-params", f->max_params, 0, INT64_MAX, &max_params) != 0 ||
      read_file("--tls-cert", f->tls_cert, 0, &pems[0]) != 0 ||
      read_file("--tls-key", f->tls_key, 0, &pems[1]) != 0 ||
      read_file("--tls-client-ca", f->tls_client_ca, 0, &pems[2]) != 0)
    return -1;
  o->max_calls = (int)max_calls;
  o->max_model_bytes = (uint64_t)max_bytes;
  o->max_params = (uint64_t)max_params;
  o->allow_upstream = f->allow_upstream;
  o->token_file = f->token_file;
  o->tls_cert_pem = pems[0];
  o->tls_key_pem = pems[1];
  o->tls_client_ca_pem = pems[2];
  return 0;
}

/* The sidecar bridge's options (--vllm-*); its directory is made here. */
static int vllm_from_flags(const flags *f, wtx_worker_options *o) {
  if (f->vllm_url == NULL) return 0;
  int64_t timeout;
  if (parse_i64("--vllm-timeout-ms", f->vllm_timeout, 1, INT64_C(1) << 40, &timeout) != 0)
    return -1;
  if (mkdir(f->vllm_dir, 0755) != 0 && errno != EEXIST) {
    fprintf(stderr, "wtx-worker: --vllm-dir: cannot create %s: %s\n", f->vllm_dir,
            strerror(errno));
    return -1;
  }
  o->vllm_url = f->vllm_url;
  o->vllm_dir = f->vllm_dir;
  o->vllm_pause_mode = f->vllm_pause_mode;
  o->vllm_disk = f->vllm_disk;
  o->vllm_timeout_ms = timeout;
  return 0;
}

/* The worker options and grace period the flags say, checked. */
static int options_from_flags(const flags *f, wtx_worker_options *o,
                              int64_t *grace_ms) {
  int level;
  if (wtx__log_parse_level(f->log_level, &level) != 0) {
    fprintf(stderr, "wtx-worker: --log-level: '%s' is not debug, info, warn, "
            "error or off\n", f->log_level);
    return -1;
  }
  wtx__log_set_level(level);
  int64_t world_size, watchdog_ms, max_message, keep;
  if (parse_i64("--world-size", f->world, 1, 1 << 20, &world_size) != 0 ||
      parse_i64("--watchdog-ms", f->watchdog, 1, INT64_C(1) << 40, &watchdog_ms) != 0 ||
      parse_i64("--max-message-bytes", f->maxmsg, 1024, INT32_MAX, &max_message) != 0 ||
      parse_i64("--grace-ms", f->grace, 0, INT64_C(1) << 40, grace_ms) != 0 ||
      parse_i64("--publish-keep", f->publish_keep, 1, 1000000, &keep) != 0)
    return -1;
  o->listen = f->listen;
  o->world_size = (uint32_t)world_size;
  o->watchdog_ms = watchdog_ms;
  o->max_message_bytes = (int)max_message;
  o->model_spec = f->model_spec;
  o->publish_dir = f->publish_dir;
  o->publish_keep = (int)keep;
  o->metrics_listen = f->metrics_listen;
  int64_t relay_port;
  if (parse_i64("--relay-port", f->relay_port, 0, 65535, &relay_port) != 0) return -1;
  o->relay_port = (int)relay_port;
  return vllm_from_flags(f, o);
}

/* A tensor-parallel rank's shard rules (read here; *text freed by the
 * caller) and place. */
static int shard_from_flags(const flags *f, wtx_worker_options *o, char **text) {
  int64_t rank, size;
  if (parse_i64("--tp-rank", f->tp_rank, 0, 1 << 20, &rank) != 0 ||
      parse_i64("--tp-size", f->tp_size, 1, 1 << 20, &size) != 0 ||
      read_file("--shard-rules", f->shard_rules, 1, text) != 0)
    return -1;
  o->shard_rules = *text;
  o->tp_rank = (uint32_t)rank;
  o->tp_size = (uint32_t)size;
  return 0;
}

/* Writes the bound port to path atomically (temp file, rename). */
static int write_port_file(const char *path, int port) {
  char tmp[4096];
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (f == NULL) return -1;
  int bad = fprintf(f, "%d\n", port) < 0;
  bad |= fclose(f) != 0;
  return bad || rename(tmp, path) != 0 ? -1 : 0;
}

/* Takes SIGTERM and SIGINT (and starts the watchdog) before the worker
 * says it serves: a SIGTERM right after --port-file appears, as a
 * rollout may send, drains the worker instead of killing it. A signal
 * that comes before the loop runs waits for it. */
static void arm(daemon_t *d, int64_t watchdog_ms) {
  uv_loop_t *loop = uv_default_loop();
  uv_signal_init(loop, &d->sigterm);
  uv_signal_init(loop, &d->sigint);
  uv_timer_init(loop, &d->watchdog);
  d->sigterm.data = d->sigint.data = d->watchdog.data = d;
  uv_signal_start(&d->sigterm, on_signal, SIGTERM);
  uv_signal_start(&d->sigint, on_signal, SIGINT);
  uint64_t tick = (uint64_t)(watchdog_ms / 4 > 0 ? watchdog_ms / 4 : 1);
  if (tick > 1000) tick = 1000;
  uv_timer_start(&d->watchdog, on_watchdog, tick, tick);
}

/* Runs the libuv loop until a signal drains the worker. */
static void serve(void) {
  uv_loop_t *loop = uv_default_loop();
  uv_run(loop, UV_RUN_DEFAULT);
  uv_loop_close(loop);
}

int main(int argc, char **argv) {
  flags f;
  int st = parse_flags(argc, argv, &f);
  if (st != 0) return st - 1;
  wtx_worker_options opts = WTX_WORKER_OPTIONS_INIT;
  daemon_t d;
  memset(&d, 0, sizeof d);
  char *pems[3] = {NULL, NULL, NULL}, *rules = NULL;
  if (options_from_flags(&f, &opts, &d.grace_ms) != 0 ||
      security_from_flags(&f, &opts, pems) != 0 || shard_from_flags(&f, &opts, &rules) != 0) {
    for (int i = 0; i < 3; i++) free(pems[i]);
    free(rules);
    return 2;
  }
  char err[512] = "";
  int rc = wtx_worker_start(&opts, &d.w, err, sizeof err);
  for (int i = 0; i < 3; i++) free(pems[i]); /* copied or used by start */
  free(rules);
  if (rc != 0) {
    fprintf(stderr, "wtx-worker: %s\n", err);
    return 1;
  }
  wtx__log(WTX__LOG_INFO, "event=serving listen=%s port=%d tls=%s token=%s "
          "reflection=%s", f.listen, wtx_worker_port(d.w),
          f.tls_cert ? (f.tls_client_ca ? "mutual" : "on") : "off",
          f.token_file ? "required" : "none", f.reflection);
  arm(&d, opts.watchdog_ms);
  if (f.port_file != NULL && write_port_file(f.port_file, wtx_worker_port(d.w)) != 0) {
    fprintf(stderr, "wtx-worker: --port-file: cannot write %s\n", f.port_file);
    wtx_worker_destroy(d.w);
    return 1;
  }
  serve();
  wtx_worker_destroy(d.w);
  wtx__log(WTX__LOG_INFO, "event=stopped");
  return 0;
}
