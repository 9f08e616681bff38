/* The WorkerEngine session: wtx.v1.WeightTransfer's state machine, enforced
 * here and nowhere else. Long data-plane receives run outside the lock, so
 * inspection calls are answered during an update. */
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"
#include "server/internal.h"

static void new_session_id(char out[33]) {
  uint8_t r[16];
  int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
  if (fd < 0 || read(fd, r, sizeof r) != (ssize_t)sizeof r) {
    uint64_t t = (uint64_t)wtx_clock_ms() ^ (uint64_t)getpid() << 32;
    memcpy(r, &t, 8);
    memcpy(r + 8, &t, 8);
  }
  if (fd >= 0) close(fd);
  for (int i = 0; i < 16; i++) snprintf(out + 2 * i, 3, "%02x", r[i]);
}

/* Discards the active update. Caller holds mu. */
static void abort_locked(wtx_session *s, const char *why) {
  if (s->state != WTX__V1__SESSION_STATE__SESSION_STATE_UPDATING) return;
  s->model_ops->abort(s->model);
  if (s->transport != NULL && s->transport->reset != NULL)
    s->transport->reset(s->engine);
  wtx__rx_reset(s->rx);
  s->abort_requested = 0;
  s->state = s->draining ? WTX__V1__SESSION_STATE__SESSION_STATE_DRAINING
                         : WTX__V1__SESSION_STATE__SESSION_STATE_READY;
  s->staged_params = 0;
  s->staged_bytes = 0;
  wtx__names_clear(&s->names);
  char q[512];
  wtx_log(WTX_LOG_WARN, "event=aborted update=%llu reason=%s",
          (unsigned long long)s->update_id, wtx_log_quote(why, q, sizeof q));
}

int wtx__session_init(wtx_session *s, const wtx_model_ops *ops, void *model,
                      uint32_t world_size, int64_t watchdog_ms) {
  memset(s, 0, sizeof *s);
  pthread_mutex_init(&s->mu, NULL);
  s->model_ops = ops;
  s->model = model;
  s->world_size = world_size ? world_size : 1;
  s->watchdog_ms = watchdog_ms > 0 ? watchdog_ms : 600000;
  s->state = WTX__V1__SESSION_STATE__SESSION_STATE_UNINITIALIZED;
  return wtx__rx_create(&s->rx);
}

void wtx__session_destroy(wtx_session *s) {
  pthread_mutex_lock(&s->mu);
  abort_locked(s, "worker shutting down");
  if (s->engine != NULL) s->transport->destroy(s->engine);
  s->engine = NULL;
  pthread_mutex_unlock(&s->mu);
  wtx__rx_destroy(s->rx);
  wtx__names_clear(&s->names);
  free(s->names.slots);
  pthread_mutex_destroy(&s->mu);
}

int wtx__session_watchdog(wtx_session *s) {
  int fired = 0;
  pthread_mutex_lock(&s->mu);
  if (s->state == WTX__V1__SESSION_STATE__SESSION_STATE_UPDATING &&
      !s->receiving && wtx_clock_ms() - s->last_activity_ms > s->watchdog_ms) {
    abort_locked(s, "watchdog: no call from the trainer within the timeout");
    fired = 1;
  }
  pthread_mutex_unlock(&s->mu);
  return fired;
}

void wtx__session_drain(wtx_session *s) {
  pthread_mutex_lock(&s->mu);
  s->draining = 1;
  /* A running receive keeps the update UPDATING until it returns; the
   * update is then aborted and the state lands on DRAINING. */
  if (s->receiving) {
    s->abort_requested = 1;
  } else {
    abort_locked(s, "worker draining");
    s->state = WTX__V1__SESSION_STATE__SESSION_STATE_DRAINING;
  }
  pthread_mutex_unlock(&s->mu);
}

/* Session id and state checks shared by the per-update calls. Caller holds
 * mu. */
static grpc_status_code check_session(wtx_session *s, wtx_rpc_ctx *ctx,
                                      const char *session_id) {
  if (s->draining)
    return wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_UNAVAILABLE,
                              "worker is draining");
  if (s->state == WTX__V1__SESSION_STATE__SESSION_STATE_UNINITIALIZED)
    return wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "no transfer engine: call "
                              "InitWeightTransferEngine first");
  if (strcmp(session_id, s->session_id) != 0)
    return wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_NOT_FOUND,
                              "session_id: '%s' is not the current session",
                              session_id);
  return GRPC_STATUS_OK;
}

