/* The life of a worker binary that brings its own model (the tests' and
 * benchmarks' stand-ins for an inference engine: gpu_model_worker,
 * host_model_worker, bench/loader_worker): SIGTERM and SIGINT blocked
 * before any thread starts, the worker started with o, its port written to
 * port_file (for the test that spawned it), then a wait for either signal
 * and the worker destroyed. Returns the process's exit status: 0, or 1
 * with the reason on stderr after name when it could not start. */
#ifndef WTX_TESTS_COMMON_SERVE_MODEL_H
#define WTX_TESTS_COMMON_SERVE_MODEL_H

#include "wtx/worker.h"

#ifdef __cplusplus
extern "C" {
#endif

int wtxtest_serve_model(const char *name, const wtx_worker_options *o, const char *port_file);
/* The blocking alone, for a binary that starts something else first (a
 * library whose threads must not take the signals). */
void wtxtest_block_stop_signals(void);

#ifdef __cplusplus
}
#endif
#endif /* WTX_TESTS_COMMON_SERVE_MODEL_H */
