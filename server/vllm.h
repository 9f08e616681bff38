/* The sidecar bridge into a stock vLLM server (wtx-worker --vllm-url): each
 * published version of the main weights is written as a directory vLLM's
 * loader reads, DIR/<version>/model.safetensors, and vLLM is told to load
 * it over its HTTP routes (served with VLLM_SERVER_DEV_MODE=1):
 *   POST /pause?mode=M, POST /collective_rpc {"method": "reload_weights",
 *   "kwargs": {"weights_path": "DIR/<version>"}}, POST
 *   /update_weight_version, POST /resume (resume also after a failure;
 *   never while the trainer's Pause holds it).
 * The trainer's Pause and Resume become POST /pause and /resume, and GET
 * /is_paused when those fail.
 * With disk set (newer vLLM's "disk" weight-transfer backend) the load goes
 * through the RL routes instead: /start_weight_update, /update_weights
 * {"update_info": {"weights_path": ...}}, /finish_weight_update. HTTP is
 * libcurl's; every request is bounded by timeout_ms. Internal to server/. */
#ifndef WTX_SERVER_VLLM_H
#define WTX_SERVER_VLLM_H

#include <stddef.h>
#include <stdint.h>

#include "wtx/worker.h"

typedef struct wtx__vllm wtx__vllm;

typedef struct wtx__vllm_config {
  const char *url;        /* "http://127.0.0.1:8000" */
  const char *dir;        /* where versions are written (a memory volume) */
  const char *pause_mode; /* "abort", "wait" or "keep" */
  int disk;
  int64_t timeout_ms;
  int keep;               /* version directories kept, newest first */
} wtx__vllm_config;

/* WTX_EINVAL (err says which setting) for a bad url, mode or dir. store
 * must outlive the bridge. */
int wtx__vllm_create(wtx_store *store, const wtx__vllm_config *cfg, wtx__vllm **out,
                     char *err, size_t errlen);
void wtx__vllm_destroy(wtx__vllm *b);
/* Writes the published main version and has vLLM load it. On failure err
 * says which step and what vLLM answered: WTX_EUNAVAIL (unreachable),
 * WTX_ETIMEDOUT, WTX_EABORTED (vLLM refused) or WTX_EIO (the directory). */
int wtx__vllm_publish(wtx__vllm *b, char *err, size_t errlen);
/* Forward the trainer's Pause / Resume and answer whether vLLM is paused
 * now (1 or 0): after /pause or /resume answered 2xx, what that asked for;
 * after vLLM refused, what its GET /is_paused says; when neither answers
 * (down, or too slow for timeout_ms), was, the state before the call. A
 * failure is logged. */
int wtx__vllm_pause(wtx__vllm *b, int wait_for_inflight, int was);
int wtx__vllm_resume(wtx__vllm *b, int was);
/* The version vLLM says it serves (GET /weight_info) into out; 0 or the
 * error. */
int wtx__vllm_serving(wtx__vllm *b, char *out, size_t len);

#endif /* WTX_SERVER_VLLM_H */
