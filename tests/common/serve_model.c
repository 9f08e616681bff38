/* A worker binary's life around its own model (serve_model.h). */
#include "tests/common/serve_model.h"

#include <signal.h>
#include <stdio.h>

static void stop_signals(sigset_t *set) {
  sigemptyset(set);
  sigaddset(set, SIGTERM);
  sigaddset(set, SIGINT);
}

void wtxtest_block_stop_signals(void) {
  sigset_t set;
  stop_signals(&set);
  pthread_sigmask(SIG_BLOCK, &set, NULL);
}

int wtxtest_serve_model(const char *name, const wtx_worker_options *o, const char *port_file) {
  sigset_t set;
  stop_signals(&set);
  pthread_sigmask(SIG_BLOCK, &set, NULL); /* before any thread starts */
  char err[1024] = "";
  wtx_worker *w = NULL;
  int rc = wtx_worker_start(o, &w, err, sizeof err);
  FILE *f = rc == 0 ? fopen(port_file, "w") : NULL;
  if (rc == 0 && (f == NULL || fprintf(f, "%d\n", wtx_worker_port(w)) < 0)) rc = WTX_EIO;
  if (f != NULL && fclose(f) != 0 && rc == 0) rc = WTX_EIO;
  if (rc != 0) {
    fprintf(stderr, "%s: %s\n", name, err[0] ? err : wtx_strerror(rc));
    wtx_worker_destroy(w);
    return 1;
  }
  int sig;
  sigwait(&set, &sig);
  wtx_worker_destroy(w);
  return 0;
}
