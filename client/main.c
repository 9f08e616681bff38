/* wtx: the command line for people. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "client/client.h"
#include "wtx/v1/weight_transfer.grpc-c.h"

static const char usage[] =
    "usage: wtx push --workers HOST:PORT[,...] [--backend shm] [options] synthetic:SIZE\n"
    "       wtx info HOST:PORT\n"
    "\n"
    "push options:\n"
    "  --buffer-size BYTES  transfer buffer (default 64M; K/M/G suffixes)\n"
    "  --version LABEL      weight version to publish (default: worker numbers it)\n"
    "  --seed N             content of the synthetic tensors (default 0)\n"
    "  --verify             compare every worker's checksums with the trainer's\n"
    "\n"
    "SIZE: bytes of a GPT-style bf16 synthetic model, e.g. synthetic:1G\n";

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

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

typedef struct progress {
  double t0;
  int tty;
} progress;

static void on_progress(void *arg, uint64_t done, uint64_t total) {
  progress *p = arg;
  if (!p->tty) return;
  double dt = now_s() - p->t0;
  double rate = dt > 0 ? done / dt : 0;
  double eta = rate > 0 ? (total - done) / rate : 0;
  fprintf(stderr, "\r%6.1f%%  %8.1f MB  %8.1f MB/s  ETA %5.1fs", 100.0 * done / total,
          done / 1e6, rate / 1e6, eta);
  if (done == total) fputc('\n', stderr);
}

static int cmd_push(int argc, char **argv) {
  const char *workers = NULL, *backend = "shm", *version = NULL;
  uint64_t buffer = 0, seed = 0;
  int verify = 0;
  static const struct option longopts[] = {
      {"workers", required_argument, NULL, 'w'},
      {"backend", required_argument, NULL, 'b'},
      {"buffer-size", required_argument, NULL, 's'},
      {"version", required_argument, NULL, 'v'},
      {"seed", required_argument, NULL, 'e'},
      {"verify", no_argument, NULL, 'c'},
      {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0},
  };
  int c;
  while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    switch (c) {
      case 'w': workers = optarg; break;
      case 'b': backend = optarg; break;
      case 's':
        if (parse_size(optarg, &buffer) != 0) {
          fprintf(stderr, "wtx push: --buffer-size: '%s' is not a size\n", optarg);
          return 2;
        }
        break;
      case 'v': version = optarg; break;
      case 'e': seed = strtoull(optarg, NULL, 10); break;
      case 'c': verify = 1; break;
      case 'h': fputs(usage, stdout); return 0;
      default: fputs(usage, stderr); return 2;
    }
  }
  if (workers == NULL || optind != argc - 1) {
    fputs(usage, stderr);
    return 2;
  }
  if (strcmp(backend, "shm") != 0) {
    fprintf(stderr, "wtx push: --backend %s: not built yet; available: shm\n", backend);
    return 2;
  }
  uint64_t size;
  const char *src = argv[optind];
  if (strncmp(src, "synthetic:", 10) != 0 || parse_size(src + 10, &size) != 0) {
    fprintf(stderr, "wtx push: source '%s': expected synthetic:SIZE\n", src);
    return 2;
  }
  char *list = strdup(workers);
  const char *targets[256];
  size_t nt = 0;
  for (char *t = strtok(list, ","); t != NULL && nt < 256; t = strtok(NULL, ","))
    targets[nt++] = t;
  wtx_client *cl;
  int rc = wtx_client_create(targets, nt, &cl);
  if (rc != 0) {
    fprintf(stderr, "wtx push: %s\n", wtx_strerror(rc));
    free(list);
    return 1;
  }
  wtx_synth_param *params;
  size_t n;
  wtx_synth_layout(size, &params, &n);
  uint64_t total = 0;
  for (size_t i = 0; i < n; i++) total += params[i].nbytes;
  progress pr = {now_s(), isatty(2)};
  wtx_push_options po = WTX_PUSH_OPTIONS_INIT;
  po.buffer_size = buffer;
  po.version = version;
  po.seed = seed;
  po.progress = on_progress;
  po.progress_arg = &pr;
  rc = wtx_client_push_shm(cl, params, n, &po);
  double dt = now_s() - pr.t0;
  if (rc != 0) {
    fprintf(stderr, "wtx push: failed: %s\n", wtx_client_last_error(cl));
  } else {
    printf("pushed %zu params, %llu bytes to %zu worker(s) in %.2f s (%.2f GB/s), version %s\n",
           n, (unsigned long long)total, nt, dt, total / dt / 1e9,
           version ? version : "(numbered by the workers)");
    if (verify) {
      rc = wtx_client_verify(cl, params, n);
      if (rc != 0)
        fprintf(stderr, "wtx push: verify failed: %s\n", wtx_client_last_error(cl));
      else
        printf("verified: %zu checksums equal on %zu worker(s)\n", n, nt);
    }
  }
  free(params);
  wtx_client_destroy(cl);
  free(list);
  return rc == 0 ? 0 : 1;
}

static int cmd_info(int argc, char **argv) {
  if (argc != 2) {
    fputs(usage, stderr);
    return 2;
  }
  wtx_rpc_channel *ch;
  if (wtx_rpc_channel_create(argv[1], NULL, &ch) != 0) return 1;
  Wtx__V1__GetWeightInfoRequest req = WTX__V1__GET_WEIGHT_INFO_REQUEST__INIT;
  Wtx__V1__GetWeightInfoResponse *resp = NULL;
  wtx_rpc_status st;
  wtx_rpc_call_options o = WTX_RPC_CALL_OPTIONS_INIT;
  o.timeout_ms = 10000;
  int rc = wtx__v1__weight_transfer__get_weight_info__call(ch, &req, &resp, &o, &st);
  if (rc != 0) {
    fprintf(stderr, "wtx info: %s: %s\n", wtx_rpc_code_name(st.code), st.message);
  } else {
    const ProtobufCEnumValue *sv = protobuf_c_enum_descriptor_get_value(
        &wtx__v1__session_state__descriptor, resp->state);
    printf("version %s  generation %llu  params %u  bytes %llu  state %s  backend %s%s\n",
           resp->weight_version[0] ? resp->weight_version : "(none)",
           (unsigned long long)resp->generation, resp->num_params,
           (unsigned long long)resp->total_bytes, sv ? sv->name : "?",
           resp->backend[0] ? resp->backend : "-", resp->paused ? "  paused" : "");
    protobuf_c_message_free_unpacked(&resp->base, NULL);
  }
  wtx_rpc_channel_destroy(ch);
  return rc == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
  if (argc < 2 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
    fputs(usage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (strcmp(argv[1], "push") == 0) return cmd_push(argc - 1, argv + 1);
  if (strcmp(argv[1], "info") == 0) return cmd_info(argc - 1, argv + 1);
  fprintf(stderr, "wtx: unknown command '%s'\n%s", argv[1], usage);
  return 2;
}