static grpc_status_code check_update(wtx_session *s, wtx_rpc_ctx *ctx,
                                     const char *session_id, uint64_t update_id,
                                     const char *call) {
  grpc_status_code c = check_session(s, ctx, session_id);
  if (c != GRPC_STATUS_OK) return c;
  if (s->state != WTX__V1__SESSION_STATE__SESSION_STATE_UPDATING)
    return wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "%s without an active update: call "
                              "StartWeightUpdate first",
                              call);
  if (update_id != s->update_id)
    return wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_NOT_FOUND,
                              "update_id: %llu is not the active update (%llu)",
                              (unsigned long long)update_id,
                              (unsigned long long)s->update_id);
  return GRPC_STATUS_OK;
}

static grpc_status_code from_wtx(wtx_rpc_ctx *ctx, int rc, const char *what,
                                 const char *detail) {
  return wtx_rpc_ctx_errorf(ctx, (grpc_status_code)wtx_err_to_grpc(rc),
                            "%s: %s", what, detail[0] ? detail : wtx_strerror(rc));
}

grpc_status_code wtx__handle_init(wtx_rpc_ctx *ctx,
    const Wtx__V1__InitWeightTransferEngineRequest *req, Wtx__V1__InitWeightTransferEngineResponse *resp) {
  wtx_session *s = wtx__session_of(ctx);
  char err[512] = "";
  if (req->init_info == NULL)
    return wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                              "init_info: missing");
  const char *name = wtx_init_backend_name(req->init_info);
  const wtx_worker_transport *t = name ? wtx_worker_transport_find(name) : NULL;
  if (t == NULL) {
    /* No backend set (or one this worker's schema does not know, which
     * decodes as none), or one not registered here. */
    char names[256];
    wtx_worker_transport_names(names, sizeof names);
    return wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                              "init_info.backend: %s%s%s; registered: %s",
                              name ? "'" : "no backend set",
                              name ? name : "",
                              name ? "' is not available in this worker" : "",
                              names);
  }
  wtx_wire_params wire;
  int rc = wtx_wire_params_from_init(req->init_info, &wire, err, sizeof err);
  if (rc != 0)
    return wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT, "init_info.%s: %s",
                              name, err);
  pthread_mutex_lock(&s->mu);
  grpc_status_code code = GRPC_STATUS_OK;
  if (s->draining) {
    code = wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_UNAVAILABLE, "worker is draining");
  } else if (s->state == WTX__V1__SESSION_STATE__SESSION_STATE_UPDATING) {
    code = wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "update %llu is active: finish or abort it before "
                              "re-initializing",
                              (unsigned long long)s->update_id);
  } else {
    void *engine = NULL;
    char addr[256] = "";
    rc = t->init(req->init_info, &wire, &engine, addr, sizeof addr, err,
                 sizeof err);
    if (rc != 0) {
      code = from_wtx(ctx, rc, "init_info", err);
    } else {
      if (s->engine != NULL) s->transport->destroy(s->engine);
      s->engine = engine;
      s->transport = t;
      s->wire = wire;
      new_session_id(s->session_id);
      s->state = WTX__V1__SESSION_STATE__SESSION_STATE_READY;
      resp->session_id = wtx_rpc_ctx_strdup(ctx, s->session_id);
      resp->backend = (char *)t->name;
      resp->data_address = wtx_rpc_ctx_strdup(ctx, addr);
      resp->world_size = s->world_size;
      wtx_log(WTX_LOG_INFO, "event=init backend=%s session=%s buffer_size=%llu "
              "num_buffers=%u timeout_ms=%lld", t->name, s->session_id,
              (unsigned long long)wire.buffer_size, (unsigned)wire.num_buffers,
              (long long)wire.timeout_ms);
    }
  }
  pthread_mutex_unlock(&s->mu);
  return code;
}

