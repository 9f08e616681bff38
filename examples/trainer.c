/* A trainer pushing a safetensors checkpoint to every replica over tcp.
 * Build: cc -std=c17 -Iinclude trainer.c -Lbazel-bin/lib -lwtx
 * Run:   ./a.out 10.0.0.5:50051,10.0.0.6:50051 model.safetensors */
#include <stdio.h>
#include <string.h>

#include "wtx/client.h"

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s HOST:PORT[,HOST:PORT...] MODEL.safetensors...\n", argv[0]);
    return 2;
  }
  char err[1024], list[4096];
  const char *workers[WTX_MAX_WORKERS];  /* every replica of the model */
  size_t n = 0;
  snprintf(list, sizeof list, "%s", argv[1]);
  for (char *w = strtok(list, ","); w != NULL && n < WTX_MAX_WORKERS; w = strtok(NULL, ","))
    workers[n++] = w;

  wtx_client *c = NULL;
  wtx_source *src = NULL;  /* or wtx_source_memory / _synthetic / your own ops */
  wtx_trainer *t = NULL;
  int rc = wtx_client_create(workers, n, NULL, &c, err, sizeof err);
  if (rc == 0)
    rc = wtx_source_safetensors((const char *const *)argv + 2, (size_t)argc - 2, &src,
                                err, sizeof err);

  wtx_trainer_config cfg = WTX_TRAINER_CONFIG_INIT;
  cfg.backend = "tcp";  /* or "shm", "cuda_ipc", "nccl" */
  if (rc == 0) rc = wtx_trainer_init(&cfg, c, src, &t, err, sizeof err);

  wtx_send_options o = WTX_SEND_OPTIONS_INIT;
  o.version = "step-42";
  wtx_send_result r;
  if (rc == 0 && (rc = wtx_trainer_send_weights(t, &o, &r)) != 0)  /* every replica, or none */
    snprintf(err, sizeof err, "%s", wtx_trainer_last_error(t));
  if (rc == 0)
    printf("published %s: %zu params, %llu bytes\n", r.version, r.params,
           (unsigned long long)r.bytes);
  else
    fprintf(stderr, "%s: %s\n", wtx_strerror(rc), err);

  wtx_trainer_shutdown(t);
  wtx_source_destroy(src);
  wtx_client_destroy(c);
  return rc == 0 ? 0 : 1;
}
