/* The WorkerEngine session: the calls that change it (see session.h). */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/hash.h"
#include "common/log.h"
#include "common/patch.h"
#include "common/random.h"
#include "common/text.h"
#include "server/session.h"
#include "server/store.h"

/* The next table id (wtx_model_ops.check_range): unique in the process,
 * whatever the number of sessions sharing a model. */
static atomic_uint_fast64_t table_ids = 1;

/* Whether an update is open: receiving chunks, or prepared. */
static int update_open(const wtx_session *s) {
  return s->state == WTX__V1__SESSION_STATE__SESSION_STATE_UPDATING ||
         s->state == WTX__V1__SESSION_STATE__SESSION_STATE_PREPARED;
}

/* A new session's id: random where the kernel gives bytes; else unique
 * in time and process, which still tells one session from the next. */
static void new_session_id(char out[33]) {
  uint8_t r[16];
  if (wtx__random_bytes(r, sizeof r) != 0) {
    uint64_t t = (uint64_t)wtx__clock_ms() ^ (uint64_t)getpid() << 32;
    memcpy(r, &t, 8);
    memcpy(r + 8, &t, 8);
  }
  for (int i = 0; i < 16; i++) snprintf(out + 2 * i, 3, "%02x", r[i]);
}

/* The metrics' name for why a chunk failed. */
static wtx__end failure_kind(int rc) {
  switch (rc) {
    case WTX_ECHECKSUM: return WTX__END_CHECKSUM;
    case WTX_ETOOBIG: return WTX__END_LIMIT;
    case WTX_EIO: case WTX_ETIMEDOUT: case WTX_ECANCELED: case WTX_EABORTED:
    case WTX_EUNAVAIL: case WTX_EPROTO: return WTX__END_DATA_PLANE;
    default: return WTX__END_REFUSED;
  }
}

/* An update as none has begun: every field at its start, the memory of
 * its params' layout kept for the next. */
static void update_reset(wtx_session *s) {
  wtx__update *u = &s->up;
  /* A call waiting for its turn in the update ends: it finds it gone. */
  pthread_cond_broadcast(&s->turn);
  free(u->boxed.bits);
  free(u->spans.wire);
  free(u->bounce_host);
  wtx__layout cur = u->cur;
  wtx__layout_clear(&cur);
  *u = (wtx__update){.by_range = -1, .cur = cur};
}

/* Discards the active update, counted under kind. Caller holds mu, and no
 * receive runs (request_abort waits for it). */
static void abort_locked(wtx_session *s, wtx__end kind, const char *why) {
  if (!update_open(s)) return;
  wtx__metrics_ended(s->cfg.metrics, kind);
  s->cfg.model_ops->abort(s->cfg.model);
  if (s->transport != NULL && s->transport->reset != NULL)
    s->transport->reset(s->engine);
  wtx__rx_reset(s->rx);
  update_reset(s);
  s->state = s->draining ? WTX__V1__SESSION_STATE__SESSION_STATE_DRAINING
                         : WTX__V1__SESSION_STATE__SESSION_STATE_READY;
  char q[512];
  wtx__log(WTX__LOG_WARN, "event=aborted update=%llu reason=%s",
          (unsigned long long)s->update_id, wtx__log_quote(why, q, sizeof q));
}

static void choose_steps(wtx_session *s);
static void choose_stage(wtx_session *s);

int wtx__session_init(wtx_session *s, const wtx__session_config *cfg) {
  memset(s, 0, sizeof *s);
  pthread_mutex_init(&s->mu, NULL);
  wtx__clock_cond_init(&s->turn);
  s->cfg = *cfg;
  if (s->cfg.world_size == 0) s->cfg.world_size = 1;
  if (s->cfg.watchdog_ms <= 0) s->cfg.watchdog_ms = WTX_DEFAULT_WATCHDOG_MS;
  s->state = WTX__V1__SESSION_STATE__SESSION_STATE_UNINITIALIZED;
  atomic_init(&s->paused, 0);
  choose_steps(s);
  choose_stage(s);
  int rc = wtx__layout_init(&s->up.cur);
  if (rc == 0) rc = wtx__layout_init(&s->tb.table[0]);
  if (rc == 0) rc = wtx__layout_init(&s->tb.table[1]);
  if (rc == 0) rc = wtx__rx_create(&s->rx);
  if (rc != 0) {
    wtx__layout_free(&s->up.cur);
    wtx__layout_free(&s->tb.table[0]);
    wtx__layout_free(&s->tb.table[1]);
    pthread_cond_destroy(&s->turn);
    pthread_mutex_destroy(&s->mu);
  }
  return rc;
}

void wtx__session_destroy(wtx_session *s) {
  pthread_mutex_lock(&s->mu);
  abort_locked(s, WTX__END_DRAIN, "worker shutting down");
  if (s->engine != NULL) s->transport->destroy(s->engine);
  s->engine = NULL;
  pthread_mutex_unlock(&s->mu);
  wtx__rx_destroy(s->rx);
  free(s->sc.rt);
  free(s->sc.dst);
  free(s->sc.metas);
  free(s->sc.sums);
  wtx__layout_free(&s->up.cur);
  wtx__layout_free(&s->tb.table[0]);
  wtx__layout_free(&s->tb.table[1]);
  pthread_cond_destroy(&s->turn);
  pthread_mutex_destroy(&s->mu);
}

int wtx__session_state(wtx_session *s) {
  pthread_mutex_lock(&s->mu);
  int state = s->state;
  pthread_mutex_unlock(&s->mu);
  return state;
}

int wtx__session_watchdog(wtx_session *s) {
  int fired = 0;
  pthread_mutex_lock(&s->mu);
  if (update_open(s) && !s->up.receiving &&
      wtx__clock_ms() - s->last_activity_ms > s->cfg.watchdog_ms) {
    abort_locked(s, WTX__END_WATCHDOG, "watchdog: no call from the trainer within the timeout");
    fired = 1;
  }
  pthread_mutex_unlock(&s->mu);
  return fired;
}

/* A receive is running: it is cancelled now (when the backend can) and the
 * update aborted once it returns. Caller holds mu. */
static void request_abort(wtx_session *s) {
  s->up.abort_requested = 1;
  if (s->transport->cancel != NULL) s->transport->cancel(s->engine);
}

void wtx__session_drain(wtx_session *s) {
  pthread_mutex_lock(&s->mu);
  s->draining = 1;
  /* A running receive keeps the update UPDATING until it returns; the
   * update is then aborted and the state lands on DRAINING. */
  if (s->up.receiving) {
    request_abort(s);
  } else {
    abort_locked(s, WTX__END_DRAIN, "worker draining");
    s->state = WTX__V1__SESSION_STATE__SESSION_STATE_DRAINING;
  }
  if (s->connecting != NULL && s->connecting_t->cancel != NULL)
    s->connecting_t->cancel(s->connecting);
  pthread_mutex_unlock(&s->mu);
}

grpc_status_code wtx__check_request(wtx__rpc_ctx *ctx, const ProtobufCMessage *req) {
  size_t got = wtx__rpc_ctx_request_bytes(ctx);
  if (protobuf_c_message_get_packed_size(req) == got) return GRPC_STATUS_OK;
  return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                            "request: a string holds a NUL byte, or the message "
                            "is not canonically encoded");
}

grpc_status_code wtx__check_text(wtx__rpc_ctx *ctx, const char *field, const char *text,
                                 size_t max) {
  size_t n = strlen(text);
  if (max > 0 && n > max)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                              "%s: %zu bytes, at most %zu", field, n, max);
  if (!wtx__utf8_valid(text))
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                              "%s: not valid UTF-8", field);
  return GRPC_STATUS_OK;
}

/* Session id and state checks shared by the per-update calls. Caller holds
 * mu. */
static grpc_status_code check_session(wtx_session *s, wtx__rpc_ctx *ctx,
                                      const char *session_id) {
  if (s->draining)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_UNAVAILABLE,
                              "worker is draining");
  /* A session id this worker never gave (it restarted, say) is NOT_FOUND
   * whatever the state, so a trainer knows to initialize again; a call
   * with none before init is out of order. */
  if (s->state == WTX__V1__SESSION_STATE__SESSION_STATE_UNINITIALIZED && session_id[0] == '\0')
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "no transfer engine: call "
                              "InitWeightTransferEngine first");
  if (strcmp(session_id, s->session_id) != 0)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_NOT_FOUND,
                              "session_id: '%s' is not the current session",
                              session_id);
  return GRPC_STATUS_OK;
}

/* The checks of a call on the open update; prepared: whether the call is
 * taken once the update is prepared (Finish, Abort) or not (UpdateWeights,
 * Prepare). */
static grpc_status_code check_update(wtx_session *s, wtx__rpc_ctx *ctx,
                                     const char *session_id, uint64_t update_id,
                                     const char *call, int prepared) {
  grpc_status_code c = check_session(s, ctx, session_id);
  if (c != GRPC_STATUS_OK) return c;
  if (!update_open(s))
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "%s without an active update: call "
                              "StartWeightUpdate first",
                              call);
  if (!prepared && s->state == WTX__V1__SESSION_STATE__SESSION_STATE_PREPARED)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "%s: update %llu is prepared; finish or abort it", call,
                              (unsigned long long)s->update_id);
  if (update_id != s->update_id)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_NOT_FOUND,
                              "update_id: %llu is not the active update (%llu)",
                              (unsigned long long)update_id,
                              (unsigned long long)s->update_id);
  return GRPC_STATUS_OK;
}

static grpc_status_code from_wtx(wtx__rpc_ctx *ctx, int rc, const char *what,
                                 const char *detail) {
  return wtx__rpc_ctx_errorf(ctx, (grpc_status_code)wtx_err_to_grpc(rc),
                            "%s: %s", what, detail[0] ? detail : wtx_strerror(rc));
}

/* Whether a client takes rc's status as transient, and asks again. */
static int transient(int rc) {
  return wtx__rpc_code_transient((grpc_status_code)wtx_err_to_grpc(rc));
}

/* A failure of the model (begin, staging, loading, prepare, commit) as the
 * caller sees it. The model answers in this process, so its error is never
 * the network's: a code a client takes as transient (UNAVAILABLE,
 * DEADLINE_EXCEEDED) would have it ask again, into an update this failure
 * already ended, and answer that instead of the cause. Such codes are
 * INTERNAL here. (The engine a sidecar feeds keeps its codes: a repeated
 * Finish answers its failure again, see handle_finish.) */
static grpc_status_code model_failed(wtx__rpc_ctx *ctx, int rc, const char *what,
                                     const char *detail) {
  grpc_status_code code = transient(rc) ? GRPC_STATUS_INTERNAL
                                        : (grpc_status_code)wtx_err_to_grpc(rc);
  return wtx__rpc_ctx_errorf(ctx, code, "%s: %s", what, detail[0] ? detail : wtx_strerror(rc));
}

/* The session's transport for init's backend member, or an error naming
 * the member and the backends this worker serves. */
static grpc_status_code find_transport(wtx_session *s, wtx__rpc_ctx *ctx,
                                       const Wtx__V1__InitInfo *init,
                                       const wtx_worker_transport **out) {
  for (size_t i = 0; i < s->cfg.n_transports; i++)
    if (s->cfg.transports[i]->init_case == (int)init->backend_case) {
      *out = s->cfg.transports[i];
      return GRPC_STATUS_OK;
    }
  char names[256] = "";
  for (size_t i = 0, o = 0; i < s->cfg.n_transports && o < sizeof names; i++)
    o += (size_t)snprintf(names + o, sizeof names - o, "%s%s", i ? ", " : "",
                          s->cfg.transports[i]->name);
  /* No member set, or one this worker's schema does not know (which
   * decodes as none), or one it does not serve. */
  const char *member = wtx_init_case_name(init->backend_case);
  if (member == NULL)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                              "init_info.backend: no backend set; this worker "
                              "serves: %s", names);
  return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                            "init_info.backend: '%s' is not served by this "
                            "worker; it serves: %s", member, names);
}

static int takes_boxes(const wtx_session *s);

int wtx__model_adopts_host(const wtx_model_ops *m) {
  return m->version >= 2 && m->adopt_chunk != NULL;
}