grpc_status_code wtx__handle_start(wtx_rpc_ctx *ctx,
    const Wtx__V1__StartWeightUpdateRequest *req, Wtx__V1__StartWeightUpdateResponse *resp) {
  wtx_session *s = wtx__session_of(ctx);
  int target;
  switch (req->target) {
    case WTX__V1__UPDATE_TARGET__UPDATE_TARGET_UNSPECIFIED:
    case WTX__V1__UPDATE_TARGET__UPDATE_TARGET_MAIN:
      target = WTX_TARGET_MAIN;
      break;
    case WTX__V1__UPDATE_TARGET__UPDATE_TARGET_DRAFT:
      target = WTX_TARGET_DRAFT;
      break;
    default:
      return wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                                "target: unknown value %d", req->target);
  }
  pthread_mutex_lock(&s->mu);
  grpc_status_code code = check_session(s, ctx, req->session_id);
  if (code != GRPC_STATUS_OK) {
  } else if (s->state == WTX__V1__SESSION_STATE__SESSION_STATE_UPDATING) {
    code = wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "update %llu is already active: finish or abort "
                              "it first",
                              (unsigned long long)s->update_id);
  } else if (target == WTX_TARGET_DRAFT && !s->transport->supports_draft) {
    code = wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "target: the %s engine does not support draft "
                              "model updates",
                              s->transport->name);
  } else {
    int rc = s->model_ops->begin(s->model, target);
    if (rc != 0) {
      code = from_wtx(ctx, rc, "model", "cannot begin an update");
    } else {
      s->update_id++;
      s->target = target;
      s->state = WTX__V1__SESSION_STATE__SESSION_STATE_UPDATING;
      s->staged_params = 0;
      s->staged_bytes = 0;
      wtx__names_clear(&s->names);
      wtx__rx_reset(s->rx);
      s->last_activity_ms = wtx_clock_ms();
      resp->update_id = s->update_id;
      wtx_log(WTX_LOG_INFO, "event=start update=%llu target=%s",
              (unsigned long long)s->update_id,
              target == WTX_TARGET_DRAFT ? "draft" : "main");
    }
  }
  pthread_mutex_unlock(&s->mu);
  return code;
}

/* Validates one ParamMeta into meta (no byte has moved yet). */
static int check_meta(wtx_session *s, const Wtx__V1__ParamMeta *pm, size_t i,
                      wtx_tensor_meta *meta, char *err, size_t errlen) {
  size_t nlen = strlen(pm->name);
  if (nlen == 0 || nlen > WTX_MAX_NAME_BYTES) {
    snprintf(err, errlen, "update_info.params[%zu].name: %zu bytes, must be 1..%d",
             i, nlen, WTX_MAX_NAME_BYTES);
    return WTX_EINVAL;
  }
  if (wtx_dtype_size(pm->dtype) == 0) {
    snprintf(err, errlen, "update_info.params[%zu].dtype: %d is not a wire dtype "
             "('%s')", i, pm->dtype, pm->name);
    return WTX_EINVAL;
  }
  if (pm->n_shape > WTX_MAX_DIMS) {
    snprintf(err, errlen, "update_info.params[%zu].shape: %zu dims, at most %d "
             "('%s')", i, pm->n_shape, WTX_MAX_DIMS, pm->name);
    return WTX_EINVAL;
  }
  memset(meta, 0, sizeof *meta);
  meta->name = pm->name;
  meta->dtype = pm->dtype;
  meta->ndim = pm->n_shape;
  if (pm->n_shape > 0) memcpy(meta->shape, pm->shape, pm->n_shape * sizeof *pm->shape);
  if (wtx_tensor_nbytes(pm->dtype, pm->shape, pm->n_shape, &meta->nbytes) != 0) {
    snprintf(err, errlen, "update_info.params[%zu].shape: byte size overflows "
             "63 bits ('%s')", i, pm->name);
    return WTX_EINVAL;
  }
  if (s->model_ops->check == NULL) return 0;
  return s->model_ops->check(s->model, s->target, meta, err, errlen);
}

