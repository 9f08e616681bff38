/* The WeightTransfer calls that look at the session and the published
 * weights without changing an update, and Pause / Resume (see session.h).
 * None waits on a receive: the session lock is held only to copy a few
 * fields, and the store hands out refcounted snapshots. */
#include <stdlib.h>
#include <string.h>

#include "server/session.h"

grpc_status_code wtx__handle_version(wtx__rpc_ctx *ctx,
    const Wtx__V1__UpdateWeightVersionRequest *req,
    Wtx__V1__UpdateWeightVersionResponse *resp) {
  wtx_session *s = wtx__rpc_ctx_user(ctx);
  size_t n = strlen(req->weight_version);
  if (n == 0)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                              "weight_version: 0 bytes, must be 1..%d", WTX_MAX_VERSION_BYTES);
  grpc_status_code code = wtx__check_request(ctx, &req->base);
  if (code == GRPC_STATUS_OK)
    code = wtx__check_text(ctx, "weight_version", req->weight_version, WTX_MAX_VERSION_BYTES);
  if (code != GRPC_STATUS_OK) return code;
  if (s->cfg.store == NULL)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_UNIMPLEMENTED,
                              "the host model does not keep versions here");
  char *prev = NULL;
  int rc = wtx_store_set_version(s->cfg.store, req->weight_version, &prev);
  if (rc != 0)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INTERNAL, "%s", wtx_strerror(rc));
  resp->previous_version = wtx__rpc_ctx_strdup(ctx, prev ? prev : "");
  free(prev);
  return GRPC_STATUS_OK;
}

/* Bytes a listing page may hold: under the 4 MiB a gRPC client accepts
 * by default, with room for the rest of the response. */
#define PAGE_BYTES ((size_t)3 << 20)

/* How many parameters of v from off fit in one page of at most limit. */
static size_t page_size(const wtx_store_view *v, size_t off, size_t limit) {
  size_t n = 0, bytes = 0;
  while (off + n < v->n_params && n < limit) {
    const wtx_tensor_meta *m = &v->params[off + n].meta;
    bytes += strlen(m->name) + 16 + 11 * (m->ndim + 1); /* ParamInfo, at most */
    if (n > 0 && bytes > PAGE_BYTES) break;
    n++;
  }
  return n;
}

/* One page of the published parameters of v as ParamInfo messages in the
 * call arena. */
static grpc_status_code list_params(wtx__rpc_ctx *ctx, const wtx_store_view *v,
                                    const Wtx__V1__GetWeightInfoRequest *req,
                                    Wtx__V1__GetWeightInfoResponse *resp) {
  size_t off = req->params_offset, limit = req->params_limit;
  if (limit == 0 || limit > WTX_MAX_INFO_PARAMS) limit = WTX_MAX_INFO_PARAMS;
  if (off > v->n_params)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_OUT_OF_RANGE,
                              "params_offset: %zu, the model has %zu parameters", off,
                              v->n_params);
  size_t n = page_size(v, off, limit);
  if (off + n < v->n_params) resp->next_params_offset = (uint32_t)(off + n);
  Wtx__V1__ParamInfo **pi = wtx__rpc_ctx_alloc(ctx, (n + 1) * sizeof *pi);
  Wtx__V1__ParamInfo *pis = wtx__rpc_ctx_alloc(ctx, (n + 1) * sizeof *pis);
  Wtx__V1__ParamMeta *pms = wtx__rpc_ctx_alloc(ctx, (n + 1) * sizeof *pms);
  if (pi == NULL || pis == NULL || pms == NULL)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
  for (size_t i = 0; i < n; i++) {
    const wtx_store_param *p = &v->params[off + i];
    wtx__v1__param_meta__init(&pms[i]);
    /* Copied: the view is released before the response is sent. */
    pms[i].name = wtx__rpc_ctx_strdup(ctx, p->meta.name);
    pms[i].dtype = (Wtx__V1__DType)p->meta.dtype;
    pms[i].n_shape = p->meta.ndim;
    pms[i].shape = wtx__rpc_ctx_alloc(ctx, (p->meta.ndim + 1) * sizeof(uint64_t));
    if (pms[i].name == NULL || pms[i].shape == NULL)
      return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory");
    memcpy(pms[i].shape, p->meta.shape, p->meta.ndim * sizeof(uint64_t));
    wtx__v1__param_info__init(&pis[i]);
    pis[i].meta = &pms[i];
    pis[i].nbytes = p->meta.nbytes;
    pis[i].xxh3_64 = p->has_xxh3 ? p->xxh3 : 0;
    pis[i].has_xxh3_64 = p->has_xxh3;
    pi[i] = &pis[i];
  }
  resp->params = pi;
  resp->n_params = n;
  return GRPC_STATUS_OK;
}