/* Replaces the session's engine. Caller holds mu. */
static void adopt_engine(wtx_session *s, const wtx_worker_transport *t,
                         void *engine, const wtx_wire_params *wire) {
  if (s->engine != NULL) s->transport->destroy(s->engine);
  s->engine = engine;
  s->transport = t;
  s->wire = *wire;
  const wtx_model_ops *m = s->cfg.model_ops;
  /* A receive region is used in place where the model adopts its memory:
   * device memory through adopt_device, host memory through adopt_chunk. */
  int dev = t->device != NULL ? t->device(engine) : -1;
  if (t->region == NULL || t->region(engine, &s->region, &s->region_bytes) != 0 ||
      !(dev >= 0 ? m->adopt_device != NULL : wtx__model_adopts_host(m)))
    s->region = NULL;
  s->stage_device = m->stage_device != NULL || (s->region != NULL && dev >= 0) ? dev : -1;
  choose_stage(s);
  new_session_id(s->session_id);
  s->state = WTX__V1__SESSION_STATE__SESSION_STATE_READY;
  s->revertible = 0; /* a new session cannot undo the last one's update */
  char staging[40] = "host";
  if (s->stage_device >= 0)
    snprintf(staging, sizeof staging, "cuda:%d%s", s->stage_device,
             s->region != NULL ? ",in-place" : "");
  else if (s->region != NULL)
    snprintf(staging, sizeof staging, "host,in-place");
  wtx__log(WTX__LOG_INFO, "event=init backend=%s session=%s buffer_size=%llu "
          "num_buffers=%u timeout_ms=%lld staging=%s", t->name, s->session_id,
          (unsigned long long)wire->buffer_size, (unsigned)wire->num_buffers,
          (long long)wire->timeout_ms, staging);
}

/* The fast half of init, under the lock: the session may take a new engine,
 * and the backend checks the handshake and allocates it. */
static grpc_status_code init_begin(wtx_session *s, wtx__rpc_ctx *ctx,
                                   const wtx_worker_transport *t,
                                   const Wtx__V1__InitInfo *init,
                                   const wtx_wire_params *wire, void **engine) {
  char err[512] = "";
  int rc;
  if (s->draining)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_UNAVAILABLE, "worker is draining");
  if (update_open(s))
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "update %llu is active: finish or abort it before "
                              "re-initializing", (unsigned long long)s->update_id);
  if (s->connecting != NULL)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "another InitWeightTransferEngine is connecting");
  if ((rc = t->init(init, wire, s->cfg.env, engine, err, sizeof err)) != 0)
    return from_wtx(ctx, rc, "init_info", err);
  s->connecting = *engine;
  s->connecting_t = t;
  return GRPC_STATUS_OK;
}

static grpc_status_code handle_init(wtx__rpc_ctx *ctx,
    const Wtx__V1__InitWeightTransferEngineRequest *req, Wtx__V1__InitWeightTransferEngineResponse *resp) {
  wtx_session *s = wtx__rpc_ctx_user(ctx);
  const Wtx__V1__InitInfo *init = req->init_info;
  if (init == NULL)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT, "init_info: missing");
  const wtx_worker_transport *t = NULL;
  grpc_status_code code = find_transport(s, ctx, init, &t);
  if (code != GRPC_STATUS_OK) return code;
  char err[512] = "";
  wtx_wire_params wire;
  if (wtx_wire_params_from_init(init, t->default_checksum, &wire, err, sizeof err) != 0)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT, "init_info.%s", err);
  void *engine = NULL;
  char addr[256] = "";
  pthread_mutex_lock(&s->mu);
  code = init_begin(s, ctx, t, init, &wire, &engine);
  pthread_mutex_unlock(&s->mu);
  if (code != GRPC_STATUS_OK) return code;
  /* The blocking part (a connect, a rendezvous) runs outside the lock:
   * inspection answers meanwhile, and drain cancels it. */
  int rc = t->connect != NULL ? t->connect(engine, addr, sizeof addr, err, sizeof err) : 0;
  pthread_mutex_lock(&s->mu);
  s->connecting = NULL;
  s->connecting_t = NULL;
  if (rc != 0) {
    code = from_wtx(ctx, rc, "init_info", err);
  } else if (s->draining) {
    code = wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_UNAVAILABLE, "worker is draining");
  } else if (update_open(s)) {
    code = wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "update %llu started while this init connected",
                              (unsigned long long)s->update_id);
  } else {
    adopt_engine(s, t, engine, &wire);
    engine = NULL;
    resp->session_id = wtx__rpc_ctx_strdup(ctx, s->session_id);
    resp->backend = (char *)t->name;
    resp->data_address = wtx__rpc_ctx_strdup(ctx, addr);
    resp->world_size = s->cfg.world_size;
    resp->refuses_boxes = !takes_boxes(s);
  }
  pthread_mutex_unlock(&s->mu);
  if (engine != NULL) t->destroy(engine);
  return code;
}

/* Tables sized ahead for at most this many tensors, whatever a start says
 * (16 MiB of buckets). */
#define RESERVE_MAX (1u << 20)

/* Opens update target, of `expected` tensors when the trainer said (0:
 * not said). Caller holds mu and has checked the session. */
static grpc_status_code open_update(wtx_session *s, wtx__rpc_ctx *ctx,
                                    wtx_target target, uint32_t expected) {
  if (update_open(s))
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "update %llu is already active: finish or abort "
                              "it first", (unsigned long long)s->update_id);
  if (target == WTX_TARGET_DRAFT && !s->transport->supports_draft)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "target: the %s engine does not support draft "
                              "model updates", s->transport->name);
  if (s->cfg.max_params > 0 && expected > s->cfg.max_params)
    return wtx__rpc_ctx_errorf(ctx, (grpc_status_code)wtx_err_to_grpc(WTX_ETOOBIG),
                              "expected_params: the update would hold %u parameters, "
                              "this worker takes at most %llu (--max-params)", expected,
                              (unsigned long long)s->cfg.max_params);
  int rc = s->cfg.model_ops->begin(s->cfg.model, target);
  if (rc != 0) return model_failed(ctx, rc, "model", "cannot begin an update");
  s->revertible = 0; /* begin released what the last commit replaced */
  s->update_id++;
  update_reset(s);
  s->up.target = target;
  s->state = WTX__V1__SESSION_STATE__SESSION_STATE_UPDATING;
  if (expected > 0)
    wtx__layout_reserve(&s->up.cur, expected < RESERVE_MAX ? expected : RESERVE_MAX);
  wtx__rx_reset(s->rx);
  s->last_activity_ms = wtx__clock_ms();
  wtx__log(WTX__LOG_INFO, "event=start update=%llu target=%s",
          (unsigned long long)s->update_id,
          target == WTX_TARGET_DRAFT ? "draft" : "main");
  return GRPC_STATUS_OK;
}

/* A delta's fence: it opens only on the version it was computed from, so a
 * worker that missed a step, restarted or was undone never carries over
 * tensors the trainer believes replaced. */
static grpc_status_code check_base(wtx__rpc_ctx *ctx, const char *base, const char *serves) {
  if (base[0] == '\0' || strcmp(base, serves) == 0) return GRPC_STATUS_OK;
  return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                             "base_version: the delta applies to version '%s', and this "
                             "worker serves %s%s%s: send the whole model", base,
                             serves[0] ? "'" : "no version yet", serves, serves[0] ? "'" : "");
}

/* Whether a delta may carry patches here: the model reads its tensors (or
 * a tensor-parallel rank's parts) back, and stages on the host, where the
 * session applies them, or on a GPU the backend copies to from the host
 * (put_box; see bounce), but not in place in a receive region. Caller
 * holds mu. */
static int takes_patches(const wtx_session *s) {
  return s->cfg.model_ops->read != NULL && s->region == NULL &&
         (s->stage_device < 0 || s->transport->put_box != NULL);
}

static grpc_status_code handle_start(wtx__rpc_ctx *ctx,
    const Wtx__V1__StartWeightUpdateRequest *req, Wtx__V1__StartWeightUpdateResponse *resp) {
  wtx_session *s = wtx__rpc_ctx_user(ctx);
  /* wtx_target holds the wire values; UNSPECIFIED means the main model. */
  wtx_target target = req->target == WTX__V1__UPDATE_TARGET__UPDATE_TARGET_UNSPECIFIED
                          ? WTX_TARGET_MAIN : (wtx_target)req->target;
  if (target != WTX_TARGET_MAIN && target != WTX_TARGET_DRAFT)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                              "target: unknown value %d", req->target);
  grpc_status_code code =
      wtx__check_text(ctx, "base_version", req->base_version, WTX_MAX_VERSION_BYTES);
  if (code != GRPC_STATUS_OK) return code;
  pthread_mutex_lock(&s->mu);
  char serves[WTX_MAX_VERSION_BYTES + 1];
  code = check_session(s, ctx, req->session_id);
  if (code == GRPC_STATUS_OK) wtx__session_served(s, target, serves, sizeof serves);
  if (code == GRPC_STATUS_OK) code = check_base(ctx, req->base_version, serves);
  if (code == GRPC_STATUS_OK) code = open_update(s, ctx, target, req->expected_params);
  if (code == GRPC_STATUS_OK) {
    s->up.delta = req->base_version[0] != '\0';
    resp->update_id = s->update_id;
    resp->table_xxh3 = s->tb.xxh3[target == WTX_TARGET_DRAFT];
    resp->weight_version = wtx__rpc_ctx_strdup(ctx, serves);
    resp->patches = takes_patches(s);
    /* the session applies spans, boxes too, wherever it applies patches */
    resp->patch_spans = resp->patch_boxes = resp->patches;
    resp->chunk_batches = 1;
    resp->ordered_calls = 1;
  }
  pthread_mutex_unlock(&s->mu);
  return code;
}


/* The box a ParamMeta's part covers (the whole tensor without one) into
 * *box, and the whole tensor into *full: WTX_EINVAL when the part does not
 * fit its shape. */
static int part_box(const Wtx__V1__ParamMeta *pm, const wtx_tensor_meta *meta, size_t i,
                    wtx_tensor_meta *full, wtx_box *box, char *err, size_t errlen) {
  const Wtx__V1__TensorPart *pt = pm->part;
  *full = *meta;
  wtx_box_whole(meta, box);
  if (pt == NULL) return 0;
  char why[1400];
  if (pt->n_full_shape != meta->ndim || pt->n_offset != meta->ndim) {
    snprintf(err, errlen, "update_info.params[%zu].part: full_shape and offset need %zu "
             "entries each, as shape", i, meta->ndim);
    return WTX_EINVAL;
  }
  if (wtx_tensor_meta_set(full, meta->name, meta->dtype, pt->full_shape, pt->n_full_shape, why,
                          sizeof why) != 0) {
    snprintf(err, errlen, "update_info.params[%zu].part.full_%s", i, why);
    return WTX_EINVAL;
  }
  for (size_t d = 0; d < meta->ndim; d++) {
    box->lo[d] = pt->offset[d];
    if (pt->offset[d] > full->shape[d] || meta->shape[d] > full->shape[d] - pt->offset[d]) {
      snprintf(err, errlen, "update_info.params[%zu].part: dim %zu [%llu, +%llu) is past the "
               "full shape's %llu", i, d, (unsigned long long)pt->offset[d],
               (unsigned long long)meta->shape[d], (unsigned long long)full->shape[d]);
      return WTX_EINVAL;
    }
  }
  return 0;
}

/* A tensor-parallel worker takes exactly the part its rules give it of each
 * tensor; any other worker takes whole tensors only. */
static int check_part(wtx_session *s, const Wtx__V1__ParamMeta *pm, size_t i,
                      const wtx_tensor_meta *meta, char *err, size_t errlen) {
  const wtx__session_config *c = &s->cfg;
  if (c->shard_rules == NULL && pm->part == NULL) return 0;
  if (c->shard_rules == NULL) {
    snprintf(err, errlen, "update_info.params[%zu].part: this worker holds whole tensors "
             "(it has no shard rules)", i);
    return WTX_EINVAL;
  }
  wtx_tensor_meta full;
  wtx_box got, want;
  wtx_slice sl;
  int rc = part_box(pm, meta, i, &full, &got, err, errlen);
  if (rc != 0) return rc;
  rc = wtx_shard_slice_of(&full, c->shard_rules, c->n_shard_rules, c->tp_rank, c->tp_size, 0,
                          &sl, err, errlen);
  if (rc < 0) return rc;
  if (rc == 0) {
    snprintf(err, errlen, "update_info.params[%zu]: '%s' is not held by tensor-parallel rank "
             "%u of %u (its shard rules)", i, meta->name, c->tp_rank, c->tp_size);
    return WTX_EINVAL;
  }
  wtx_slice_box(&full, &sl, &want);
  if (wtx_box_equal(&got, &want)) return 0;
  size_t d = 0;
  while (got.lo[d] == want.lo[d] && got.len[d] == want.len[d]) d++; /* the dim that differs */
  snprintf(err, errlen, "update_info.params[%zu].part: '%s' on tensor-parallel rank %u of %u "
           "is [%llu, +%llu) of dim %zu, not [%llu, +%llu)", i, meta->name, c->tp_rank,
           c->tp_size, (unsigned long long)want.lo[d], (unsigned long long)want.len[d], d,
           (unsigned long long)got.lo[d], (unsigned long long)got.len[d]);
  return WTX_EINVAL;
}