grpc_status_code wtx__handle_update(wtx_rpc_ctx *ctx,
    const Wtx__V1__UpdateWeightsRequest *req, Wtx__V1__UpdateWeightsResponse *resp) {
  wtx_session *s = wtx__session_of(ctx);
  char err[768] = "";
  pthread_mutex_lock(&s->mu);
  grpc_status_code code =
      check_update(s, ctx, req->session_id, req->update_id, "UpdateWeights");
  if (code != GRPC_STATUS_OK) {
    pthread_mutex_unlock(&s->mu);
    return code;
  }
  if (s->receiving) {
    pthread_mutex_unlock(&s->mu);
    return wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "another UpdateWeights of update %llu is still "
                              "receiving; chunks go one at a time",
                              (unsigned long long)s->update_id);
  }
  s->last_activity_ms = wtx_clock_ms();
  const Wtx__V1__UpdateInfo *ui = req->update_info;
  size_t n = ui != NULL ? ui->n_params : 0;
  int rc = 0;
  wtx_rx_tensor *rt = NULL;
  wtx_tensor_meta *metas = NULL;
  uint64_t first_offset = 0;
  if (ui == NULL || n == 0 || n > 65536) {
    snprintf(err, sizeof err, "update_info.params: %zu parameters, must be 1..65536", n);
    rc = WTX_EINVAL;
  } else if (ui->backend_case == WTX__V1__UPDATE_INFO__BACKEND__NOT_SET) {
    snprintf(err, sizeof err, "update_info.backend: missing (the session's backend is %s)",
             s->transport->name);
    rc = WTX_EINVAL;
  }
  if (rc == 0) first_offset = ui->first_param_offset;
  if (rc == 0) {
    rt = calloc(n, sizeof *rt);
    metas = calloc(n, sizeof *metas);
    if (rt == NULL || metas == NULL) rc = WTX_ENOMEM;
  }
  /* Validate every tensor before any byte moves. */
  uint64_t have = 0, want = 0;
  const char *carry = wtx__rx_incomplete(s->rx, &have, &want);
  for (size_t i = 0; rc == 0 && i < n; i++) {
    rc = check_meta(s, ui->params[i], i, &metas[i], err, sizeof err);
    if (rc != 0) break;
    int continues = i == 0 && first_offset > 0 && carry != NULL &&
                    strcmp(carry, metas[0].name) == 0;
    if (!continues && wtx__names_add(&s->names, metas[i].name) != 0) {
      snprintf(err, sizeof err,
               "update_info.params[%zu].name: '%s' appears twice in update %llu",
               i, metas[i].name, (unsigned long long)s->update_id);
      rc = WTX_EINVAL;
    }
  }
  /* Staging memory for tensors that begin in this chunk. */
  for (size_t i = 0; rc == 0 && i < n; i++) {
    rt[i].name = metas[i].name;
    rt[i].nbytes = metas[i].nbytes;
    if (i == 0 && first_offset > 0) {
      rt[0].dst = s->carry_dst;
    } else {
      rc = s->model_ops->stage(s->model, &metas[i], &rt[i].dst);
      if (rc != 0) snprintf(err, sizeof err, "model: cannot stage '%s'", metas[i].name);
    }
  }
  int verify = s->wire.checksum == WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64;
  if (rc == 0) {
    rc = wtx__rx_begin(s->rx, rt, n, first_offset, ui->chunk_bytes, verify);
    if (rc != 0) snprintf(err, sizeof err, "%s", wtx__rx_error(s->rx));
    else if (verify) wtx__rx_expect_checksums(s->rx, ui->xxh3_64, ui->n_xxh3_64);
  }
  if (rc != 0) {
    abort_locked(s, err);
    pthread_mutex_unlock(&s->mu);
    free(rt);
    free(metas);
    return from_wtx(ctx, rc, "UpdateWeights (update aborted)", err);
  }
  s->receiving = 1;
  const wtx_worker_transport *t = s->transport;
  void *engine = s->engine;
  pthread_mutex_unlock(&s->mu);

  rc = t->receive(engine, ui, s->rx);
  if (rc == 0) rc = wtx__rx_end(s->rx);
  if (rc != 0) snprintf(err, sizeof err, "%s", wtx__rx_error(s->rx));

  pthread_mutex_lock(&s->mu);
  s->receiving = 0;
  s->last_activity_ms = wtx_clock_ms();
  size_t done = wtx__rx_completed(s->rx);
  for (size_t i = 0; rc == 0 && i < done; i++) {
    rc = s->model_ops->loaded(s->model, &metas[i], wtx__rx_checksum(s->rx, i));
    if (rc == 0) {
      s->staged_params++;
      s->staged_bytes += metas[i].nbytes;
    }
  }
  if (rc == 0 && done < n) s->carry_dst = rt[n - 1].dst;
  if (rc == 0 && s->abort_requested) {
    rc = WTX_EABORTED;
    snprintf(err, sizeof err, "aborted while receiving");
  }
  if (rc != 0) {
    abort_locked(s, err);
    code = from_wtx(ctx, rc, "UpdateWeights (update aborted)", err);
  } else {
    resp->staged_params = (uint32_t)s->staged_params;
    resp->staged_bytes = s->staged_bytes;
  }
  pthread_mutex_unlock(&s->mu);
  free(rt);
  free(metas);
  return code;
}

