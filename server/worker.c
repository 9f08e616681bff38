/* wtx_worker: the gRPC server around one session, and the inspection calls. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "common/log.h"
#include "common/safetensors.h"
#include "rpc/services.h"
#include "server/internal.h"

struct wtx_worker {
  wtx_rpc_server *srv;
  wtx_rpc_health *health;
  wtx__publisher *publisher;
  wtx_session session;
  wtx_store *own_store;
  wtx_store *store; /* for inspection; NULL with a host model */
  wtx_worker_options opts;
  int port;
  int paused;
  int drained;
  pthread_mutex_t mu;
};

/* ---- name set ---- */

int wtx__names_add(wtx__names *s, const char *name) {
  if (s->n * 2 >= s->cap) {
    size_t cap = s->cap ? s->cap * 2 : 64;
    char **slots = calloc(cap, sizeof *slots);
    if (slots == NULL) return WTX_ENOMEM;
    for (size_t i = 0; i < s->cap; i++) {
      if (s->slots[i] == NULL) continue;
      size_t h = XXH3_64bits(s->slots[i], strlen(s->slots[i])) & (cap - 1);
      while (slots[h] != NULL) h = (h + 1) & (cap - 1);
      slots[h] = s->slots[i];
    }
    free(s->slots);
    s->slots = slots;
    s->cap = cap;
  }
  size_t h = XXH3_64bits(name, strlen(name)) & (s->cap - 1);
  while (s->slots[h] != NULL) {
    if (strcmp(s->slots[h], name) == 0) return WTX_EEXIST;
    h = (h + 1) & (s->cap - 1);
  }
  s->slots[h] = strdup(name);
  if (s->slots[h] == NULL) return WTX_ENOMEM;
  s->n++;
  return 0;
}

void wtx__names_clear(wtx__names *s) {
  for (size_t i = 0; i < s->cap; i++) {
    free(s->slots[i]);
    s->slots[i] = NULL;
  }
  s->n = 0;
}

/* ---- WeightTransfer handlers ---- */

static wtx_worker *W(wtx_rpc_ctx *ctx) { return wtx_rpc_ctx_user(ctx); }

wtx_session *wtx__session_of(wtx_rpc_ctx *ctx) { return &W(ctx)->session; }

static grpc_status_code h_version(wtx_rpc_ctx *ctx,
                                  const Wtx__V1__UpdateWeightVersionRequest *req,
                                  Wtx__V1__UpdateWeightVersionResponse *resp) {
  wtx_worker *w = W(ctx);
  size_t n = strlen(req->weight_version);
  if (n == 0 || n > 256)
    return wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                              "weight_version: %zu bytes, must be 1..256", n);
  if (w->store == NULL)
    return wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_UNIMPLEMENTED,
                              "the host model does not keep versions here");
  char *prev = NULL;
  int rc = wtx_store_set_version(w->store, req->weight_version, &prev);
  if (rc != 0)
    return wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_INTERNAL, "%s", wtx_strerror(rc));
  resp->previous_version = wtx_rpc_ctx_strdup(ctx, prev ? prev : "");
  free(prev);
  return GRPC_STATUS_OK;
}