/* Validates one ParamMeta into meta (no byte has moved yet). */
static int check_meta(wtx_session *s, const Wtx__V1__ParamMeta *pm, size_t i,
                      wtx_tensor_meta *meta, char *err, size_t errlen) {
  char why[1400];
  int rc = wtx_tensor_meta_set(meta, pm->name, pm->dtype, pm->shape, pm->n_shape,
                               why, sizeof why);
  if (rc != 0) {
    snprintf(err, errlen, "update_info.params[%zu].%s", i, why);
    return rc;
  }
  if (!wtx__utf8_valid(pm->name)) {
    snprintf(err, errlen, "update_info.params[%zu].name: not valid UTF-8", i);
    return WTX_EINVAL;
  }
  rc = check_part(s, pm, i, meta, err, errlen);
  return rc != 0 || s->steps.check_one == NULL ? rc : s->steps.check_one(s, meta, err, errlen);
}

/* One UpdateWeights call's chunk: its validated tensors and where their
 * bytes go. */
typedef struct wtx__chunk {
  const Wtx__V1__UpdateInfo *ui;
  uint64_t bytes; /* the chunk's, once its tensors are staged */
  size_t n;
  /* The session's: its table's when named by range or when each is a new
   * entry of the update's table (chunk_check_frame), else its scratch (as rt and
   * dst); valid until the chunk ends. */
  wtx_tensor_meta *metas;
  int by_range;
  wtx_rx_tensor *rt;
  uint8_t **dst; /* stage_chunk's answers, n of them */
  int receive_failed; /* the failure is the data plane's */
  /* Its patches (ParamMeta.patch), in order: each received apart, into
   * wire, then applied to the base's copy in the tensor's staging. */
  struct patch_slot {
    size_t i; /* the chunk's tensor */
    const Wtx__V1__Patch *p;
    uint64_t bytes; /* on the wire */
    uint8_t *full;  /* the model's staging of the whole tensor */
    uint8_t *wire;  /* the patch, received (malloc'd; or the update's spans') */
    int carried;    /* a patch of spans the chunk before began (up.spans) */
  } *patches;
  size_t n_patches;
  /* A box of one tensor (UpdateInfo.box): its box in the tensor, the
   * tensor's, and its bytes, received into wire, then scattered into the
   * tensor's staging. */
  struct {
    wtx_box box, whole;
    uint64_t bytes;
    uint8_t *wire;
  } boxed;
  /* Device staging received on the host (bounce): per tensor its host
   * copy (malloc'd, the chunk's until freed or handed to up.bounce_host) and
   * its device staging. NULL: received where it is staged. */
  uint8_t **host, **dev;
  /* Once received: the tensors it completed, their checksums (NULL: none
   * whole), a patched one's the whole tensor's (chunk_settle). */
  size_t done;
  const uint64_t *sums;
  char err[1600];
} chunk;

static void chunk_free(chunk *c) {
  for (size_t i = 0; c->host != NULL && i < c->n; i++) free(c->host[i]);
  free(c->host);
  free(c->dev);
  free(c->boxed.wire);
  for (size_t k = 0; k < c->n_patches; k++)
    if (!c->patches[k].carried) free(c->patches[k].wire);
  free(c->patches);
}

/* Span sp of tensor m read as a tensor of its own: flat, its elements. */
static wtx_tensor_meta span_meta(const wtx_tensor_meta *m, const Wtx__V1__PatchSpan *sp) {
  return (wtx_tensor_meta){.name = m->name, .dtype = m->dtype, .ndim = 1,
                           .shape = {sp->elements},
                           .nbytes = sp->elements * wtx_dtype_size(m->dtype)};
}

/* Spans' boxes a patch checks pairwise for overlap; past them, with a
 * bit per element of the tensor (a trainer's pieces are few: its ranks'). */
enum { BOX_PAIRS = 64 };

/* PatchSpan box bx of tensor m into *box: 1 when it lies within m (an
 * offset and a shape of at least 1 per dim). */
static int span_box(const wtx_tensor_meta *m, const Wtx__V1__Box *bx, wtx_box *box) {
  int ok = bx->n_offset == m->ndim && bx->n_shape == m->ndim;
  box->ndim = m->ndim;
  for (size_t d = 0; ok && d < m->ndim; d++) {
    ok = bx->shape[d] > 0 && bx->offset[d] <= m->shape[d] &&
         bx->shape[d] <= m->shape[d] - bx->offset[d];
    box->lo[d] = bx->offset[d];
    box->len[d] = bx->shape[d];
  }
  return ok;
}

static int boxes_meet(const wtx_box *a, const wtx_box *b) {
  for (size_t d = 0; d < a->ndim; d++)
    if (a->lo[d] >= b->lo[d] + b->len[d] || b->lo[d] >= a->lo[d] + a->len[d]) return 0;
  return 1;
}

/* Span sp's box (PatchSpan.box) of tensor i, spans[j] of its patch p:
 * within the tensor, its first 0 and elements the box's, and clear of the
 * boxes before it (compared with each, or marked in *marks, made at the
 * first, where the patch has many). */
static int check_span_box(chunk *c, size_t i, const Wtx__V1__Patch *p, size_t j,
                          uint64_t **marks) {
  const wtx_tensor_meta *m = &c->metas[i];
  const Wtx__V1__PatchSpan *sp = p->spans[j];
  wtx_box whole, box, other;
  wtx_box_whole(m, &whole);
  if (!span_box(m, sp->box, &box) || sp->first != 0 || sp->elements != wtx_box_elements(&box)) {
    snprintf(c->err, sizeof c->err, "update_info.params[%zu].patch.spans[%zu].box: must lie "
             "within '%s' (an offset and a shape of at least 1 per dim), with first 0 and "
             "elements its own", i, j, m->name);
    return WTX_EINVAL;
  }
  int meets = 0;
  for (size_t k = 0; p->n_spans <= BOX_PAIRS && !meets && k < j; k++)
    meets = span_box(m, p->spans[k]->box, &other) && boxes_meet(&box, &other);
  if (p->n_spans > BOX_PAIRS && *marks == NULL &&
      (*marks = calloc(wtx_box_elements(&whole) / 64 + 1, 8)) == NULL)
    return WTX_ENOMEM;
  if (p->n_spans > BOX_PAIRS) meets = wtx_box_mark(*marks, &whole, &box) != 0;
  if (!meets) return 0;
  snprintf(c->err, sizeof c->err, "update_info.params[%zu].patch.spans[%zu].box: overlaps a "
           "box before it in '%s'", i, j, m->name);
  return WTX_EINVAL;
}

/* Tensor i's patch p checked, *bytes its bytes on the wire: before they
 * come (wire NULL) its form, once they are in (at wire) every index too,
 * so nothing is applied before all of it checks. A whole-tensor patch,
 * or each span's, within the tensor and after the span before. */
static int check_patch_bytes(chunk *c, size_t i, const Wtx__V1__Patch *p, const uint8_t *wire,
                             uint64_t *bytes) {
  const wtx_tensor_meta *m = &c->metas[i];
  const char *then = wire != NULL ? " (nothing applied)" : "";
  size_t es = wtx_dtype_size(m->dtype);
  char why[1200];
  if (p->n_spans == 0) {
    *bytes = wtx__patch_bytes(p->index_dtype, p->count, es);
    int rc = wtx__patch_check(m, p->index_dtype, p->count, wire, *bytes, why, sizeof why);
    if (rc != 0) snprintf(c->err, sizeof c->err, "update_info.params[%zu].%s%s", i, why, then);
    return rc;
  }
  if (p->count != 0 || p->index_dtype != 0) {
    snprintf(c->err, sizeof c->err, "update_info.params[%zu].patch: count and index_dtype "
             "are each span's where spans are set", i);
    return WTX_EINVAL;
  }
  uint64_t elements = m->nbytes / es, end = 0;
  uint64_t *marks = NULL; /* boxes: the elements they cover so far */
  int rc = 0;
  *bytes = 0;
  for (size_t j = 0; rc == 0 && j < p->n_spans; j++) {
    const Wtx__V1__PatchSpan *sp = p->spans[j];
    if ((sp->box != NULL) != (p->spans[0]->box != NULL)) {
      snprintf(c->err, sizeof c->err, "update_info.params[%zu].patch.spans[%zu]: a patch's "
               "spans are all boxes or none", i, j);
      rc = WTX_EINVAL;
    } else if (sp->box != NULL) {
      if (wire == NULL) rc = check_span_box(c, i, p, j, &marks); /* the form, once */
    } else if (sp->elements == 0 || sp->first < end || sp->first > elements ||
               sp->elements > elements - sp->first) {
      snprintf(c->err, sizeof c->err, "update_info.params[%zu].patch.spans[%zu]: [%llu, +%llu) "
               "must lie within the %llu elements of '%s', after the span before", i, j,
               (unsigned long long)sp->first, (unsigned long long)sp->elements,
               (unsigned long long)elements, m->name);
      rc = WTX_EINVAL;
    }
    if (rc != 0) break;
    wtx_tensor_meta flat = span_meta(m, sp);
    uint64_t n = wtx__patch_bytes(sp->index_dtype, sp->count, es);
    rc = wtx__patch_check(&flat, sp->index_dtype, sp->count, wire != NULL ? wire + *bytes : NULL,
                          n, why, sizeof why);
    if (rc != 0)
      snprintf(c->err, sizeof c->err, "update_info.params[%zu].patch.spans[%zu]: %s%s", i, j,
               why, then);
    *bytes += n;
    end = sp->first + sp->elements;
  }
  free(marks);
  return rc;
}

/* A continued tensor's patch goes on the patch of spans the chunk before
 * left open, of the same bytes; a whole-tensor patch lies in one chunk. */
static int check_carried(wtx_session *s, chunk *c, size_t i, uint64_t bytes) {
  const Wtx__V1__Patch *p = c->ui->params[i]->patch;
  if (p->n_spans == 0) {
    snprintf(c->err, sizeof c->err, "update_info.params[%zu].patch: a patch lies within one "
             "chunk, and '%s' continues the chunk before", i, c->metas[i].name);
    return WTX_EINVAL;
  }
  if (s->up.spans.wire != NULL && bytes == s->up.spans.bytes) return 0;
  snprintf(c->err, sizeof c->err, "update_info.params[%zu].patch: '%s' continues the chunk "
           "before, which began %s; its spans take %llu bytes", i, c->metas[i].name,
           s->up.spans.wire != NULL ? "a patch of other bytes" : "no patch of spans",
           (unsigned long long)bytes);
  return WTX_EINVAL;
}

/* Tensor i of the chunk is a patch: refused unless this is a delta, this
 * worker takes patches (of spans, where it has them) and the patch is
 * valid, in the chunk's tensors as sent (a whole-tensor one not continued
 * from the chunk before; one of spans only from a patch of spans); else
 * its slot. */
static int check_patch(wtx_session *s, chunk *c, size_t i, int continues) {
  const Wtx__V1__Patch *p = c->ui->params[i]->patch;
  if (!s->up.delta) {
    snprintf(c->err, sizeof c->err, "update_info.params[%zu].patch: a patch applies only in "
             "a delta update (StartWeightUpdateRequest.base_version)", i);
    return WTX_EINVAL;
  }
  if (!takes_patches(s)) {
    snprintf(c->err, sizeof c->err, "update_info.params[%zu].patch: this worker takes whole "
             "tensors only (StartWeightUpdateResponse.patches)", i);
    return WTX_ESTATE;
  }
  uint64_t bytes = 0;
  int rc = check_patch_bytes(c, i, p, NULL, &bytes);
  if (rc == 0 && continues) rc = check_carried(s, c, i, bytes);
  if (rc != 0) return rc;
  struct patch_slot *grown = realloc(c->patches, (c->n_patches + 1) * sizeof *grown);
  if (grown == NULL) return WTX_ENOMEM;
  c->patches = grown;
  c->patches[c->n_patches++] =
      (struct patch_slot){.i = i, .p = p, .bytes = bytes, .carried = continues};
  return 0;
}

/* rc, a per-chunk check's answer: a refusal the model gave no reason for
 * names the tensor it refused (bad). */