grpc_status_code wtx__handle_finish(wtx_rpc_ctx *ctx,
    const Wtx__V1__FinishWeightUpdateRequest *req, Wtx__V1__FinishWeightUpdateResponse *resp) {
  wtx_session *s = wtx__session_of(ctx);
  if (strlen(req->weight_version) > 256)
    return wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                              "weight_version: %zu bytes, at most 256",
                              strlen(req->weight_version));
  pthread_mutex_lock(&s->mu);
  grpc_status_code code = check_update(s, ctx, req->session_id, req->update_id,
                                       "FinishWeightUpdate");
  int committed = 0;
  if (code == GRPC_STATUS_OK && s->receiving)
    code = wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "an UpdateWeights is still receiving");
  uint64_t have, want;
  const char *carry = code == GRPC_STATUS_OK ? wtx__rx_incomplete(s->rx, &have, &want) : NULL;
  if (carry != NULL) {
    char why[1200];
    snprintf(why, sizeof why, "tensor '%s' is incomplete: %llu of %llu bytes",
             carry, (unsigned long long)have, (unsigned long long)want);
    code = wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "FinishWeightUpdate: %s (update aborted)", why);
    abort_locked(s, why);
  } else if (code == GRPC_STATUS_OK) {
    char version[32];
    const char *v = req->weight_version;
    if (v[0] == '\0') {
      snprintf(version, sizeof version, "%llu",
               (unsigned long long)(++s->auto_version));
      v = version;
    }
    int rc = s->model_ops->commit(s->model, v);
    if (rc != 0) {
      code = from_wtx(ctx, rc, "model", "commit failed (update aborted)");
      abort_locked(s, "commit failed");
    } else {
      resp->weight_version = wtx_rpc_ctx_strdup(ctx, v);
      resp->num_params = (uint32_t)s->staged_params;
      resp->total_bytes = s->staged_bytes;
      s->state = WTX__V1__SESSION_STATE__SESSION_STATE_READY;
      wtx__names_clear(&s->names);
      char q[600];
      wtx_log(WTX_LOG_INFO, "event=published update=%llu target=%s version=%s "
              "params=%llu bytes=%llu", (unsigned long long)s->update_id,
              s->target == WTX_TARGET_DRAFT ? "draft" : "main",
              wtx_log_quote(v, q, sizeof q), (unsigned long long)s->staged_params,
              (unsigned long long)s->staged_bytes);
      committed = 1;
    }
  }
  int target = s->target;
  pthread_mutex_unlock(&s->mu);
  if (committed && s->on_commit != NULL) s->on_commit(s->on_commit_user, target);
  return code;
}

grpc_status_code wtx__handle_abort(wtx_rpc_ctx *ctx,
    const Wtx__V1__AbortWeightUpdateRequest *req, Wtx__V1__AbortWeightUpdateResponse *resp) {
  wtx_session *s = wtx__session_of(ctx);
  pthread_mutex_lock(&s->mu);
  /* An empty session_id is an operator's abort of whatever is current. */
  grpc_status_code code = check_session(
      s, ctx, req->session_id[0] ? req->session_id : s->session_id);
  if (code == GRPC_STATUS_OK && req->update_id != 0 &&
      s->state == WTX__V1__SESSION_STATE__SESSION_STATE_UPDATING &&
      req->update_id != s->update_id)
    code = wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_NOT_FOUND,
                              "update_id: %llu is not the active update (%llu)",
                              (unsigned long long)req->update_id,
                              (unsigned long long)s->update_id);
  if (code == GRPC_STATUS_OK) {
    resp->aborted = s->state == WTX__V1__SESSION_STATE__SESSION_STATE_UPDATING;
    if (s->receiving)
      s->abort_requested = 1;
    else
      abort_locked(s, req->reason[0] ? req->reason : "AbortWeightUpdate");
  }
  pthread_mutex_unlock(&s->mu);
  return code;
}