static grpc_status_code h_info(wtx_rpc_ctx *ctx,
                               const Wtx__V1__GetWeightInfoRequest *req,
                               Wtx__V1__GetWeightInfoResponse *resp) {
  wtx_worker *w = W(ctx);
  wtx_session *s = &w->session;
  pthread_mutex_lock(&s->mu);
  resp->state = s->state;
  resp->backend = wtx_rpc_ctx_strdup(ctx, s->transport ? s->transport->name : "");
  if (s->state == WTX__V1__SESSION_STATE__SESSION_STATE_UPDATING)
    resp->active_target = s->target == WTX_TARGET_DRAFT
                              ? WTX__V1__UPDATE_TARGET__UPDATE_TARGET_DRAFT
                              : WTX__V1__UPDATE_TARGET__UPDATE_TARGET_MAIN;
  pthread_mutex_unlock(&s->mu);
  pthread_mutex_lock(&w->mu);
  resp->paused = w->paused;
  pthread_mutex_unlock(&w->mu);
  if (w->store == NULL) {
    resp->weight_version = (char *)"";
    return GRPC_STATUS_OK;
  }
  wtx_store_view v, d;
  wtx_store_acquire(w->store, WTX_TARGET_MAIN, &v);
  wtx_store_acquire(w->store, WTX_TARGET_DRAFT, &d);
  grpc_status_code code = GRPC_STATUS_OK;
  resp->weight_version = wtx_rpc_ctx_strdup(ctx, v.version);
  resp->generation = v.generation;
  resp->num_params = (uint32_t)v.n_params;
  resp->total_bytes = v.total_bytes;
  resp->draft_num_params = (uint32_t)d.n_params;
  resp->draft_total_bytes = d.total_bytes;
  if (req->include_params && v.n_params > 0) {
    size_t n = v.n_params;
    Wtx__V1__ParamInfo **pi = wtx_rpc_ctx_alloc(ctx, n * sizeof *pi);
    Wtx__V1__ParamInfo *pis = wtx_rpc_ctx_alloc(ctx, n * sizeof *pis);
    Wtx__V1__ParamMeta *pms = wtx_rpc_ctx_alloc(ctx, n * sizeof *pms);
    if (pi == NULL || pis == NULL || pms == NULL) {
      code = wtx_rpc_ctx_errorf(ctx, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    } else {
      for (size_t i = 0; i < n; i++) {
        const wtx_store_param *p = &v.params[i];
        wtx__v1__param_meta__init(&pms[i]);
        pms[i].name = wtx_rpc_ctx_strdup(ctx, p->meta.name);
        pms[i].dtype = (Wtx__V1__DType)p->meta.dtype;
        pms[i].n_shape = p->meta.ndim;
        pms[i].shape = wtx_rpc_ctx_alloc(ctx, (p->meta.ndim + 1) * sizeof(uint64_t));
        if (pms[i].shape != NULL)
          memcpy(pms[i].shape, p->meta.shape, p->meta.ndim * sizeof(uint64_t));
        wtx__v1__param_info__init(&pis[i]);
        pis[i].meta = &pms[i];
        pis[i].nbytes = p->meta.nbytes;
        pis[i].xxh3_64 = p->xxh3;
        pi[i] = &pis[i];
      }
      resp->params = pi;
      resp->n_params = n;
    }
  }
  wtx_store_release(w->store, &v);
  wtx_store_release(w->store, &d);
  return code;
}

static grpc_status_code h_world(wtx_rpc_ctx *ctx,
                                const Wtx__V1__GetWorldSizeRequest *req,
                                Wtx__V1__GetWorldSizeResponse *resp) {
  (void)req;
  resp->world_size = W(ctx)->session.world_size;
  return GRPC_STATUS_OK;
}

static grpc_status_code h_pause(wtx_rpc_ctx *ctx, const Wtx__V1__PauseRequest *req,
                                Wtx__V1__PauseResponse *resp) {
  wtx_worker *w = W(ctx);
  if (w->opts.on_pause != NULL) w->opts.on_pause(w->opts.host, req->wait_for_inflight);
  pthread_mutex_lock(&w->mu);
  w->paused = 1;
  pthread_mutex_unlock(&w->mu);
  resp->paused = 1;
  return GRPC_STATUS_OK;
}

static grpc_status_code h_resume(wtx_rpc_ctx *ctx, const Wtx__V1__ResumeRequest *req,
                                 Wtx__V1__ResumeResponse *resp) {
  (void)req;
  wtx_worker *w = W(ctx);
  if (w->opts.on_resume != NULL) w->opts.on_resume(w->opts.host);
  pthread_mutex_lock(&w->mu);
  w->paused = 0;
  pthread_mutex_unlock(&w->mu);
  resp->paused = 0;
  return GRPC_STATUS_OK;
}

static const Wtx__V1__WeightTransfer_Handlers handlers = {
    .init_weight_transfer_engine = wtx__handle_init,
    .start_weight_update = wtx__handle_start,
    .update_weights = wtx__handle_update,
    .finish_weight_update = wtx__handle_finish,
    .abort_weight_update = wtx__handle_abort,
    .update_weight_version = h_version,
    .get_weight_info = h_info,
    .get_world_size = h_world,
    .pause = h_pause,
    .resume = h_resume,
};

/* ---- lifecycle ---- */

static void on_commit(void *user, int target) {
  wtx_worker *w = user;
  if (target == WTX_TARGET_MAIN && w->publisher != NULL)
    wtx__publisher_notify(w->publisher);
}

/* Declares the layout in the safetensors header at path. */
static int declare_spec(wtx_store *store, const char *path, char *err,
                        size_t errlen) {
  wtx_st_file *f = NULL;
  int rc = wtx_st_open(path, &f, err, errlen);
  if (rc != 0) return rc;
  size_t n = wtx_st_count(f);
  wtx_tensor_meta *metas = calloc(n ? n : 1, sizeof *metas);
  if (metas == NULL) {
    wtx_st_close(f);
    return WTX_ENOMEM;
  }
  for (size_t i = 0; i < n; i++) metas[i] = wtx_st_tensor_at(f, i)->meta;
  rc = wtx_store_declare(store, metas, n);
  if (rc != 0) snprintf(err, errlen, "model_spec: %s: %s", path, wtx_strerror(rc));
  else
    wtx_log(WTX_LOG_INFO, "event=model_spec file=%s params=%zu", path, n);
  free(metas);
  wtx_st_close(f);
  return rc;
}

int wtx_worker_start(const wtx_worker_options *opts, wtx_worker **out, char *err,
                     size_t errlen) {
  *out = NULL;
  if (opts == NULL || opts->listen == NULL) {
    snprintf(err, errlen, "listen: missing (host:port)");
    return WTX_EINVAL;
  }
  wtx_transports_register_builtin();
  wtx_worker *w = calloc(1, sizeof *w);
  if (w == NULL) return WTX_ENOMEM;
  pthread_mutex_init(&w->mu, NULL);
  w->opts = *opts;
  w->opts.listen = w->opts.model_spec = w->opts.publish_dir = NULL;
  const wtx_model_ops *ops = opts->model_ops;
  void *model = opts->model;
  int rc = 0;
  if (ops == NULL) {
    rc = wtx_store_create(&w->own_store);
    ops = &wtx_store_model_ops;
    model = w->own_store;
    w->store = w->own_store;
  }
  if (rc == 0 && (opts->model_spec != NULL || opts->publish_dir != NULL) &&
      w->store == NULL) {
    snprintf(err, errlen, "model_spec and publish_dir need the internal store, "
             "not a host model");
    rc = WTX_EINVAL;
  }
  if (rc == 0 && opts->model_spec != NULL)
    rc = declare_spec(w->store, opts->model_spec, err, errlen);
  if (rc == 0 && opts->publish_dir != NULL) {
    rc = wtx__publisher_create(w->store, opts->publish_dir,
                               opts->publish_keep > 0 ? opts->publish_keep : 2,
                               &w->publisher);
    if (rc == WTX_ENOENT)
      snprintf(err, errlen, "publish_dir: %s is not a writable directory",
               opts->publish_dir);
  }
  if (rc == 0)
    rc = wtx__session_init(&w->session, ops, model, opts->world_size,
                           opts->watchdog_ms);
  w->session.on_commit = on_commit;
  w->session.on_commit_user = w;
  wtx_rpc_server_options so = WTX_RPC_SERVER_OPTIONS_INIT;
  so.max_receive_message_bytes =
      opts->max_message_bytes > 0 ? opts->max_message_bytes : 64 << 20;
  if (rc == 0) rc = wtx_rpc_server_create(&so, &w->srv);
  if (rc == 0)
    rc = wtx_rpc_server_add_service(w->srv, &wtx__v1__weight_transfer__grpc,
                                    &handlers, w);
  if (rc == 0) rc = wtx_rpc_health_create(w->srv, &w->health);
  if (rc == 0) rc = wtx_rpc_server_add_reflection(w->srv);
  if (rc == 0) {
    rc = wtx_rpc_server_start(w->srv, opts->listen, &w->port);
    if (rc != 0) snprintf(err, errlen, "listen: cannot bind %s", opts->listen);
  }
  if (rc == 0) wtx_rpc_health_set(w->health, 1);
  if (rc != 0) {
    if (err[0] == '\0') snprintf(err, errlen, "%s", wtx_strerror(rc));
    wtx_worker_destroy(w);
    return rc;
  }
  *out = w;
  return 0;
}

int wtx_worker_port(const wtx_worker *w) { return w->port; }

wtx_store *wtx_worker_store(wtx_worker *w) { return w->store; }

int wtx_worker_watchdog(wtx_worker *w) { return wtx__session_watchdog(&w->session); }

int wtx_worker_paused(const wtx_worker *w) { return w->paused; }

void wtx_worker_set_serving(wtx_worker *w, int serving) {
  pthread_mutex_lock(&w->mu);
  if (!w->drained) wtx_rpc_health_set(w->health, serving);
  pthread_mutex_unlock(&w->mu);
}

void wtx_worker_drain(wtx_worker *w, int64_t grace_ms) {
  pthread_mutex_lock(&w->mu);
  int was = w->drained;
  w->drained = 1;
  pthread_mutex_unlock(&w->mu);
  if (was) return;
  /* NOT_SERVING first, so probes stop routing here, and every health Watch
   * ends, so the server shutdown does not wait for them. */
  if (w->health != NULL) wtx_rpc_health_close(w->health);
  if (w->srv != NULL) {
    wtx__session_drain(&w->session);
    wtx_rpc_server_shutdown(w->srv, grace_ms);
  }
}

void wtx_worker_destroy(wtx_worker *w) {
  if (w == NULL) return;
  wtx_worker_drain(w, 0);
  wtx_rpc_server_destroy(w->srv);
  wtx_rpc_health_destroy(w->health);
  wtx__publisher_destroy(w->publisher);
  if (w->session.rx != NULL) wtx__session_destroy(&w->session);
  wtx_store_destroy(w->own_store);
  pthread_mutex_destroy(&w->mu);
  free(w);
}