static int model_refusal(chunk *c, int rc, size_t bad) {
  if (rc != 0 && c->err[0] == '\0')
    snprintf(c->err, sizeof c->err, "model: refused '%s'", c->metas[bad < c->n ? bad : 0].name);
  return rc;
}

/* ---- the model's steps, one form each (wtx__model_steps) ---- */

/* The model's check of one tensor (its check). */
static int check_each(wtx_session *s, const wtx_tensor_meta *meta, char *err, size_t errlen) {
  return s->cfg.model_ops->check(s->cfg.model, s->up.target, meta, err, errlen);
}

/* The model's check_chunk over the chunk's tensors. */
static int check_chunk(wtx_session *s, chunk *c) {
  size_t bad = 0;
  int rc = s->cfg.model_ops->check_chunk(s->cfg.model, s->up.target, c->metas, c->n, &bad,
                                         c->err, sizeof c->err);
  return model_refusal(c, rc, bad);
}

/* A chunk named by range in table `table`, checked by the model's
 * check_range. */
static int check_range(wtx_session *s, chunk *c, uint64_t table) {
  size_t bad = 0;
  int rc = s->cfg.model_ops->check_range(s->cfg.model, s->up.target, table,
                                         c->ui->layout->first, c->metas, c->n, &bad, c->err,
                                         sizeof c->err);
  return model_refusal(c, rc, bad);
}

/* The same where the model has no check_range: as a chunk of params. */
static int check_range_as_params(wtx_session *s, chunk *c, uint64_t table) {
  (void)table;
  int rc = 0;
  for (size_t i = 0; rc == 0 && s->steps.check_one != NULL && i < c->n; i++)
    rc = s->steps.check_one(s, &c->metas[i], c->err, sizeof c->err);
  return rc != 0 || s->steps.check_chunk == NULL ? rc : s->steps.check_chunk(s, c);
}

/* The chunk's first done tensors to the model's loaded_chunk at once;
 * sums: their checksums, or NULL. */
static int loaded_chunk(wtx_session *s, chunk *c, size_t done, const uint64_t *sums) {
  if (done == 0) return 0;
  int rc = s->cfg.model_ops->loaded_chunk(s->cfg.model, c->metas, done, sums);
  if (rc != 0)
    snprintf(c->err, sizeof c->err, "model: cannot load the chunk's %zu tensors (from '%s')",
             done, c->metas[0].name);
  return rc;
}

/* The chunk's first done tensors to the model's loaded, one at a time. */
static int loaded_each(wtx_session *s, chunk *c, size_t done, const uint64_t *sums) {
  for (size_t i = 0; i < done; i++) {
    int rc = s->cfg.model_ops->loaded(s->cfg.model, &c->metas[i], sums ? &sums[i] : NULL);
    if (rc != 0) {
      snprintf(c->err, sizeof c->err, "model: cannot load '%s'", c->metas[i].name);
      return rc;
    }
  }
  return 0;
}

/* The steps that do not depend on where tensors are staged, from the
 * model's ops: a per-chunk form where the model has one. */
static void choose_steps(wtx_session *s) {
  const wtx_model_ops *m = s->cfg.model_ops;
  s->steps.check_one = m->check != NULL && m->check_chunk == NULL ? check_each : NULL;
  s->steps.check_chunk = m->check_chunk != NULL ? check_chunk : NULL;
  s->steps.check_range = m->check_range != NULL ? check_range : check_range_as_params;
  s->steps.loaded = m->loaded_chunk != NULL ? loaded_chunk : loaded_each;
}

/* Room for n tensors in the session's chunk arrays, kept from chunk to
 * chunk (1 MB at 8192 tensors: fresh each chunk, its pages faulted in
 * every time). */
static int scratch_grow(wtx_session *s, size_t n) {
  wtx_rx_tensor *rt = realloc(s->sc.rt, n * sizeof *rt);
  if (rt != NULL) s->sc.rt = rt;
  uint8_t **dst = rt != NULL ? realloc(s->sc.dst, n * sizeof *dst) : NULL;
  if (dst != NULL) s->sc.dst = dst;
  wtx_tensor_meta *m = dst != NULL ? realloc(s->sc.metas, n * sizeof *m) : NULL;
  if (m != NULL) s->sc.metas = m;
  uint64_t *sums = m != NULL ? realloc(s->sc.sums, n * sizeof *sums) : NULL;
  if (sums == NULL) return WTX_ENOMEM;
  s->sc.sums = sums;
  s->sc.n = n;
  return 0;
}

/* Whether this session scatters boxes into staging: on the host, or
 * through its backend into device memory the model stages apart. A model
 * that only adopts tensors in place in the receive region cannot: each
 * lies there at its place in the stream, and boxes arrive packed. */
static int takes_boxes(const wtx_session *s) {
  return s->stage_device < 0 ||
         (s->transport->put_box != NULL &&
          (s->region == NULL || s->cfg.model_ops->stage_device != NULL));
}

/* A box chunk's frame: one tensor, from its first byte, received on the
 * host apart, then scattered into the tensor's staging. */
static int box_frame(wtx_session *s, chunk *c) {
  if (c->n != 1 || c->ui->first_param_offset != 0) {
    snprintf(c->err, sizeof c->err, "update_info.box: a box chunk carries one tensor from its "
             "first byte (this one names %zu, first_param_offset %llu)", c->n,
             (unsigned long long)c->ui->first_param_offset);
    return WTX_EINVAL;
  }
  if (!takes_boxes(s)) {
    snprintf(c->err, sizeof c->err, "update_info.box: this worker's model adopts tensors in "
             "place on its GPU, where boxes cannot be scattered");
    return WTX_ENOTSUP;
  }
  return 0;
}

/* Step 1: the chunk's shape as a whole, and its tensors' memory. */
static int chunk_check_frame(wtx_session *s, chunk *c) {
  const Wtx__V1__UpdateInfo *ui = c->ui;
  int rc;
  c->by_range = ui != NULL && ui->layout != NULL;
  c->n = ui == NULL ? 0 : c->by_range ? ui->layout->count : ui->n_params;
  const char *field = c->by_range ? "update_info.layout.count" : "update_info.params";
  if (c->by_range && ui->n_params > 0) {
    snprintf(c->err, sizeof c->err, "update_info: params and layout are exclusive");
    return WTX_EINVAL;
  }
  if (s->up.by_range >= 0 && s->up.by_range != c->by_range) {
    snprintf(c->err, sizeof c->err, "update_info.%s: update %llu named its tensors by "
             "%s; an update names them one way throughout", c->by_range ? "layout" : "params",
             (unsigned long long)s->update_id, s->up.by_range ? "layout" : "params");
    return WTX_EINVAL;
  }
  if (c->n == 0 || c->n > WTX_MAX_CHUNK_PARAMS) {
    snprintf(c->err, sizeof c->err, "%s: %zu parameters, must be 1..%d", field, c->n,
             WTX_MAX_CHUNK_PARAMS);
    return WTX_EINVAL;
  }
  if ((int)ui->backend_case != s->transport->update_case) {
    const char *member = wtx_update_case_name(s->transport->update_case);
    snprintf(c->err, sizeof c->err, "update_info.%s: missing (the session's "
             "backend is %s)", member != NULL ? member : "backend", s->transport->name);
    return WTX_EINVAL;
  }
  if (ui->box != NULL && (rc = box_frame(s, c)) != 0) return rc;
  if (c->n > s->sc.n && scratch_grow(s, c->n) != 0) return WTX_ENOMEM;
  c->rt = s->sc.rt; /* every field set by chunk_stage */
  c->dst = s->sc.dst;
  if (!c->by_range) c->metas = s->sc.metas; /* each set by check_meta */
  /* A chunk of whole new tensors is checked straight into the update's
   * table (each meta becomes its table entry as it is added), not into
   * the scratch and then copied: at 40k tensors the copy is megabytes, each
   * page a fault in a new worker. A chunk that continues a tensor (or
   * boxes one) adds fewer than it names, so it uses the scratch. */
  if (!c->by_range && ui->box == NULL && ui->first_param_offset == 0) {
    if (wtx__layout_room(&s->up.cur, c->n) != 0) return WTX_ENOMEM;
    c->metas = &s->up.cur.metas[s->up.cur.n];
  }
  return 0;
}

/* The update's size against the worker's limits, counting every tensor
 * begun so far. */
static int check_limits(wtx_session *s, chunk *c) {
  size_t params = c->by_range ? s->up.range_next : s->up.cur.n;
  if (s->cfg.max_params > 0 && params > s->cfg.max_params) {
    snprintf(c->err, sizeof c->err, "update_info.params: the update would hold %zu "
             "parameters, this worker takes at most %llu (--max-params)", params,
             (unsigned long long)s->cfg.max_params);
    return WTX_ETOOBIG;
  }
  if (s->cfg.max_model_bytes > 0 && s->up.begun_bytes > s->cfg.max_model_bytes) {
    snprintf(c->err, sizeof c->err, "update_info.params: the update would hold %llu "
             "bytes, this worker takes at most %llu (--max-model-bytes)",
             (unsigned long long)s->up.begun_bytes, (unsigned long long)s->cfg.max_model_bytes);
    return WTX_ETOOBIG;
  }
  return 0;
}

/* ---- tensors sent in boxes (UpdateInfo.box) ---- */

/* The open boxed tensor's meta: in this update's params, or in the table
 * its layout ranges name. */
static const wtx_tensor_meta *boxed_meta(const wtx_session *s) {
  const wtx__layout *l = s->up.by_range == 1
                             ? &s->tb.table[s->up.target == WTX_TARGET_DRAFT]
                             : &s->up.cur;
  return &l->metas[s->up.boxed.pos];
}

/* The refusal of anything but the next box of the open boxed tensor,
 * naming field. */
static int box_stray(wtx_session *s, chunk *c, const char *field) {
  const wtx_tensor_meta *m = boxed_meta(s);
  snprintf(c->err, sizeof c->err, "%s: '%s' came in boxes, %llu of its %llu bytes so far; "
           "its boxes cover it before the next tensor begins", field, m->name,
           (unsigned long long)s->up.boxed.covered, (unsigned long long)m->nbytes);
  return WTX_EINVAL;
}

/* Whether this chunk continues the open boxed tensor (*boxed); while one
 * is open, nothing else may come until its boxes cover it. */
static int box_next(wtx_session *s, chunk *c, int *boxed) {
  *boxed = s->up.boxed.open;
  return !*boxed || c->ui->box != NULL ? 0 : box_stray(s, c, "update_info.box");
}

/* A chunk of params continuing the open boxed tensor names it again. */
static int box_same(wtx_session *s, chunk *c) {
  const wtx_tensor_meta *m = boxed_meta(s);
  if (strcmp(m->name, c->metas[0].name) == 0 && m->nbytes == c->metas[0].nbytes) return 0;
  return box_stray(s, c, "update_info.params[0]");
}

/* The chunk's box into c->boxed: within its tensor (c->metas[0]). */
static int box_read(chunk *c) {
  const Wtx__V1__Box *bx = c->ui->box;
  const wtx_tensor_meta *m = &c->metas[0];
  if (bx->n_offset != m->ndim || bx->n_shape != m->ndim) {
    snprintf(c->err, sizeof c->err, "update_info.box: offset and shape need %zu entries each, "
             "as '%s' has dims", m->ndim, m->name);
    return WTX_EINVAL;
  }
  wtx_box_whole(m, &c->boxed.whole);
  c->boxed.box.ndim = m->ndim;
  for (size_t d = 0; d < m->ndim; d++) {
    if (bx->shape[d] == 0 || bx->offset[d] > m->shape[d] ||
        bx->shape[d] > m->shape[d] - bx->offset[d]) {
      snprintf(c->err, sizeof c->err, "update_info.box: dim %zu [%llu, +%llu) is not within "
               "'%s''s %llu (a box holds at least one element per dim)", d,
               (unsigned long long)bx->offset[d], (unsigned long long)bx->shape[d], m->name,
               (unsigned long long)m->shape[d]);
      return WTX_EINVAL;
    }
    c->boxed.box.lo[d] = bx->offset[d];
    c->boxed.box.len[d] = bx->shape[d];
  }
  c->boxed.bytes = wtx_box_elements(&c->boxed.box) * wtx_dtype_size(m->dtype);
  if (c->ui->chunk_bytes == 0 || c->ui->chunk_bytes == c->boxed.bytes) return 0;
  snprintf(c->err, sizeof c->err, "update_info.chunk_bytes: %llu, and the box of '%s' holds "
           "%llu", (unsigned long long)c->ui->chunk_bytes, m->name,
           (unsigned long long)c->boxed.bytes);
  return WTX_EINVAL;
}