/* The shard rules a trainer plans this worker's parts from. */
static void describe_shard(wtx__rpc_ctx *ctx, const wtx__session_config *c,
                           Wtx__V1__GetWeightInfoResponse *resp) {
  if (c->shard_rules == NULL) return;
  Wtx__V1__ShardSpec *sp = wtx__rpc_ctx_alloc(ctx, sizeof *sp);
  Wtx__V1__ShardRule **rp = wtx__rpc_ctx_alloc(ctx, (c->n_shard_rules + 1) * sizeof *rp);
  Wtx__V1__ShardRule *r = wtx__rpc_ctx_alloc(ctx, (c->n_shard_rules + 1) * sizeof *r);
  if (sp == NULL || rp == NULL || r == NULL) return;
  wtx__v1__shard_spec__init(sp);
  sp->tp_rank = c->tp_rank;
  sp->tp_size = c->tp_size;
  for (size_t k = 0; k < c->n_shard_rules; k++) {
    wtx__v1__shard_rule__init(&r[k]);
    r[k].pattern = (char *)c->shard_rules[k].pattern;
    r[k].kind = (Wtx__V1__ShardKind)c->shard_rules[k].kind;
    r[k].dim = c->shard_rules[k].dim;
    r[k].unit = c->shard_rules[k].unit;
    rp[k] = &r[k];
  }
  sp->n_rules = c->n_shard_rules;
  sp->rules = rp;
  resp->shard = sp;
}

/* The session's part of GetWeightInfo, copied under its lock. */
static void describe_session(wtx__rpc_ctx *ctx, wtx_session *s,
                             Wtx__V1__GetWeightInfoResponse *resp) {
  pthread_mutex_lock(&s->mu);
  /* A store's version comes with its view (wtx__handle_info). */
  char served[WTX_MAX_VERSION_BYTES + 1] = "";
  if (s->cfg.store == NULL) wtx__session_served(s, WTX_TARGET_MAIN, served, sizeof served);
  resp->weight_version = wtx__rpc_ctx_strdup(ctx, served);
  resp->state = s->state;
  resp->backend = wtx__rpc_ctx_strdup(ctx, s->transport ? s->transport->name : "");
  if (s->state == WTX__V1__SESSION_STATE__SESSION_STATE_UPDATING ||
      s->state == WTX__V1__SESSION_STATE__SESSION_STATE_PREPARED)
    resp->active_target = (Wtx__V1__UpdateTarget)s->up.target;
  pthread_mutex_unlock(&s->mu);
  resp->paused = atomic_load(&s->paused);
  describe_shard(ctx, &s->cfg, resp);
}

grpc_status_code wtx__handle_info(wtx__rpc_ctx *ctx,
    const Wtx__V1__GetWeightInfoRequest *req, Wtx__V1__GetWeightInfoResponse *resp) {
  wtx_session *s = wtx__rpc_ctx_user(ctx);
  describe_session(ctx, s, resp);
  char serving[WTX_MAX_VERSION_BYTES + 1];
  if (s->cfg.serving_version != NULL &&
      s->cfg.serving_version(s->cfg.on_commit_user, serving, sizeof serving) == 0)
    resp->serving_version = wtx__rpc_ctx_strdup(ctx, serving);
  if (s->cfg.store == NULL) return GRPC_STATUS_OK;
  wtx_store_view v, d;
  wtx_store_acquire(s->cfg.store, WTX_TARGET_MAIN, &v);
  wtx_store_acquire(s->cfg.store, WTX_TARGET_DRAFT, &d);
  grpc_status_code code = GRPC_STATUS_OK;
  resp->weight_version = wtx__rpc_ctx_strdup(ctx, v.version);
  resp->generation = v.generation;
  resp->num_params = (uint32_t)v.n_params;
  resp->total_bytes = v.total_bytes;
  resp->draft_num_params = (uint32_t)d.n_params;
  resp->draft_total_bytes = d.total_bytes;
  if (req->include_params) code = list_params(ctx, &v, req, resp);
  wtx_store_release(s->cfg.store, &v);
  wtx_store_release(s->cfg.store, &d);
  return code;
}

grpc_status_code wtx__handle_world(wtx__rpc_ctx *ctx,
    const Wtx__V1__GetWorldSizeRequest *req, Wtx__V1__GetWorldSizeResponse *resp) {
  (void)req;
  wtx_session *s = wtx__rpc_ctx_user(ctx);
  resp->world_size = s->cfg.world_size;
  return GRPC_STATUS_OK;
}

grpc_status_code wtx__handle_pause(wtx__rpc_ctx *ctx,
    const Wtx__V1__PauseRequest *req, Wtx__V1__PauseResponse *resp) {
  wtx_session *s = wtx__rpc_ctx_user(ctx);
  int was = atomic_load(&s->paused);
  int now = s->cfg.on_pause != NULL ? s->cfg.on_pause(s->cfg.host, req->wait_for_inflight, was)
                                    : 1;
  atomic_store(&s->paused, now);
  resp->paused = now;
  return GRPC_STATUS_OK;
}

grpc_status_code wtx__handle_resume(wtx__rpc_ctx *ctx,
    const Wtx__V1__ResumeRequest *req, Wtx__V1__ResumeResponse *resp) {
  (void)req;
  wtx_session *s = wtx__rpc_ctx_user(ctx);
  int was = atomic_load(&s->paused);
  int now = s->cfg.on_resume != NULL ? s->cfg.on_resume(s->cfg.host, was) : 0;
  atomic_store(&s->paused, now);
  resp->paused = now;
  return GRPC_STATUS_OK;
}