/* The chunk's box, checked and marked in its tensor's elements received
 * so far; its tensor opens with its first box (boxed: it is open). */
static int box_check(wtx_session *s, chunk *c, int boxed) {
  struct wtx__boxed *b = &s->up.boxed;
  if (!c->by_range && c->ui->params[0]->patch != NULL) {
    snprintf(c->err, sizeof c->err, "update_info.box: '%s' is a patch, which travels whole",
             c->metas[0].name);
    return WTX_EINVAL;
  }
  int rc = box_read(c);
  if (rc != 0) return rc;
  if (!boxed) {
    uint64_t words = (wtx_box_elements(&c->boxed.whole) + 63) / 64;
    if ((b->bits = calloc(words ? words : 1, sizeof *b->bits)) == NULL) return WTX_ENOMEM;
    b->open = 1;
    b->pos = c->by_range ? c->ui->layout->first : s->up.cur.n - 1;
  }
  if (wtx_box_mark(b->bits, &c->boxed.whole, &c->boxed.box) != 0) {
    snprintf(c->err, sizeof c->err, "update_info.box: overlaps a box of '%s' sent before",
             c->metas[0].name);
    return WTX_EINVAL;
  }
  b->covered += c->boxed.bytes;
  return 0;
}

/* The box's bytes are received apart, then scattered into its tensor's
 * staging, which its first box staged. */
static int box_stage(wtx_session *s, chunk *c) {
  s->up.boxed.dst = c->rt[0].dst;
  if ((c->boxed.wire = malloc(c->boxed.bytes)) == NULL) return WTX_ENOMEM;
  c->rt[0].dst = c->boxed.wire;
  c->rt[0].nbytes = c->boxed.bytes;
  return 0;
}

/* The received box into its tensor's staging, on the host or through
 * the backend onto the GPU; called while receiving, outside the lock. */
static int box_put(wtx_session *s, chunk *c) {
  size_t es = wtx_dtype_size(c->metas[0].dtype);
  if (s->stage_device >= 0)
    return s->transport->put_box(s->engine, s->up.boxed.dst, &c->boxed.whole, c->boxed.wire,
                                 &c->boxed.box, es, c->err, sizeof c->err);
  wtx_box_copy(s->up.boxed.dst, &c->boxed.whole, c->boxed.wire, NULL, &c->boxed.box, es);
  return 0;
}

/* A box in place. Until its boxes cover the tensor it is not complete
 * (*done 0); once they do, *sums (when not NULL) becomes its whole
 * checksum, read back as span sums' are: none from device staging, which
 * is not read back. */
static void box_scatter(wtx_session *s, chunk *c, size_t *done, const uint64_t **sums) {
  struct wtx__boxed *b = &s->up.boxed;
  const wtx_tensor_meta *m = &c->metas[0];
  if (b->covered < m->nbytes) {
    *done = 0;
    return;
  }
  if (*sums != NULL && s->stage_device >= 0) {
    *sums = NULL;
  } else if (*sums != NULL) {
    s->sc.sums[0] = XXH3_64bits(b->dst, m->nbytes);
    *sums = s->sc.sums;
  }
  free(b->bits);
  *b = (struct wtx__boxed){0};
}

/* Step 2, for a chunk named by range: the range is the next of this
 * update in the table the worker announced; its tensors, valid when that
 * update sent them, are checked against the model again. */
static int chunk_check_range(wtx_session *s, chunk *c, int boxed) {
  const Wtx__V1__ParamRange *r = c->ui->layout;
  int t = s->up.target == WTX_TARGET_DRAFT;
  const wtx__layout *l = &s->tb.table[t];
  if (l->n == 0 || r->table_xxh3 != s->tb.xxh3[t]) {
    snprintf(c->err, sizeof c->err, "update_info.layout.table_xxh3: %016llx is not "
             "this worker's table (%016llx, %zu parameters); send params",
             (unsigned long long)r->table_xxh3, (unsigned long long)s->tb.xxh3[t], l->n);
    return WTX_ESTATE;
  }
  int continues = c->ui->first_param_offset > 0 || boxed;
  size_t want = continues && s->up.range_next > 0 ? s->up.range_next - 1 : s->up.range_next;
  if (r->first != want || (uint64_t)r->first + r->count > l->n) {
    snprintf(c->err, sizeof c->err, "update_info.layout: [%u, +%u) must start at %zu "
             "and lie within the table's %zu parameters", r->first, r->count, want, l->n);
    return WTX_EINVAL;
  }
  c->metas = &l->metas[r->first];
  int rc = s->steps.check_range(s, c, s->tb.id[t]);
  if (rc != 0) return rc;
  s->up.begun_bytes += wtx__layout_bytes(l, r->first + continues, c->n - continues);
  s->up.range_next = (size_t)r->first + r->count;
  return check_limits(s, c);
}

/* Step 2, for a chunk of params: every tensor valid and new to this
 * update. A tensor continued from the previous chunk, or the next box of
 * the boxed tensor open (boxed), is not new. */
static int chunk_check_params(wtx_session *s, chunk *c, int boxed) {
  uint64_t have = 0, want = 0;
  const char *carry = wtx__rx_incomplete(s->rx, &have, &want);
  for (size_t i = 0; i < c->n; i++) {
    if (i + 8 < c->n && c->ui->params[i + 8]->name != NULL)
      wtx__layout_prefetch(&s->up.cur, c->ui->params[i + 8]->name);
    int rc = check_meta(s, c->ui->params[i], i, &c->metas[i], c->err, sizeof c->err);
    if (rc != 0) return rc;
    int continues = i == 0 && c->ui->first_param_offset > 0 && carry != NULL &&
                    strcmp(carry, c->metas[0].name) == 0;
    if (boxed && (rc = box_same(s, c)) != 0) return rc;
    continues |= boxed;
    if (c->ui->params[i]->patch != NULL && (rc = check_patch(s, c, i, continues)) != 0)
      return rc;
    if (continues) continue;
    rc = wtx__layout_add(&s->up.cur, &c->metas[i]);
    if (rc == WTX_EEXIST) {
      snprintf(c->err, sizeof c->err, "update_info.params[%zu].name: '%s' appears "
               "twice in update %llu", i, c->metas[i].name,
               (unsigned long long)s->update_id);
      return WTX_EINVAL;
    }
    if (rc != 0) return rc;
    s->up.begun_bytes += c->metas[i].nbytes;
  }
  int rc = s->steps.check_chunk != NULL ? s->steps.check_chunk(s, c) : 0;
  return rc != 0 ? rc : check_limits(s, c);
}

/* Step 2: every tensor valid and new to this update, before any byte
 * moves; a box within its tensor and clear of its earlier boxes. */
static int chunk_check_tensors(wtx_session *s, chunk *c) {
  int boxed;
  int rc = box_next(s, c, &boxed);
  if (rc != 0) return rc;
  s->up.by_range = c->by_range;
  rc = c->by_range ? chunk_check_range(s, c, boxed) : chunk_check_params(s, c, boxed);
  return rc != 0 || c->ui->box == NULL ? rc : box_check(s, c, boxed);
}

/* Tensor i, beginning at byte `at` of the update's stream, staged in
 * place in the backend's receive region (its rt's dst set). */
static int in_region(wtx_session *s, chunk *c, size_t i, uint64_t at) {
  const wtx_tensor_meta *meta = &c->metas[i];
  if (at > s->region_bytes || meta->nbytes > s->region_bytes - at) {
    snprintf(c->err, sizeof c->err, "update_info: '%s' ends past byte %llu of the update, "
             "beyond the %llu-byte receive region the trainer asked for at init",
             meta->name, (unsigned long long)(at + meta->nbytes),
             (unsigned long long)s->region_bytes);
    return WTX_EINVAL;
  }
  c->rt[i].dst = s->region + at;
  return 0;
}

/* The same, on a GPU, adopted there by the model (adopt_device). */
static int stage_in_place(wtx_session *s, chunk *c, size_t i, uint64_t at) {
  int rc = in_region(s, c, i, at);
  return rc != 0 ? rc
                 : s->cfg.model_ops->adopt_device(s->cfg.model, &c->metas[i], s->stage_device,
                                                  c->rt[i].dst);
}

/* Tensors [first, n) at once, beginning at byte `at`, in place in the
 * backend's host region, adopted there by the model (adopt_chunk). */
static int stage_host_in_place(wtx_session *s, chunk *c, size_t first, uint64_t at) {
  if (first == c->n) return 0;
  for (size_t i = first; i < c->n; at += c->metas[i++].nbytes) {
    int rc = in_region(s, c, i, at);
    if (rc != 0) return rc;
    c->dst[i - first] = c->rt[i].dst;
  }
  int rc = s->cfg.model_ops->adopt_chunk(s->cfg.model, &c->metas[first], c->n - first,
                                         (const uint8_t *const *)c->dst);
  if (rc != 0 && c->err[0] == '\0')
    snprintf(c->err, sizeof c->err, "model: cannot adopt the chunk's %zu tensors (from '%s')",
             c->n - first, c->metas[first].name);
  return rc;
}

/* A tensor staged in device memory the model gives (stage_device). */
static int stage_on_device(wtx_session *s, chunk *c, size_t i, uint64_t at) {
  (void)at;
  return s->cfg.model_ops->stage_device(s->cfg.model, &c->metas[i], s->stage_device,
                                        (void **)&c->rt[i].dst);
}

/* A tensor staged in host memory the model gives (stage). */
static int stage_on_host(wtx_session *s, chunk *c, size_t i, uint64_t at) {
  (void)at;
  return s->cfg.model_ops->stage(s->cfg.model, &c->metas[i], &c->rt[i].dst);
}

/* Tensors [first, n) one at a time, by one of the three above. */
static int stage_each(wtx_session *s, chunk *c, size_t first, uint64_t at,
                      int (*one)(wtx_session *, chunk *, size_t, uint64_t)) {
  for (size_t i = first; i < c->n; at += c->metas[i++].nbytes) {
    int rc = one(s, c, i, at);
    if (rc != 0) {
      if (c->err[0] == '\0')
        snprintf(c->err, sizeof c->err, "model: cannot stage '%s'", c->metas[i].name);
      return rc;
    }
  }
  return 0;
}

static int stage_each_in_place(wtx_session *s, chunk *c, size_t first, uint64_t at) {
  return stage_each(s, c, first, at, stage_in_place);
}
static int stage_each_on_device(wtx_session *s, chunk *c, size_t first, uint64_t at) {
  return stage_each(s, c, first, at, stage_on_device);
}
static int stage_each_on_host(wtx_session *s, chunk *c, size_t first, uint64_t at) {
  return stage_each(s, c, first, at, stage_on_host);
}

/* Host staging for tensors [first, n) at once, through the model's
 * stage_chunk. */
static int stage_host_chunk(wtx_session *s, chunk *c, size_t first, uint64_t at) {
  (void)at;
  if (first == c->n) return 0;
  int rc = s->cfg.model_ops->stage_chunk(s->cfg.model, &c->metas[first], c->n - first, c->dst);
  if (rc != 0) {
    snprintf(c->err, sizeof c->err, "model: cannot stage the chunk's %zu tensors (from '%s')",
             c->n - first, c->metas[first].name);
    return rc;
  }
  for (size_t i = first; i < c->n; i++) c->rt[i].dst = c->dst[i - first];
  return 0;
}

/* Host staging the model gives: per chunk where it can. */
static int host_staging(wtx_session *s, chunk *c, size_t first, uint64_t at) {
  return s->cfg.model_ops->stage_chunk != NULL ? stage_host_chunk(s, c, first, at)
                                               : stage_each_on_host(s, c, first, at);
}

/* Where the session's tensors are staged, once its backend says: in
 * place in its receive region, on its GPU, or on the host (per chunk where
 * the model can). */
static void choose_stage(wtx_session *s) {
  s->steps.stage = s->region != NULL && s->stage_device >= 0 ? stage_each_in_place
                   : s->region != NULL                       ? stage_host_in_place
                   : s->stage_device >= 0                    ? stage_each_on_device
                                                             : host_staging;
}

/* A patch applies on the host (apply_patch), and a chunk is received into
 * host or device memory, not both. So where tensors are staged on a GPU,
 * a chunk that carries patches, or continues a tensor such a chunk began,
 * is received on the host: each of its tensors into a host copy (a
 * bounce), then put into its device staging through the backend (put_box)
 * once its bytes are in, a patched one once applied. Only deltas bounce,
 * and a delta's tensors are the few that changed. */
static int bounces(const wtx_session *s, const chunk *c) {
  return s->stage_device >= 0 && c->ui->box == NULL &&
         (c->n_patches > 0 || s->up.bounce_host != NULL);
}

/* Host copies of the chunk's tensors, their device staging kept in dev; a
 * tensor continued from the chunk before (its device staging carry_dst)
 * keeps its copy (up.bounce_host) or, begun on the device, gets a new one,
 * which holds only this chunk's bytes of it (so the chunk is received
 * WTX__RX_UNREAD). */
static int bounce_stage(wtx_session *s, chunk *c, size_t first) {
  if ((c->host = calloc(c->n, sizeof *c->host)) == NULL ||
      (c->dev = calloc(c->n, sizeof *c->dev)) == NULL)
    return WTX_ENOMEM;
  for (size_t i = 0; i < c->n; i++) {
    c->dev[i] = c->rt[i].dst;
    if (i == 0 && first && s->up.bounce_host != NULL) {
      c->host[0] = s->up.bounce_host;
      s->up.bounce_host = NULL;
    } else if ((c->host[i] = malloc(c->metas[i].nbytes ? c->metas[i].nbytes : 1)) == NULL) {
      return WTX_ENOMEM;
    }
    c->rt[i].dst = c->host[i];
  }
  return 0;
}

/* n bytes from byte lo of tensor i's host copy into its device staging. */
static int bounce_copy(wtx_session *s, chunk *c, size_t i, uint64_t lo, uint64_t n) {
  wtx_box whole = {.ndim = 1, .len = {c->metas[i].nbytes}};
  wtx_box box = {.ndim = 1, .lo = {lo}, .len = {n}};
  return s->transport->put_box(s->engine, c->dev[i], &whole, c->host[i] + lo, &box, 1,
                               c->err, sizeof c->err);
}

/* After a bounced chunk's receive (and its patches applied): the bytes
 * each tensor received, or a patched tensor whole, onto the GPU; the host
 * copy of the tensor the next chunk continues goes on in up.bounce_host.
 * Called while receiving, outside the lock (chunk_settle). */
static int bounce_put(wtx_session *s, chunk *c, size_t done) {
  uint64_t left = c->bytes;
  size_t k = 0; /* the chunk's next patch */
  for (size_t i = 0; i < c->n; i++) {
    uint64_t lo = i == 0 ? c->ui->first_param_offset : 0;
    uint64_t take = c->rt[i].nbytes - lo < left ? c->rt[i].nbytes - lo : left;
    left -= take;
    if (k < c->n_patches && c->patches[k].i == i) { /* its wire bytes were the patch's */
      k++;
      lo = 0;
      take = i < done ? c->metas[i].nbytes : 0;
    }
    int rc = take > 0 ? bounce_copy(s, c, i, lo, take) : 0;
    if (rc != 0) return rc;
  }
  if (done < c->n) {
    free(s->up.bounce_host);
    s->up.bounce_host = c->host[c->n - 1];
    c->host[c->n - 1] = NULL;
  }
  return 0;
}

/* Step 3: staging memory for the tensors that begin in this chunk, and the
 * assembler set up to receive into it. The model sees each tensor through
 * the same meta in check, stage and loaded, checked, staged and loaded in
 * that order within the chunk, and c->metas lives unchanged until the chunk
 * ends: the store relies on it to skip compares (server/store.c). */
static int stage_patches(wtx_session *s, chunk *c);
static int patches_fit(chunk *c);

static int chunk_stage(wtx_session *s, chunk *c) {
  const Wtx__V1__UpdateInfo *ui = c->ui;
  /* Where tensors[0] begins in the update's stream (in place only). */
  uint64_t next = wtx__rx_next_stream_offset(s->rx), at = next - ui->first_param_offset;
  if (s->region != NULL && ui->first_param_offset > next) {
    snprintf(c->err, sizeof c->err, "update_info.first_param_offset: %llu, but the update "
             "has had %llu bytes so far", (unsigned long long)ui->first_param_offset,
             (unsigned long long)next);
    return WTX_EPROTO;
  }
  for (size_t i = 0; i < c->n; i++) {
    if (i + 16 < c->n) __builtin_prefetch(&c->metas[i + 16]); /* 96-byte strides */
    c->rt[i].name = c->metas[i].name;
    c->rt[i].nbytes = c->metas[i].nbytes;
  }
  /* A tensor continued from the chunk before is staged already. */
  size_t first = ui->first_param_offset > 0;
  if (first) c->rt[0].dst = s->up.carry_dst;
  if (ui->box != NULL && s->up.boxed.dst != NULL) { /* staged by its first box */
    c->rt[0].dst = s->up.boxed.dst;
    first = 1;
  }
  /* A boxed tensor is staged apart from the receive region: its bytes
   * are not where the stream would put them. */
  int (*stage)(wtx_session *, chunk *, size_t, uint64_t) =
      ui->box == NULL || s->region == NULL ? s->steps.stage
      : s->stage_device >= 0               ? stage_each_on_device
                                           : host_staging;
  int rc = stage(s, c, first, first ? at + c->metas[0].nbytes : at);
  if (rc == 0 && ui->box != NULL) rc = box_stage(s, c);
  if (rc == 0 && bounces(s, c)) rc = bounce_stage(s, c, first);
  if (rc == 0 && c->n_patches > 0) rc = stage_patches(s, c);
  if (rc != 0) return rc;
  int verify = s->wire.checksum == WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64;
  /* A box comes to the host (box_stage), wherever its tensor is staged,
   * and so does a bounced chunk. */
  int device = s->stage_device >= 0 && ui->box == NULL && c->host == NULL;
  int flags = (verify ? WTX__RX_VERIFY : 0) | (device ? WTX__RX_DEVICE : 0) |
              (c->host != NULL ? WTX__RX_UNREAD : 0);
  rc = wtx__rx_begin(s->rx, c->rt, c->n, ui->first_param_offset, ui->chunk_bytes, flags);
  if (rc != 0) snprintf(c->err, sizeof c->err, "%s", wtx__rx_error(s->rx));
  else if (verify) wtx__rx_expect_checksums(s->rx, ui->xxh3_64, ui->n_xxh3_64);
  if (rc == 0) c->bytes = wtx_rx_remaining(s->rx);
  return rc == 0 && c->n_patches > 0 ? patches_fit(c) : rc;
}

/* A patch's bytes are received apart from the tensor's staging (kept in
 * its slot), and only they travel; a patch of spans the chunk before
 * began goes on in the update's. */
static int stage_patches(wtx_session *s, chunk *c) {
  for (size_t k = 0; k < c->n_patches; k++) {
    struct patch_slot *p = &c->patches[k];
    if (p->carried) {
      p->wire = s->up.spans.wire;
      p->full = s->up.spans.full;
    } else if ((p->wire = malloc(p->bytes)) == NULL) {
      return WTX_ENOMEM;
    } else {
      p->full = c->rt[p->i].dst;
    }
    c->rt[p->i].dst = p->wire;
    c->rt[p->i].nbytes = p->bytes;
  }
  return 0;
}

/* The chunk's last patch ends within it, unless it is of spans: a patch
 * is applied whole, once received, in the chunk that carries its last
 * byte. */
static int patches_fit(chunk *c) {
  const struct patch_slot *last = &c->patches[c->n_patches - 1];
  uint64_t end = 0;
  for (size_t i = 0; i <= last->i; i++) end += c->rt[i].nbytes;
  if (end - c->ui->first_param_offset <= c->bytes || last->p->n_spans > 0) return 0;
  snprintf(c->err, sizeof c->err, "update_info: the patch of '%s' continues past the chunk; "
           "a patch lies within one chunk", c->metas[last->i].name);
  return WTX_EINVAL;
}

/* The refusal of a patched tensor (span -1) or span whose bytes (XXH3
 * got) are not the trainer's (want). */
static int not_trainers(chunk *c, size_t i, long span, uint64_t got, uint64_t want) {
  char of[64] = "";
  if (span >= 0) snprintf(of, sizeof of, "span %ld of ", span);
  snprintf(c->err, sizeof c->err, "update_info.params[%zu].patch: %s'%s' patched is not the "
           "trainer's %s (XXH3 %016llx, the trainer's %016llx): the base differs", i, of,
           c->metas[i].name, span >= 0 ? "span" : "tensor", (unsigned long long)got,
           (unsigned long long)want);
  return WTX_ECHECKSUM;
}

/* XXH3-64 of a box's elements, read where they lie (wtx_box_runs): short
 * runs (a row-parallel rank's columns) are gathered into buf, so that the
 * hash takes large blocks, not a call per run. */
enum { BOX_HASH_BUF = 64 << 10 };
typedef struct box_hash {
  XXH3_state_t *st;
  const uint8_t *base;
  size_t es, used;
  uint8_t buf[BOX_HASH_BUF];
} box_hash;

static int hash_run(void *arg, uint64_t in_a, uint64_t in_b, uint64_t n) {
  box_hash *h = arg;
  const uint8_t *src = h->base + in_a * h->es;
  uint64_t len = n * h->es;
  (void)in_b;
  if (h->used + len > sizeof h->buf || len >= sizeof h->buf / 4) {
    XXH3_64bits_update(h->st, h->buf, h->used);
    h->used = 0;
  }
  if (len >= sizeof h->buf / 4) {
    XXH3_64bits_update(h->st, src, len);
    return 0;
  }
  memcpy(h->buf + h->used, src, len);
  h->used += len;
  return 0;
}

/* A box span's patch applied where its elements lie in full (tensor m),
 * and into *got the XXH3-64 of the box once patched, its elements in
 * row-major order, as the trainer's rank hashed its piece (0 where it
 * sent none). */
static int apply_box(const wtx_tensor_meta *m, const Wtx__V1__PatchSpan *sp,
                     const uint8_t *wire, uint8_t *full, uint64_t *got) {
  size_t es = wtx_dtype_size(m->dtype);
  wtx_box whole, box;
  wtx_box_whole(m, &whole);
  span_box(m, sp->box, &box); /* checked with the patch's form */
  wtx__patch_apply_box(m->shape, m->ndim, box.lo, box.len, sp->index_dtype, sp->count, wire,
                       es, full);
  *got = 0;
  if (sp->result_xxh3 == 0) return 0;
  box_hash *h = malloc(sizeof *h);
  if (h == NULL || (h->st = XXH3_createState()) == NULL) {
    free(h);
    return WTX_ENOMEM;
  }
  h->base = full;
  h->es = es;
  h->used = 0;
  XXH3_64bits_reset(h->st);
  wtx_box_runs(&whole, NULL, &box, hash_run, h);
  XXH3_64bits_update(h->st, h->buf, h->used);
  *got = XXH3_64bits_digest(h->st);
  XXH3_freeState(h->st);
  free(h);
  return 0;
}

/* A checked patch of spans applied to the base in full, each span's
 * result checked where the trainer sent it (a box's over its elements in
 * its own row-major order). */
static int apply_spans(chunk *c, const struct patch_slot *p) {
  const wtx_tensor_meta *m = &c->metas[p->i];
  size_t es = wtx_dtype_size(m->dtype);
  const uint8_t *at = p->wire;
  for (size_t j = 0; j < p->p->n_spans; j++) {
    const Wtx__V1__PatchSpan *sp = p->p->spans[j];
    wtx_tensor_meta flat = span_meta(m, sp);
    uint8_t *dst = p->full + sp->first * es;
    uint64_t got = 0;
    if (sp->box != NULL) {
      int rc = apply_box(m, sp, at, p->full, &got);
      if (rc != 0) return rc;
    } else {
      wtx__patch_apply(&flat, sp->index_dtype, sp->count, at, dst);
      got = sp->result_xxh3 != 0 ? XXH3_64bits(dst, flat.nbytes) : 0;
    }
    at += wtx__patch_bytes(sp->index_dtype, sp->count, es);
    if (got != sp->result_xxh3) return not_trainers(c, p->i, (long)j, got, sp->result_xxh3);
  }
  return 0;
}

/* One received patch, checked whole, applied to a copy of the tensor the
 * worker serves, in the tensor's staging; *sum: the whole tensor's XXH3
 * when want_sum or the trainer sent the result's. */
static int apply_patch(wtx_session *s, chunk *c, const struct patch_slot *p, int want_sum,
                       uint64_t *sum) {
  const wtx_tensor_meta *m = &c->metas[p->i];
  char why[1200] = "";
  uint64_t bytes;
  int rc = check_patch_bytes(c, p->i, p->p, p->wire, &bytes);
  if (rc != 0) return rc;
  rc = s->cfg.model_ops->read(s->cfg.model, s->up.target, m, p->full, why, sizeof why);
  if (rc != 0) {
    snprintf(c->err, sizeof c->err, "update_info.params[%zu].patch: no base to apply it to: %s",
             p->i, why[0] ? why : wtx_strerror(rc));
    return rc == WTX_ENOENT ? WTX_EINVAL : rc;
  }
  if (p->p->n_spans > 0 && (rc = apply_spans(c, p)) != 0) return rc;
  if (p->p->n_spans == 0) wtx__patch_apply(m, p->p->index_dtype, p->p->count, p->wire, p->full);
  if (!want_sum && p->p->result_xxh3 == 0) return 0;
  *sum = XXH3_64bits(p->full, m->nbytes);
  if (p->p->result_xxh3 == 0 || *sum == p->p->result_xxh3) return 0;
  return not_trainers(c, p->i, -1, *sum, p->p->result_xxh3);
}

/* A patch of spans the chunk did not complete goes on in the next: the
 * update keeps its bytes so far and its staging. */
static void carry_spans(wtx_session *s, chunk *c, size_t done) {
  struct patch_slot *last = &c->patches[c->n_patches - 1];
  if (last->i < done || last->carried) return;
  s->up.spans = (struct wtx__spans){.wire = last->wire, .full = last->full,
                                    .bytes = last->bytes};
  last->carried = 1; /* the update's now */
}

/* The chunk's patches applied; *sums (when not NULL) becomes the session's
 * copy with each patched tensor's whole checksum in place of its patch's. */
static int apply_patches(wtx_session *s, chunk *c, size_t done, const uint64_t **sums) {
  if (*sums != NULL) {
    memcpy(s->sc.sums, *sums, done * sizeof *s->sc.sums);
    *sums = s->sc.sums;
  }
  for (size_t k = 0; k < c->n_patches && c->patches[k].i < done; k++) {
    uint64_t sum = 0;
    int rc = apply_patch(s, c, &c->patches[k], *sums != NULL, &sum);
    if (rc != 0) return rc;
    if (*sums != NULL) s->sc.sums[c->patches[k].i] = sum;
    if (c->patches[k].carried) { /* the update's patch of spans, done */
      free(s->up.spans.wire);
      s->up.spans = (struct wtx__spans){0};
      c->patches[k].wire = NULL;
    }
  }
  carry_spans(s, c, done);
  return 0;
}

/* Step 5 (after the receive): hands the completed tensors to the model.
 * Caller holds mu. */
static int chunk_loaded(wtx_session *s, chunk *c) {
  size_t done = c->done;
  const uint64_t *sums = c->sums;
  if (c->ui->box != NULL && done == 1) box_scatter(s, c, &done, &sums);
  int rc = s->steps.loaded(s, c, done, sums);
  if (rc != 0) return rc;
  s->up.staged_params += done;
  for (size_t i = 0; i < done; i++) s->up.staged_bytes += c->metas[i].nbytes;
  if (done < c->n && c->ui->box == NULL)
    s->up.carry_dst = c->host != NULL ? c->dev[c->n - 1] : c->rt[c->n - 1].dst;
  if (s->up.abort_requested) {
    snprintf(c->err, sizeof c->err, "aborted while receiving");
    return WTX_EABORTED;
  }
  return 0;
}

/* After the receive, still outside the lock: the tensors the chunk
 * completed and their checksums (c->done, c->sums), its patches applied
 * and a bounced chunk's tensors put on the GPU; work in proportion to the
 * patched tensors' bytes, which inspection does not wait on. The update
 * is the receiving thread's meanwhile (no abort ends it until the
 * receive's end). */
static int chunk_settle(wtx_session *s, chunk *c) {
  c->done = wtx__rx_completed(s->rx);
  c->sums = wtx__rx_whole_sums(s->rx) ? wtx__rx_checksums(s->rx) : NULL;
  int rc = c->n_patches > 0 ? apply_patches(s, c, c->done, &c->sums) : 0;
  if (rc == 0 && c->host != NULL) rc = bounce_put(s, c, c->done);
  return rc;
}

/* Step 4: the data plane moves the chunk's bytes, outside the lock (which
 * the caller holds on entry and on return). */
static int chunk_receive(wtx_session *s, chunk *c) {
  s->up.receiving = 1;
  const wtx_worker_transport *t = s->transport;
  void *engine = s->engine;
  pthread_mutex_unlock(&s->mu);
  int rc = t->receive(engine, c->ui, s->rx);
  if (rc == 0) rc = wtx__rx_end(s->rx);
  if (rc != 0) snprintf(c->err, sizeof c->err, "%s", wtx__rx_error(s->rx));
  /* While receiving, no abort frees the staging (it waits for the end). */
  else if (c->ui->box != NULL) rc = box_put(s, c);
  c->receive_failed = rc != 0;
  if (rc == 0) rc = chunk_settle(s, c);
  pthread_mutex_lock(&s->mu);
  s->up.receiving = 0;
  s->last_activity_ms = wtx__clock_ms();
  return rc;
}

/* One chunk's steps, in order, until one fails. Caller holds mu. */
static int update_chunk(wtx_session *s, chunk *c) {
  int rc;
  if ((rc = chunk_check_frame(s, c)) != 0 || (rc = chunk_check_tensors(s, c)) != 0 ||
      (rc = chunk_stage(s, c)) != 0 || (rc = chunk_receive(s, c)) != 0)
    return rc;
  return chunk_loaded(s, c);
}

/* Chunk k of the call (0: update_info, else then[k - 1]) failed with rc:
 * the update ends; the published weights stay. Every step but the
 * receive answers the session's own codes, none transient, or the
 * model's: a transient one there is the model's own I/O. Caller holds
 * mu. */
static grpc_status_code chunk_failed(wtx_session *s, wtx__rpc_ctx *ctx, chunk *c, size_t k,
                                     int rc) {
  char why[sizeof c->err + 32];
  const char *what = c->err[0] ? c->err : wtx_strerror(rc);
  if (k == 0) snprintf(why, sizeof why, "%s", what);
  else snprintf(why, sizeof why, "then[%zu]: %s", k - 1, what);
  int model = !c->receive_failed && transient(rc);
  abort_locked(s, model ? WTX__END_MODEL : failure_kind(rc), why);
  return (model ? model_failed : from_wtx)(ctx, rc, "UpdateWeights (update aborted)", why);
}

/* An ordered call (call_index k, from 1) is taken after calls 1..k-1 of
 * its update have ended: one that arrives ahead of its turn waits, the
 * lock released, within the session's timeout; the update ending (a call
 * before it failed, an abort, a drain) ends the wait at once, and the
 * call then finds no update to join. A k already taken is refused: a
 * trainer sends each call once. Caller holds mu and has checked the
 * update. */
static grpc_status_code await_turn(wtx_session *s, wtx__rpc_ctx *ctx,
                                   const Wtx__V1__UpdateWeightsRequest *req) {
  uint32_t k = req->call_index;
  if (k <= s->up.calls_done)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT, "call_index: %u, but "
                              "calls 1..%u of update %llu have been taken already", k,
                              s->up.calls_done, (unsigned long long)s->update_id);
  int64_t ms = s->wire.timeout_ms > 0 ? s->wire.timeout_ms : s->cfg.watchdog_ms;
  struct timespec until;
  wtx__clock_deadline(&until, ms);
  grpc_status_code code = GRPC_STATUS_OK;
  int late = 0;
  if (k > s->up.calls_done + 1)
    wtx__log(WTX__LOG_DEBUG, "event=call_waits update=%llu call_index=%u for=%u",
             (unsigned long long)s->update_id, k, s->up.calls_done + 1);
  while (code == GRPC_STATUS_OK && k > s->up.calls_done + 1 && !late) {
    late = pthread_cond_timedwait(&s->turn, &s->mu, &until) == ETIMEDOUT;
    code = check_update(s, ctx, req->session_id, req->update_id, "UpdateWeights", 0);
  }
  if (code == GRPC_STATUS_OK && k > s->up.calls_done + 1)
    code = wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_DEADLINE_EXCEEDED, "call_index: %u waited "
                              "%lld ms for call %u of update %llu to end", k,
                              (long long)ms, s->up.calls_done + 1,
                              (unsigned long long)s->update_id);
  return code;
}

static grpc_status_code handle_update(wtx__rpc_ctx *ctx,
    const Wtx__V1__UpdateWeightsRequest *req, Wtx__V1__UpdateWeightsResponse *resp) {
  wtx_session *s = wtx__rpc_ctx_user(ctx);
  grpc_status_code code = wtx__check_request(ctx, &req->base);
  if (code != GRPC_STATUS_OK) return code;
  pthread_mutex_lock(&s->mu);
  code = check_update(s, ctx, req->session_id, req->update_id, "UpdateWeights", 0);
  int ordered = code == GRPC_STATUS_OK && req->call_index > 0;
  if (ordered) code = await_turn(s, ctx, req);
  if (code == GRPC_STATUS_OK && s->up.receiving)
    code = wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "another UpdateWeights of update %llu is still "
                              "receiving; chunks go one at a time",
                              (unsigned long long)s->update_id);
  if (code == GRPC_STATUS_OK) s->last_activity_ms = wtx__clock_ms();
  for (size_t k = 0; code == GRPC_STATUS_OK && k <= req->n_then; k++) {
    chunk c = {.ui = k == 0 ? req->update_info : req->then[k - 1]};
    if (k > 0) /* the update may have ended while the chunk before received */
      code = check_update(s, ctx, req->session_id, req->update_id, "UpdateWeights", 0);
    int rc = code == GRPC_STATUS_OK ? update_chunk(s, &c) : 0;
    if (rc != 0) code = chunk_failed(s, ctx, &c, k, rc);
    else if (code == GRPC_STATUS_OK)
      wtx__metrics_received(s->cfg.metrics, s->transport->name, c.bytes);
    chunk_free(&c);
  }
  resp->staged_params = (uint32_t)s->up.staged_params;
  resp->staged_bytes = s->up.staged_bytes;
  if (ordered && update_open(s) && req->update_id == s->update_id &&
      req->call_index == s->up.calls_done + 1) {
    s->up.calls_done = req->call_index;
    pthread_cond_broadcast(&s->turn);
  }
  pthread_mutex_unlock(&s->mu);
  return code;
}

/* Prepares the open update under label v (empty: the next number): every
 * tensor complete, the model's prepare done. On failure the update is
 * aborted. Caller holds mu and has checked the update. */
static grpc_status_code prepare_locked(wtx_session *s, wtx__rpc_ctx *ctx, const char *v,
                                       const char *call) {
  if (s->up.receiving)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                              "%s: an UpdateWeights is still receiving", call);
  uint64_t have, want;
  const char *carry = wtx__rx_incomplete(s->rx, &have, &want);
  char why[1200] = "";
  if (carry == NULL && s->up.boxed.open) {
    carry = boxed_meta(s)->name;
    have = s->up.boxed.covered;
    want = boxed_meta(s)->nbytes;
  }
  if (carry != NULL) {
    snprintf(why, sizeof why, "tensor '%s' is incomplete: %llu of %llu bytes", carry,
             (unsigned long long)have, (unsigned long long)want);
    grpc_status_code code = wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_FAILED_PRECONDITION,
                                               "%s: %s (update aborted)", call, why);
    abort_locked(s, WTX__END_REFUSED, why);
    return code;
  }
  if (v[0] == '\0')
    snprintf(s->version, sizeof s->version, "%llu", (unsigned long long)(++s->auto_version));
  else
    snprintf(s->version, sizeof s->version, "%s", v);
  const wtx_model_ops *ops = s->cfg.model_ops;
  int rc = ops->prepare != NULL ? ops->prepare(s->cfg.model, s->version, why, sizeof why) : 0;
  if (rc != 0) {
    grpc_status_code code = model_failed(ctx, rc, "model: cannot publish (update aborted)", why);
    abort_locked(s, WTX__END_MODEL, why[0] ? why : "prepare failed");
    return code;
  }
  s->state = WTX__V1__SESSION_STATE__SESSION_STATE_PREPARED;
  pthread_cond_broadcast(&s->turn); /* a call still waiting finds it prepared */
  return GRPC_STATUS_OK;
}

/* Publishes the prepared update. Caller holds mu. */
static grpc_status_code commit_locked(wtx_session *s, wtx__rpc_ctx *ctx) {
  int rc = s->cfg.model_ops->commit(s->cfg.model, s->version);
  if (rc != 0) {
    abort_locked(s, WTX__END_MODEL, "commit failed");
    return model_failed(ctx, rc, "model",
                        "commit failed (update aborted; the worker's log says why)");
  }
  s->state = WTX__V1__SESSION_STATE__SESSION_STATE_READY;
  wtx__metrics_published(s->cfg.metrics, wtx__clock_unix_s());
  int t = s->up.target == WTX_TARGET_DRAFT;
  s->revertible = s->cfg.model_ops->revert != NULL ? s->update_id : 0;
  /* A delta names a subset: the table stays the last full update's. */
  int own_table = s->up.by_range == 0 && !s->up.delta;
  s->tb.replaced = own_table;
  snprintf(s->tb.label_before, sizeof s->tb.label_before, "%s", s->tb.label[t]);
  snprintf(s->tb.label[t], sizeof s->tb.label[t], "%s", s->version);
  if (own_table) { /* params sent: later updates may name them by position */
    wtx__layout_swap(&s->up.cur, &s->tb.table[t]);
    s->tb.xxh3[t] = wtx__layout_xxh3(s->tb.table[t].metas, s->tb.table[t].n);
    s->tb.id[t] = atomic_fetch_add(&table_ids, 1);
  }
  wtx__layout_clear(&s->up.cur);
  s->published_update = s->update_id;
  char q[600];
  wtx__log(WTX__LOG_INFO, "event=published update=%llu target=%s version=%s "
          "params=%llu bytes=%llu", (unsigned long long)s->update_id,
          s->up.target == WTX_TARGET_DRAFT ? "draft" : "main",
          wtx__log_quote(s->version, q, sizeof q), (unsigned long long)s->up.staged_params,
          (unsigned long long)s->up.staged_bytes);
  return GRPC_STATUS_OK;
}

/* The checks of a request carrying a version label (Prepare, Finish). */
static grpc_status_code check_labelled(wtx__rpc_ctx *ctx, const ProtobufCMessage *req,
                                       const char *version) {
  grpc_status_code code = wtx__check_request(ctx, req);
  return code != GRPC_STATUS_OK
             ? code
             : wtx__check_text(ctx, "weight_version", version, WTX_MAX_VERSION_BYTES);
}

static grpc_status_code handle_prepare(wtx__rpc_ctx *ctx,
    const Wtx__V1__PrepareWeightUpdateRequest *req, Wtx__V1__PrepareWeightUpdateResponse *resp) {
  wtx_session *s = wtx__rpc_ctx_user(ctx);
  grpc_status_code code = check_labelled(ctx, &req->base, req->weight_version);
  if (code != GRPC_STATUS_OK) return code;
  pthread_mutex_lock(&s->mu);
  code = check_update(s, ctx, req->session_id, req->update_id, "PrepareWeightUpdate", 0);
  if (code == GRPC_STATUS_OK)
    code = prepare_locked(s, ctx, req->weight_version, "PrepareWeightUpdate");
  if (code == GRPC_STATUS_OK) {
    resp->weight_version = wtx__rpc_ctx_strdup(ctx, s->version);
    resp->num_params = (uint32_t)s->up.staged_params;
    resp->total_bytes = s->up.staged_bytes;
  }
  pthread_mutex_unlock(&s->mu);
  return code;
}

/* A Finish repeated for the update just published (its answer was lost):
 * the same answer again. Caller holds mu. */
static int finish_repeated(const wtx_session *s, const Wtx__V1__FinishWeightUpdateRequest *req) {
  return s->state == WTX__V1__SESSION_STATE__SESSION_STATE_READY &&
         strcmp(req->session_id, s->session_id) == 0 && req->update_id != 0 &&
         req->update_id == s->published_update;
}

/* Finish's failure when on_commit refused: this worker published. */
#define NOT_LOADED "published here, but the engine it feeds did not load it"

static grpc_status_code handle_finish(wtx__rpc_ctx *ctx,
    const Wtx__V1__FinishWeightUpdateRequest *req, Wtx__V1__FinishWeightUpdateResponse *resp) {
  wtx_session *s = wtx__rpc_ctx_user(ctx);
  grpc_status_code code = check_labelled(ctx, &req->base, req->weight_version);
  if (code != GRPC_STATUS_OK) return code;
  pthread_mutex_lock(&s->mu);
  int committed = 0;
  if (finish_repeated(s, req)) {
    code = s->commit_rc == 0 ? GRPC_STATUS_OK
                             : from_wtx(ctx, s->commit_rc, NOT_LOADED, s->commit_err);
  } else if ((code = check_update(s, ctx, req->session_id, req->update_id,
                                  "FinishWeightUpdate", 1)) != GRPC_STATUS_OK) {
  } else if (s->state == WTX__V1__SESSION_STATE__SESSION_STATE_PREPARED) {
    if (req->weight_version[0] != '\0' && strcmp(req->weight_version, s->version) != 0)
      code = wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                                "weight_version: the update was prepared under another "
                                "label (send it, or none)");
    else if ((code = commit_locked(s, ctx)) == GRPC_STATUS_OK)
      committed = 1;
  } else if ((code = prepare_locked(s, ctx, req->weight_version, "FinishWeightUpdate")) ==
                 GRPC_STATUS_OK &&
             (code = commit_locked(s, ctx)) == GRPC_STATUS_OK) {
    committed = 1;
  }
  if (code == GRPC_STATUS_OK) {
    resp->weight_version = wtx__rpc_ctx_strdup(ctx, s->version);
    resp->num_params = (uint32_t)s->up.staged_params;
    resp->total_bytes = s->up.staged_bytes;
  }
  wtx_target target = s->up.target;
  pthread_mutex_unlock(&s->mu);
  char why[1024] = "";
  int rc = committed && s->cfg.on_commit != NULL
               ? s->cfg.on_commit(s->cfg.on_commit_user, target, why, sizeof why) : 0;
  if (committed) {
    pthread_mutex_lock(&s->mu);
    s->commit_rc = rc;
    snprintf(s->commit_err, sizeof s->commit_err, "%s", why);
    pthread_mutex_unlock(&s->mu);
  }
  if (rc != 0) code = from_wtx(ctx, rc, NOT_LOADED, why);
  return code;
}

void wtx__session_served(wtx_session *s, wtx_target target, char *out, size_t len) {
  if (s->cfg.store != NULL)
    wtx__store_version(s->cfg.store, target, out, len);
  else
    snprintf(out, len, "%s", s->tb.label[target == WTX_TARGET_DRAFT]);
}

/* Undoes the update this session published last (an Abort naming it: its
 * Finish failed on another replica): the model returns to the version it
 * replaced, and a table that was the update's own goes with it. Caller
 * holds mu; no update is open. */
static grpc_status_code revert_locked(wtx_session *s, wtx__rpc_ctx *ctx, const char *reason) {
  char why[512] = "";
  int rc = s->cfg.model_ops->revert(s->cfg.model, s->up.target, why, sizeof why);
  if (rc != 0) return model_failed(ctx, rc, "model: cannot undo the update", why);
  int t = s->up.target == WTX_TARGET_DRAFT;
  if (s->tb.replaced) {
    wtx__layout_clear(&s->tb.table[t]);
    s->tb.xxh3[t] = 0;
    s->tb.id[t] = atomic_fetch_add(&table_ids, 1);
  }
  snprintf(s->tb.label[t], sizeof s->tb.label[t], "%s", s->tb.label_before);
  char q[512], v[600];
  wtx__log(WTX__LOG_WARN, "event=reverted update=%llu target=%s version=%s reason=%s",
          (unsigned long long)s->revertible, t ? "draft" : "main",
          wtx__log_quote(s->tb.label_before, v, sizeof v), wtx__log_quote(reason, q, sizeof q));
  s->revertible = 0;
  s->published_update = 0; /* a repeated Finish of it is refused from now */
  wtx__metrics_reverted(s->cfg.metrics);
  return GRPC_STATUS_OK;
}

/* Abort of update_id (0: whichever is active) with nothing open: the
 * update this session just published is undone; one that can no longer
 * be is FAILED_PRECONDITION; any other (aborted, undone) is done already.
 * Caller holds mu. */
static grpc_status_code abort_published(wtx_session *s, wtx__rpc_ctx *ctx, uint64_t id,
                                        const char *reason, int *reverted) {
  if (id != 0 && id == s->revertible) {
    grpc_status_code code = revert_locked(s, ctx, reason);
    *reverted = code == GRPC_STATUS_OK;
    return code;
  }
  if (id == 0 || id != s->published_update) return GRPC_STATUS_OK;
  return wtx__rpc_ctx_errorf(
      ctx, GRPC_STATUS_FAILED_PRECONDITION,
      "update_id: update %llu is published and can no longer be undone here: %s",
      (unsigned long long)id,
      s->cfg.model_ops->revert == NULL
          ? "this worker's model cannot return to the version before (wtx_model_ops.revert)"
          : "an update or a session began since");
}

grpc_status_code wtx__handle_abort(wtx__rpc_ctx *ctx,
    const Wtx__V1__AbortWeightUpdateRequest *req, Wtx__V1__AbortWeightUpdateResponse *resp) {
  wtx_session *s = wtx__rpc_ctx_user(ctx);
  grpc_status_code code = wtx__check_text(ctx, "reason", req->reason, WTX_MAX_REASON_BYTES);
  if (code != GRPC_STATUS_OK) return code;
  const char *reason = req->reason[0] ? req->reason : "AbortWeightUpdate";
  int reverted = 0;
  pthread_mutex_lock(&s->mu);
  /* An empty session_id is an operator's abort of whatever is current. */
  code = check_session(
      s, ctx, req->session_id[0] ? req->session_id : s->session_id);
  if (code == GRPC_STATUS_OK && req->update_id != 0 &&
      update_open(s) && req->update_id != s->update_id)
    code = wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_NOT_FOUND,
                              "update_id: %llu is not the active update (%llu)",
                              (unsigned long long)req->update_id,
                              (unsigned long long)s->update_id);
  wtx_target target = s->up.target; /* an abort resets the update */
  if (code == GRPC_STATUS_OK && update_open(s)) {
    resp->aborted = 1;
    if (s->up.receiving)
      request_abort(s);
    else
      abort_locked(s, WTX__END_TRAINER, reason);
  } else if (code == GRPC_STATUS_OK) {
    code = abort_published(s, ctx, req->update_id, reason, &reverted);
  }
  char label[WTX_MAX_VERSION_BYTES + 1];
  wtx__session_served(s, target, label, sizeof label);
  pthread_mutex_unlock(&s->mu);
  /* What the publish told the host (publish-dir, vLLM) is told again:
   * the version before is the published one now. */
  char why[1024] = "";
  int rc = reverted && s->cfg.on_commit != NULL
               ? s->cfg.on_commit(s->cfg.on_commit_user, target, why, sizeof why) : 0;
  if (rc != 0) /* not transient: a repeated undo finds nothing left to undo */
    return model_failed(ctx, rc, "undone here, but the engine it feeds did not load the "
                        "version before", why);
  resp->reverted = reverted;
  resp->weight_version = wtx__rpc_ctx_strdup(ctx, label);
  return code;
}

/* The session-changing calls as the worker registers them: each one timed
 * for the metrics as operation OP (server/metrics.h). */
#define TIMED(name, handler, Req, Resp, OP)                                     \
  grpc_status_code wtx__handle_##name(wtx__rpc_ctx *ctx, const Req *req,         \
                                      Resp *resp) {                             \
    wtx_session *s = wtx__rpc_ctx_user(ctx);                                     \
    wtx__op op = (OP);                                                          \
    double t0 = wtx__clock_s();                                                  \
    wtx__metrics_begin(s->cfg.metrics, op);                                     \
    grpc_status_code code = handler(ctx, req, resp);                            \
    wtx__metrics_end(s->cfg.metrics, op, wtx__clock_s() - t0);                   \
    return code;                                                                \
  }

TIMED(init, handle_init, Wtx__V1__InitWeightTransferEngineRequest,
      Wtx__V1__InitWeightTransferEngineResponse, WTX__OP_INIT)
TIMED(start, handle_start, Wtx__V1__StartWeightUpdateRequest,
      Wtx__V1__StartWeightUpdateResponse,
      req->target == WTX__V1__UPDATE_TARGET__UPDATE_TARGET_DRAFT ? WTX__OP_START_DRAFT
                                                                 : WTX__OP_START)
TIMED(update, handle_update, Wtx__V1__UpdateWeightsRequest, Wtx__V1__UpdateWeightsResponse,
      WTX__OP_UPDATE)
TIMED(prepare, handle_prepare, Wtx__V1__PrepareWeightUpdateRequest,
      Wtx__V1__PrepareWeightUpdateResponse, WTX__OP_PREPARE)
TIMED(finish, handle_finish, Wtx__V1__FinishWeightUpdateRequest,
      Wtx__V1__FinishWeightUpdateResponse, WTX__OP_FINISH)
