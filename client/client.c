/* wtx sync client: typed fan-out over every replica (see wtx/client.h and
 * client/fanout.h). */
#include <grpc/grpc_security.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client/control.h"
#include "client/fanout.h"
#include "common/clock.h"
#include "wtx/v1/weight_transfer.grpc-c.h"

/* How a client reaches its workers, as transport.h's backends are tables:
 * over wtx's gRPC, every replica at once (grpc_*), or through a caller's
 * control plane (control_*: one endpoint, vLLM's four calls). Every call of
 * an update (fanout.h) goes through the client's table. */
typedef struct reach {
  int (*init_start)(wtx_client *c, size_t i, const Wtx__V1__InitInfo *info);
  int (*init_wait)(wtx_client *c, size_t i, Wtx__V1__InitWeightTransferEngineResponse **resp);
  void (*start_begin)(wtx_client *c, int target, size_t params);
  int (*start_end)(wtx_client *c);
  int (*update_start)(wtx_client *c, const Wtx__V1__UpdateInfo *ui);
  int (*update_wait)(wtx_client *c);
  int (*refused)(wtx_client *c);
  uint64_t (*table)(const wtx_client *c);
  int (*prepare)(wtx_client *c, const char *version);
  int (*commit)(wtx_client *c, const char *version, char *published, size_t publen);
  int (*abort)(wtx_client *c, const char *reason);
  const char *(*target)(const wtx_client *c, size_t i);
  void (*release)(wtx_client *c);
  /* Each worker's whole WeightTransfer service is at hand: a published
   * update can be undone (AbortWeightUpdate naming it), and inspection,
   * deltas and subsets are offered. 0: the four calls only. */
  int services;
} reach;

static const reach via_grpc, via_control;

/* What a worker's StartWeightUpdateResponse says it takes (replica.can); over
 * a caller's control plane, what the caller said (wtx_control_ops.patches). */
enum {
  CAN_PATCHES = 1,     /* patches */
  CAN_PATCH_SPANS = 2, /* patch_spans */
  CAN_BATCHES = 4,     /* chunk_batches */
  CAN_PATCH_BOXES = 8, /* patch_boxes */
  CAN_ORDERED = 16,    /* ordered_calls */
};
static int commit_one(wtx_client *c, const char *version, char *published, size_t publen);

typedef struct replica {
  wtx__rpc_channel *ch;
  size_t index; /* the worker's number in messages: its place in the user's list */
  char session_id[64];
  uint64_t update_id;
  uint64_t table_xxh3; /* from StartWeightUpdate: the table it may name by range */
  /* The version it serves as far as this client saw (its last start's
   * answer, then the label its Finish published); "" unknown. base: the
   * version the next start's delta names ("" an ordinary update). */
  char serves[WTX_MAX_VERSION_BYTES + 1];
  char base[WTX_MAX_VERSION_BYTES + 1];
  unsigned can; /* what its last start said it takes (CAN_* bits) */
  wtx__rpc_pending *pending;
  int begun; /* fan_begin's result for its call in flight (0: in flight) */
  /* An UpdateWeights started before pending and not yet collected
   * (wtx__client_update_start_next); NULL: none. */
  wtx__rpc_pending *earlier;
  /* An update the other replicas undid that may be published here, still
   * to undo (the undo could not reach this replica): undone before this
   * replica's next init or start. undo_update 0: none. */
  char undo_session[64];
  uint64_t undo_update;
} replica;

struct wtx_client {
  const reach *reach;
  replica *r;
  size_t n;
  int64_t timeout_ms;
  int retries;
  char *auth; /* "Bearer ..." */
  char err[1400];
  int err_replica;
  int err_status;
  wtx__control *ctl; /* a control plane of the caller's: one replica, no channel */
  int borrowed;      /* the channels are another client's (wtx__client_subset) */
  uint64_t update_bytes; /* UpdateInfo bytes sent, over every replica */
  int settle_rc; /* a start_begin's failure to undo, for start_end */
};

#define CONTROL_TARGET "the caller's control plane"

static void seterr(wtx_client *c, int replica_ix, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void seterr(wtx_client *c, int replica_ix, int status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->err, sizeof c->err, fmt, ap);
  va_end(ap);
  c->err_replica = replica_ix;
  c->err_status = status;
}

/* Records replica i's failed call. */
static int call_failed(wtx_client *c, size_t i, const char *method, int rc,
                       const wtx__rpc_status *st) {
  seterr(c, (int)i, st->code, "worker %zu (%s): %s: %s: %s", c->r[i].index,
         wtx__rpc_channel_target(c->r[i].ch), method, wtx__rpc_code_name(st->code),
         st->message[0] ? st->message : wtx_strerror(rc));
  return rc;
}

/* Records a failure of the caller's control plane. */
static int control_failed(wtx_client *c, const char *method, int rc, const char *why) {
  seterr(c, 0, wtx_err_to_grpc(rc), "worker 0 (%s): %s: %s", CONTROL_TARGET, method, why);
  return rc;
}

/* What a call that only wtx's gRPC has answers on a control plane. */
static int control_unsupported(wtx_client *c, const char *what) {
  return control_failed(c, what, WTX_ENOTSUP, "not available through a control plane "
                        "of the caller's");
}

static wtx__rpc_call_options call_opts(const wtx_client *c, wtx__rpc_metadata *md) {
  wtx__rpc_call_options o = WTX__RPC_CALL_OPTIONS_INIT;
  o.timeout_ms = c->timeout_ms;
  if (c->auth != NULL) {
    md->key = "authorization";
    md->value = c->auth;
    o.metadata = md;
    o.n_metadata = 1;
  }
  return o;
}

/* TLS credentials from o, NULL for plaintext; an error (with err) when they
 * are asked for but do not build. */
static int make_credentials(const wtx_client_options *o, grpc_channel_credentials **out,
                            char *err, size_t errlen) {
  *out = NULL;
  if (o->tls_ca_pem == NULL) {
    if (o->tls_cert_pem == NULL && o->tls_key_pem == NULL) return 0;
    snprintf(err, errlen, "tls: a client certificate needs tls_ca_pem too");
    return WTX_EINVAL;
  }
  if ((o->tls_cert_pem == NULL) != (o->tls_key_pem == NULL)) {
    snprintf(err, errlen, "tls: tls_cert_pem and tls_key_pem go together");
    return WTX_EINVAL;
  }
  grpc_ssl_pem_key_cert_pair pair = {o->tls_key_pem, o->tls_cert_pem};
  *out = grpc_ssl_credentials_create(o->tls_ca_pem, o->tls_cert_pem ? &pair : NULL,
                                     NULL, NULL);
  if (*out == NULL) {
    snprintf(err, errlen, "tls: the CA bundle or client certificate does not "
             "build TLS credentials");
    return WTX_EINVAL;
  }
  return 0;
}

/* Every replica's channel, sharing creds. */
static int open_channels(wtx_client *c, const char *const *targets, size_t n,
                         grpc_channel_credentials *creds, char *err, size_t errlen) {
  wtx__rpc_channel_options co = WTX__RPC_CHANNEL_OPTIONS_INIT;
  co.credentials = creds;
  co.max_message_bytes = WTX_DEFAULT_MAX_MESSAGE_BYTES;
  for (size_t i = 0; i < n; i++) {
    int rc = wtx__rpc_channel_create(targets[i], &co, &c->r[i].ch);
    if (rc != 0) {
      snprintf(err, errlen, "worker %zu (%s): %s", i, targets[i], wtx_strerror(rc));
      return rc;
    }
    c->r[i].index = i;
    c->n++;
  }
  return 0;
}

int wtx_client_create(const char *const *targets, size_t n,
                      const wtx_client_options *opts, wtx_client **out,
                      char *err, size_t errlen) {
  *out = NULL;
  if (n == 0 || n > WTX_MAX_WORKERS) {
    snprintf(err, errlen, "workers: %zu given, must be 1..%d", n, WTX_MAX_WORKERS);
    return WTX_EINVAL;
  }
  wtx_client_options o = WTX_CLIENT_OPTIONS_INIT;
  if (opts != NULL) o = *opts;
  grpc_channel_credentials *creds = NULL;
  wtx_client *c = calloc(1, sizeof *c);
  int rc = WTX_ENOMEM;
  if (c == NULL || (c->r = calloc(n, sizeof *c->r)) == NULL) goto nomem;
  c->reach = &via_grpc;
  c->timeout_ms = o.timeout_ms > 0 ? o.timeout_ms : WTX_DEFAULT_TIMEOUT_MS;
  c->retries = o.retries > 0 ? o.retries : 0;
  c->err_replica = -1;
  if (o.token != NULL) {
    if ((c->auth = malloc(strlen(o.token) + 8)) == NULL) goto nomem;
    sprintf(c->auth, "Bearer %s", o.token);
  }
  if ((rc = make_credentials(&o, &creds, err, errlen)) != 0 ||
      (rc = open_channels(c, targets, n, creds, err, errlen)) != 0)
    goto fail;
  if (creds != NULL) grpc_channel_credentials_release(creds);
  *out = c;
  return 0;
nomem:
  snprintf(err, errlen, "out of memory");
fail:
  if (creds != NULL) grpc_channel_credentials_release(creds);
  wtx_client_destroy(c);
  return rc;
}

int wtx_client_create_control(const wtx_control_ops *ops, void *self, wtx_client **out) {
  *out = NULL;
  if (ops == NULL || ops->version == 0 || ops->version > WTX_CONTROL_OPS_VERSION)
    return WTX_EINVAL;
  wtx_client *c = calloc(1, sizeof *c);
  if (c == NULL || (c->r = calloc(1, sizeof *c->r)) == NULL) {
    free(c);
    return WTX_ENOMEM;
  }
  int rc = wtx__control_create(ops, self, &c->ctl);
  if (rc != 0) {
    free(c->r);
    free(c);
    return rc;
  }
  c->reach = &via_control;
  c->n = 1;
  /* Its start answers nothing: whether the engines take patches is the
   * caller's word, given once. */
  c->r[0].can = ops->version >= 2 && ops->patches ? CAN_PATCHES : 0u;
  c->timeout_ms = WTX_DEFAULT_TIMEOUT_MS;
  c->err_replica = -1;
  *out = c;
  return 0;
}

/* Every call in flight cancelled and waited for; the channels closed. */
static void grpc_release(wtx_client *c) {
  for (size_t i = 0; c->r != NULL && i < c->n; i++) {
    wtx__rpc_pending *calls[2] = {c->r[i].earlier, c->r[i].pending};
    for (int k = 0; k < 2; k++) {
      if (calls[k] == NULL) continue;
      wtx__rpc_unary_cancel(calls[k]);
      ProtobufCMessage *m = NULL;
      wtx__rpc_unary_wait(calls[k], &m, NULL);
      if (m != NULL) protobuf_c_message_free_unpacked(m, NULL);
    }
    if (!c->borrowed) wtx__rpc_channel_destroy(c->r[i].ch);
  }
}

void wtx_client_destroy(wtx_client *c) {
  if (c == NULL) return;
  if (c->reach != NULL) c->reach->release(c);
  free(c->r);
  free(c->auth);
  free(c);
}

size_t wtx_client_size(const wtx_client *c) { return c->n; }

static const char *grpc_target(const wtx_client *c, size_t i) {
  return i < c->n ? wtx__rpc_channel_target(c->r[i].ch) : NULL;
}

const char *wtx_client_last_error(const wtx_client *c) { return c->err; }
int wtx_client_last_replica(const wtx_client *c) { return c->err_replica; }
int wtx_client_last_status(const wtx_client *c) { return c->err_status; }

/* Attempts after a transient failure of a Finish: an answer lost on the
 * way is asked for again (a repeated Finish answers the same), briefly,
 * since the undo follows a Finish that still fails. */
#define FINISH_RETRIES 3
/* And of the undo: its waits outlast the channel's longest way
 * back to a worker (WTX__RPC_RECONNECT_MAX_MS + WTX__RPC_CONNECT_TIMEOUT_MS),
 * so one back from a short partition or a restart is reached. */
#define SETTLE_RETRIES 5

/* Waits before attempt `attempt` (1, 2, ...) of a call tried again on
 * replica i: 100 ms, doubling, or until its channel reconnects. */
static void backoff(wtx_client *c, size_t i, int attempt) {
  wtx__rpc_channel_backoff(c->r[i].ch, 100L << (attempt - 1));
}

/* One unary call on replica i, tried again up to retries times (0 for a
 * call that is not idempotent) when the failure is transient; attempt is
 * the first try's number (1: one has failed already, so wait first). */
static int call_from(wtx_client *c, size_t i, const wtx__rpc_method *m,
                     const ProtobufCMessage *req, ProtobufCMessage **resp, int retries,
                     int attempt) {
  wtx__rpc_metadata md;
  wtx__rpc_call_options o = call_opts(c, &md);
  wtx__rpc_status st;
  int rc = 0;
  for (;; attempt++) {
    if (attempt > 0) backoff(c, i, attempt);
    rc = wtx__rpc_unary(c->r[i].ch, m, req, resp, &o, &st);
    if (rc == 0 || !wtx__rpc_code_transient(st.code) || attempt >= retries) break;
  }
  if (rc != 0) call_failed(c, i, m->name, rc, &st);
  return rc;
}

static int call(wtx_client *c, size_t i, const wtx__rpc_method *m,
                const ProtobufCMessage *req, ProtobufCMessage **resp, int retries) {
  return call_from(c, i, m, req, resp, retries, 0);
}

/* The fan-out of a unary call that every replica must answer, in flight on
 * all of them at once (one round trip for any number of replicas):
 * fill(i) builds replica i's request (NULL: one request for all), take(i)
 * reads its answer (may be NULL). A transient failure is tried again on
 * its own replica, up to retries times. */
typedef struct fanout {
  const wtx__rpc_method *method;
  void (*fill)(struct fanout *f, size_t i, ProtobufCMessage *req);
  void (*take)(struct fanout *f, size_t i, const ProtobufCMessage *resp);
  ProtobufCMessage *req;
  wtx_client *c;
  void *arg;
  int retries; /* attempts after a transient failure (idempotent calls) */
  int *codes;  /* may be NULL: each replica's gRPC status, 0 when it answered */
} fanout;

static int settle(wtx_client *c, size_t i);
static int settle_all(wtx_client *c);

/* Every replica's call in flight (a replica whose call cannot start keeps
 * why in begun); fan_end collects them. */
static void fan_begin(fanout *f) {
  wtx__rpc_metadata md;
  wtx__rpc_call_options o = call_opts(f->c, &md);
  for (size_t i = 0; i < f->c->n; i++) {
    if (f->fill != NULL) f->fill(f, i, f->req);
    replica *r = &f->c->r[i];
    r->begun = r->pending != NULL ? WTX_ESTATE
                                  : wtx__rpc_unary_start(r->ch, f->method, f->req, &o, &r->pending);
  }
}

/* Replica i's answer to fan_begin's call, tried again when it failed
 * transiently. */
static int fan_take(fanout *f, size_t i) {
  wtx_client *c = f->c;
  int rc = c->r[i].begun;
  if (rc == 0 && c->r[i].pending == NULL) return 0; /* nothing in flight there */
  ProtobufCMessage *m = NULL;
  wtx__rpc_status st = {.code = GRPC_STATUS_INTERNAL};
  if (rc == 0) {
    rc = wtx__rpc_unary_wait(c->r[i].pending, &m, &st);
    c->r[i].pending = NULL;
  } else {
    snprintf(st.message, sizeof st.message, "cannot start the call: %s", wtx_strerror(rc));
  }
  if (rc != 0 && wtx__rpc_code_transient(st.code) && f->retries > 0) {
    if (f->fill != NULL) f->fill(f, i, f->req);
    rc = call_from(c, i, f->method, f->req, &m, f->retries, 1);
  } else if (rc != 0) {
    call_failed(c, i, f->method->name, rc, &st);
  }
  if (rc == 0 && f->take != NULL) f->take(f, i, m);
  if (m != NULL) protobuf_c_message_free_unpacked(m, NULL);
  if (f->codes != NULL) f->codes[i] = rc == 0 ? 0 : c->err_status;
  return rc;
}

/* A failure that only follows from another one (a broken stream, a
 * cancelled call) says less than a refusal: it ranks after it. */
static int consequential(int code) {
  return code == GRPC_STATUS_UNAVAILABLE || code == GRPC_STATUS_CANCELLED ||
         code == GRPC_STATUS_DEADLINE_EXCEEDED || code == GRPC_STATUS_ABORTED;
}

static void list_add(char *buf, size_t len, size_t i) {
  size_t o = strlen(buf);
  snprintf(buf + o, len - o, "%s%zu", o ? ", " : "", i);
}

/* Every answer to fan_begin's calls, waited for even after a failure.
 * The error reported is the most telling one (a refusal over a broken
 * stream), and the other failing replicas are listed after it. */
static int fan_end(fanout *f) {
  wtx_client *c = f->c;
  int first = 0, cause_code = 0;
  size_t cause = 0, failed = 0;
  char cause_msg[sizeof c->err] = "", others[300] = "";
  for (size_t i = 0; i < c->n; i++) {
    int rc = fan_take(f, i);
    if (rc == 0) continue;
    failed++;
    if (first != 0 && !(consequential(cause_code) && !consequential(c->err_status))) {
      list_add(others, sizeof others, c->r[i].index);
      continue;
    }
    if (first != 0) list_add(others, sizeof others, c->r[cause].index);
    first = rc;
    cause = i;
    cause_code = c->err_status;
    snprintf(cause_msg, sizeof cause_msg, "%s", c->err);
  }
  if (first != 0)
    seterr(c, (int)cause, cause_code, "%s%s%s%s", cause_msg,
           failed > 1 ? " (also failed: worker " : "", failed > 1 ? others : "",
           failed > 1 ? ")" : "");
  return first;
}

static int each_replica(fanout *f) {
  fan_begin(f);
  return fan_end(f);
}

int wtx__client_subset(wtx_client *c, const size_t *which, size_t n, wtx_client **out) {
  *out = NULL;
  if (!c->reach->services || n == 0) return WTX_EINVAL;
  wtx_client *s = calloc(1, sizeof *s);
  if (s == NULL || (s->r = calloc(n, sizeof *s->r)) == NULL ||
      (c->auth != NULL && (s->auth = strdup(c->auth)) == NULL)) {
    if (s != NULL) free(s->r);
    free(s);
    return WTX_ENOMEM;
  }
  for (size_t k = 0; k < n; k++) {
    s->r[k].ch = c->r[which[k]].ch;
    s->r[k].index = c->r[which[k]].index;
  }
  s->reach = &via_grpc;
  s->n = n;
  s->timeout_ms = c->timeout_ms;
  s->retries = c->retries;
  s->err_replica = -1;
  s->borrowed = 1;
  *out = s;
  return 0;
}

typedef struct shards_arg {
  Wtx__V1__ShardSpec **specs;
  int nomem;
} shards_arg;

/* Replica i's shard spec, copied out of its answer (freed after take). */
static void take_shard(fanout *f, size_t i, const ProtobufCMessage *m) {
  const Wtx__V1__ShardSpec *spec = ((const Wtx__V1__GetWeightInfoResponse *)m)->shard;
  shards_arg *a = f->arg;
  if (spec == NULL) return;
  size_t len = wtx__v1__shard_spec__get_packed_size(spec);
  uint8_t *buf = malloc(len + 1);
  if (buf != NULL) {
    wtx__v1__shard_spec__pack(spec, buf);
    a->specs[i] = wtx__v1__shard_spec__unpack(NULL, len, buf);
  }
  a->nomem |= a->specs[i] == NULL;
  free(buf);
}

int wtx__client_shards(wtx_client *c, Wtx__V1__ShardSpec **specs) {
  for (size_t i = 0; i < c->n; i++) specs[i] = NULL;
  if (!c->reach->services) return 0;
  Wtx__V1__GetWeightInfoRequest req = WTX__V1__GET_WEIGHT_INFO_REQUEST__INIT;
  shards_arg a = {specs, 0};
  fanout f = {.method = wtx__v1__weight_transfer__get_weight_info__method,
              .fill = NULL, .take = take_shard, .req = &req.base, .c = c,
              .arg = &a, .retries = c->retries};
  int rc = each_replica(&f);
  if (rc == 0 && a.nomem) {
    seterr(c, -1, 8 /* RESOURCE_EXHAUSTED */, "out of memory reading the shard rules");
    rc = WTX_ENOMEM;
  }
  return rc;
}

static int grpc_init_start(wtx_client *c, size_t i, const Wtx__V1__InitInfo *info) {
  if (i >= c->n || c->r[i].pending != NULL) return WTX_EINVAL;
  int rc = settle(c, i); /* before a new session can no longer undo it */
  if (rc != 0) return rc;
  Wtx__V1__InitWeightTransferEngineRequest req =
      WTX__V1__INIT_WEIGHT_TRANSFER_ENGINE_REQUEST__INIT;
  req.init_info = (Wtx__V1__InitInfo *)info;
  wtx__rpc_metadata md;
  wtx__rpc_call_options o = call_opts(c, &md);
  c->r[i].session_id[0] = '\0';
  rc = wtx__rpc_unary_start(c->r[i].ch, wtx__v1__weight_transfer__init_weight_transfer_engine__method,
                               &req.base, &o, &c->r[i].pending);
  if (rc != 0)
    seterr(c, (int)i, 0, "worker %zu (%s): InitWeightTransferEngine: cannot start "
           "the call: %s", i, wtx__rpc_channel_target(c->r[i].ch), wtx_strerror(rc));
  return rc;
}

static int grpc_init_wait(wtx_client *c, size_t i,
                          Wtx__V1__InitWeightTransferEngineResponse **resp_out) {
  if (i >= c->n || c->r[i].pending == NULL) return WTX_EINVAL;
  ProtobufCMessage *m = NULL;
  wtx__rpc_status st;
  int rc = wtx__rpc_unary_wait(c->r[i].pending, &m, &st);
  c->r[i].pending = NULL;
  if (rc != 0) return call_failed(c, i, "InitWeightTransferEngine", rc, &st);
  Wtx__V1__InitWeightTransferEngineResponse *resp =
      (Wtx__V1__InitWeightTransferEngineResponse *)m;
  snprintf(c->r[i].session_id, sizeof c->r[i].session_id, "%s", resp->session_id);
  c->r[i].update_id = 0;
  if (resp_out != NULL)
    *resp_out = resp;
  else
    protobuf_c_message_free_unpacked(m, NULL);
  return 0;
}

int wtx__client_init_one(wtx_client *c, size_t i, const Wtx__V1__InitInfo *info,
                         Wtx__V1__InitWeightTransferEngineResponse **resp_out) {
  int rc = wtx__client_init_start(c, i, info);
  return rc != 0 ? rc : wtx__client_init_wait(c, i, resp_out);
}

/* fill() of the calls of a session (StartWeightUpdate) and of its open
 * update (UpdateWeights, PrepareWeightUpdate, FinishWeightUpdate): replica
 * i's session_id and, where the request has one, update_id, found by name
 * as take_label finds its field. */
static void session_fill(fanout *f, size_t i, ProtobufCMessage *m) {
  const ProtobufCFieldDescriptor *sid =
      protobuf_c_message_descriptor_get_field_by_name(m->descriptor, "session_id");
  const ProtobufCFieldDescriptor *uid =
      protobuf_c_message_descriptor_get_field_by_name(m->descriptor, "update_id");
  *(char **)((char *)m + sid->offset) = f->c->r[i].session_id;
  if (uid != NULL) *(uint64_t *)((char *)m + uid->offset) = f->c->r[i].update_id;
}

static void start_take(fanout *f, size_t i, const ProtobufCMessage *m) {
  const Wtx__V1__StartWeightUpdateResponse *r = (const Wtx__V1__StartWeightUpdateResponse *)m;
  f->c->r[i].update_id = r->update_id;
  f->c->r[i].table_xxh3 = r->table_xxh3;
  snprintf(f->c->r[i].serves, sizeof f->c->r[i].serves, "%s", r->weight_version);
  f->c->r[i].can = (r->patches ? CAN_PATCHES : 0u) | (r->patch_spans ? CAN_PATCH_SPANS : 0u) |
                   (r->chunk_batches ? CAN_BATCHES : 0u) |
                   (r->ordered_calls ? CAN_ORDERED : 0u) |
                   (r->patch_boxes ? CAN_PATCH_BOXES : 0u);
}

/* StartWeightUpdate's fill: the session, and the delta's base when set. */
static void start_fill(fanout *f, size_t i, ProtobufCMessage *m) {
  session_fill(f, i, m);
  ((Wtx__V1__StartWeightUpdateRequest *)m)->base_version = f->c->r[i].base;
}

int wtx__client_set_bases(wtx_client *c, const char *const *bases) {
  for (size_t i = 0; i < c->n; i++) {
    const char *b = bases != NULL ? bases[i] : "";
    if (strlen(b) > WTX_MAX_VERSION_BYTES) return WTX_EINVAL;
    snprintf(c->r[i].base, sizeof c->r[i].base, "%s", b);
  }
  return 0;
}

int wtx__client_is_control(const wtx_client *c) { return !c->reach->services; }

int wtx__client_send_base(wtx_client *c) {
  /* A control plane's start left the base set (its request carried none):
   * it is sent here, once. */
  if (c->reach->services || c->r[0].base[0] == '\0') return 0;
  Wtx__V1__UpdateInfo ui = WTX__V1__UPDATE_INFO__INIT;
  ui.base_version = c->r[0].base;
  int rc = c->reach->update_start(c, &ui);
  if (rc == 0) rc = c->reach->update_wait(c);
  c->r[0].base[0] = '\0';
  return rc;
}

/* 1 when every replica's last start said it takes what the bits of can
 * name; over a caller's control plane, whose start answers none, what the
 * caller said (patches, or nothing). */
static int all_can(const wtx_client *c, unsigned can) {
  if (c->n == 0) return 0;
  for (size_t i = 0; i < c->n; i++)
    if ((c->r[i].can & can) != can) return 0;
  return 1;
}

int wtx__client_patches(const wtx_client *c) { return all_can(c, CAN_PATCHES); }

int wtx__client_patch_spans(const wtx_client *c) {
  return all_can(c, CAN_PATCHES | CAN_PATCH_SPANS);
}

int wtx__client_patch_boxes(const wtx_client *c) {
  return all_can(c, CAN_PATCHES | CAN_PATCH_SPANS | CAN_PATCH_BOXES);
}

int wtx__client_batches(const wtx_client *c) { return all_can(c, CAN_BATCHES); }
int wtx__client_ordered(const wtx_client *c) {
  return c->reach == &via_grpc && all_can(c, CAN_ORDERED);
}

const char *wtx__client_serves(const wtx_client *c, size_t i) {
  return i < c->n ? c->r[i].serves : "";
}

static int grpc_refused(wtx_client *c) {
  for (size_t i = 0; i < c->n; i++) {
    int code = 0;
    if (c->r[i].pending != NULL && wtx__rpc_unary_poll(c->r[i].pending, &code) && code != 0)
      return 1;
  }
  return 0;
}

static uint64_t grpc_table(const wtx_client *c) {
  for (size_t i = 1; i < c->n; i++)
    if (c->r[i].table_xxh3 != c->r[0].table_xxh3) return 0;
  return c->n > 0 ? c->r[0].table_xxh3 : 0;
}

/* The start's fan-out, between wtx__client_start_begin and _end. */
static fanout start_fanout(wtx_client *c, Wtx__V1__StartWeightUpdateRequest *req) {
  return (fanout){.method = wtx__v1__weight_transfer__start_weight_update__method,
                   .fill = start_fill, .take = start_take, .req = &req->base, .c = c,
                   .arg = NULL, .retries = 0};
}

static void grpc_start_begin(wtx_client *c, int target, size_t params) {
  if ((c->settle_rc = settle_all(c)) != 0) return; /* start_end reports it */
  Wtx__V1__StartWeightUpdateRequest req = WTX__V1__START_WEIGHT_UPDATE_REQUEST__INIT;
  req.target = (Wtx__V1__UpdateTarget)target;
  req.expected_params = params <= UINT32_MAX ? (uint32_t)params : 0;
  fanout f = start_fanout(c, &req); /* each request is packed as it starts */
  fan_begin(&f);
  for (size_t i = 0; i < c->n; i++) c->r[i].base[0] = '\0'; /* one start's */
}

static int grpc_start_end(wtx_client *c) {
  if (c->settle_rc != 0) {
    int rc = c->settle_rc;
    c->settle_rc = 0;
    return rc;
  }
  Wtx__V1__StartWeightUpdateRequest req = WTX__V1__START_WEIGHT_UPDATE_REQUEST__INIT;
  fanout f = start_fanout(c, &req); /* fill: only for a retry, and start has none */
  return fan_end(&f);
}

int wtx__client_start(wtx_client *c, int target) {
  wtx__client_start_begin(c, target, 0);
  return wtx__client_start_end(c);
}

/* UpdateWeights' fan-out (never retried: a chunk is not idempotent). */
static fanout update_fanout(wtx_client *c, Wtx__V1__UpdateWeightsRequest *req) {
  return (fanout){.method = wtx__v1__weight_transfer__update_weights__method,
                   .fill = session_fill, .take = NULL, .req = &req->base, .c = c,
                   .arg = NULL, .retries = 0};
}

/* UpdateWeights of ui and the n_then chunks after it on every replica. */
static int grpc_update_send(wtx_client *c, const Wtx__V1__UpdateInfo *ui,
                            const Wtx__V1__UpdateInfo *const *then, size_t n_then,
                            uint32_t call_index) {
  Wtx__V1__UpdateWeightsRequest req = WTX__V1__UPDATE_WEIGHTS_REQUEST__INIT;
  req.update_info = (Wtx__V1__UpdateInfo *)ui;
  req.then = (Wtx__V1__UpdateInfo **)then;
  req.n_then = n_then;
  req.call_index = call_index;
  fanout f = update_fanout(c, &req); /* each request is packed as it starts */
  fan_begin(&f);
  for (size_t i = 0; i < c->n; i++)
    if (c->r[i].begun != 0) {
      seterr(c, (int)i, 0, "worker %zu (%s): UpdateWeights: cannot start the "
             "call: %s", i, wtx__rpc_channel_target(c->r[i].ch), wtx_strerror(c->r[i].begun));
      return c->r[i].begun;
    }
  return 0;
}

static int grpc_update_start(wtx_client *c, const Wtx__V1__UpdateInfo *ui) {
  return grpc_update_send(c, ui, NULL, 0, 0);
}

uint64_t wtx__client_update_bytes(const wtx_client *c) { return c->update_bytes; }

static int grpc_update_wait(wtx_client *c) {
  Wtx__V1__UpdateWeightsRequest req = WTX__V1__UPDATE_WEIGHTS_REQUEST__INIT;
  fanout f = update_fanout(c, &req); /* nothing is sent again */
  return fan_end(&f);
}

/* The control-plane bytes of n UpdateInfo about to go to every replica
 * (wtx__client_update_bytes). */
static void count_update(wtx_client *c, const Wtx__V1__UpdateInfo *const *ui, size_t n) {
  for (size_t k = 0; k < n; k++)
    c->update_bytes += wtx__v1__update_info__get_packed_size(ui[k]) * c->n;
}

/* Each replica's call in flight and its earlier one trade places. */
static void swap_earlier(wtx_client *c) {
  for (size_t i = 0; i < c->n; i++) {
    wtx__rpc_pending *p = c->r[i].pending;
    c->r[i].pending = c->r[i].earlier;
    c->r[i].earlier = p;
  }
}

int wtx__client_update_start_next(wtx_client *c, const Wtx__V1__UpdateInfo *ui,
                                  uint32_t call_index) {
  if (!wtx__client_ordered(c)) return WTX_ENOTSUP;
  for (size_t i = 0; i < c->n; i++)
    if (c->r[i].earlier != NULL) return WTX_ESTATE;
  count_update(c, &ui, 1);
  swap_earlier(c); /* pending is free for the new call */
  int rc = grpc_update_send(c, ui, NULL, 0, call_index);
  if (rc == 0) return 0;
  /* A replica whose call could not start: the earlier calls stay to be
   * collected, the new ones (some may be in flight) are waited for now. */
  grpc_update_wait(c);
  swap_earlier(c);
  return rc;
}

int wtx__client_update_wait_earlier(wtx_client *c) {
  int any = 0;
  for (size_t i = 0; i < c->n; i++) any |= c->r[i].earlier != NULL;
  if (!any) return 0;
  /* fan_take reads begun, which speaks of the latest calls: the earlier
   * ones all started, and the latest ones did too or have been collected
   * (start_next). */
  for (size_t i = 0; i < c->n; i++) c->r[i].begun = 0;
  swap_earlier(c);
  int rc = grpc_update_wait(c);
  swap_earlier(c);
  return rc;
}

/* Where replica 0's answer puts a label (field of the response message). */
typedef struct label_arg {
  const char *field; /* "weight_version", "previous_version" */
  char *out;
  size_t len;
  int serves; /* the label is what each replica serves now */
} label_arg;

/* take() of the calls that report a label: replica 0's, by field name. */
static void take_label(fanout *f, size_t i, const ProtobufCMessage *m) {
  label_arg *a = f->arg;
  const ProtobufCFieldDescriptor *fd =
      protobuf_c_message_descriptor_get_field_by_name(m->descriptor, a->field);
  if (fd == NULL || fd->type != PROTOBUF_C_TYPE_STRING) return;
  const char *v = *(char *const *)((const char *)m + fd->offset);
  if (a->serves) snprintf(f->c->r[i].serves, sizeof f->c->r[i].serves, "%s", v);
  if (i == 0 && a->out != NULL) snprintf(a->out, a->len, "%s", v);
}

static int grpc_prepare(wtx_client *c, const char *version) {
  Wtx__V1__PrepareWeightUpdateRequest prep = WTX__V1__PREPARE_WEIGHT_UPDATE_REQUEST__INIT;
  prep.weight_version = (char *)(version ? version : "");
  fanout p = {.method = wtx__v1__weight_transfer__prepare_weight_update__method,
              .fill = session_fill, .take = NULL, .req = &prep.base, .c = c,
              .arg = NULL, .retries = 0};
  return each_replica(&p);
}

/* FinishWeightUpdate on every replica. */
static int grpc_commit(wtx_client *c, const char *version, char *published, size_t publen) {
  (void)version; /* Finish publishes under the label Prepare was given */
  /* A prepared update cannot fail to publish; a lost answer is asked
   * again (a repeated Finish answers the same). */
  Wtx__V1__FinishWeightUpdateRequest req = WTX__V1__FINISH_WEIGHT_UPDATE_REQUEST__INIT;
  req.weight_version = "";
  label_arg a = {"weight_version", published, publen, 1};
  fanout f = {.method = wtx__v1__weight_transfer__finish_weight_update__method,
              .fill = session_fill, .take = take_label, .req = &req.base, .c = c, .arg = &a,
              .retries = c->retries > FINISH_RETRIES ? c->retries : FINISH_RETRIES};
  return each_replica(&f);
}

/* What the undo of an update found, over every replica of every client. */
typedef struct undo_report {
  size_t replicas, undone;
  char label[WTX_MAX_VERSION_BYTES + 1]; /* the version the first undone serves */
  int labels_differ;
  char unreached[600], kept[600]; /* "worker 1 (host:port): why", ... */
} undo_report;

#define UNDO_REASON "undo: another replica did not publish this update"

static void take_undo(fanout *f, size_t i, const ProtobufCMessage *m) {
  undo_report *rep = f->arg;
  const char *v = ((const Wtx__V1__AbortWeightUpdateResponse *)m)->weight_version;
  snprintf(f->c->r[i].serves, sizeof f->c->r[i].serves, "%s", v);
  if (rep->undone++ == 0)
    snprintf(rep->label, sizeof rep->label, "%s", v);
  else if (strcmp(rep->label, v) != 0)
    rep->labels_differ = 1;
}

static void note_replica(char *list, size_t len, const wtx_client *c, size_t i,
                         const char *why) {
  size_t o = strlen(list);
  snprintf(list + o, len - o, "%sworker %zu (%s): %s", o ? "; " : "", c->r[i].index,
           wtx__rpc_channel_target(c->r[i].ch), why);
}

/* Undoes, on every replica of c, the update each was told to publish:
 * AbortWeightUpdate naming it returns a replica that published it to the
 * version it replaced and discards it where it was only prepared, and a
 * replica that restarted since (NOT_FOUND) holds nothing of it. Retried as
 * Finish is; a replica still out of reach keeps the undo for its next
 * init or start (settle). */
static void undo(wtx_client *c, undo_report *rep) {
  if (c->n == 0) return;
  rep->replicas += c->n;
  int *codes = calloc(c->n, sizeof *codes);
  if (codes == NULL) {
    snprintf(rep->kept, sizeof rep->kept, "out of memory asking %zu replicas", c->n);
    return;
  }
  Wtx__V1__AbortWeightUpdateRequest req = WTX__V1__ABORT_WEIGHT_UPDATE_REQUEST__INIT;
  req.reason = UNDO_REASON;
  fanout f = {.method = wtx__v1__weight_transfer__abort_weight_update__method,
              .fill = session_fill, .take = take_undo, .req = &req.base, .c = c, .arg = rep,
              .retries = c->retries > SETTLE_RETRIES ? c->retries : SETTLE_RETRIES, .codes = codes};
  fan_begin(&f);
  for (size_t i = 0; i < c->n; i++) {
    if (fan_take(&f, i) == 0) continue;
    if (codes[i] == GRPC_STATUS_NOT_FOUND) {
      rep->undone++;
    } else if (wtx__rpc_code_transient(codes[i])) {
      snprintf(c->r[i].undo_session, sizeof c->r[i].undo_session, "%s", c->r[i].session_id);
      c->r[i].undo_update = c->r[i].update_id;
      note_replica(rep->unreached, sizeof rep->unreached, c, i, wtx__rpc_code_name(codes[i]));
    } else {
      note_replica(rep->kept, sizeof rep->kept, c, i, c->err);
    }
  }
  free(codes);
}

/* What the undo did, after the error that caused it. */
static void report_undo(const undo_report *rep, char *err, size_t len) {
  size_t o = strlen(err);
  char back[WTX_MAX_VERSION_BYTES + 40] = "";
  if (rep->undone > 0 && !rep->labels_differ)
    snprintf(back, sizeof back, " (version '%s')", rep->label);
  if (rep->undone == rep->replicas)
    snprintf(err + o, len - o, "; so it was undone: every replica serves its weights "
             "from before the update%s", back);
  else
    snprintf(err + o, len - o, "; undone on %zu of %zu replicas, back on their weights "
             "from before%s", rep->undone, rep->replicas, back);
  o = strlen(err);
  if (rep->unreached[0] != '\0')
    snprintf(err + o, len - o, "; not reached to undo it: %s; each serves its weights "
             "from before or this update until reached: the next sync undoes it there "
             "before anything else", rep->unreached);
  o = strlen(err);
  if (rep->kept[0] != '\0')
    snprintf(err + o, len - o, "; could not undo it: %s", rep->kept);
}

int wtx__client_commit_all(wtx_client *const *cs, size_t n, const char *version,
                           char *published, size_t publen, size_t *failed, char *err,
                           size_t errlen) {
  int rc = 0;
  size_t k = 0;
  for (; k < n; k++)
    if ((rc = commit_one(cs[k], version, k == 0 ? published : NULL, k == 0 ? publen : 0)) != 0)
      break;
  if (rc == 0) return 0;
  if (failed != NULL) *failed = k;
  wtx_client *c = cs[k];
  int who = c->err_replica, status = c->err_status;
  snprintf(err, errlen, "%s", c->err);
  undo_report rep = {0};
  for (size_t j = 0; j < n; j++)
    if (cs[j]->reach->services) undo(cs[j], &rep);
  report_undo(&rep, err, errlen);
  seterr(c, who, status, "%s", err);
  return rc;
}

int wtx__client_commit(wtx_client *c, const char *version, char *published, size_t publen) {
  char err[sizeof c->err];
  return wtx__client_commit_all(&c, 1, version, published, publen, NULL, err, sizeof err);
}

/* Replica i's pending undo (see undo), delivered: 0 once nothing of that
 * update is left to undo there. */
static int settle(wtx_client *c, size_t i) {
  replica *r = &c->r[i];
  if (r->undo_update == 0) return 0;
  Wtx__V1__AbortWeightUpdateRequest req = WTX__V1__ABORT_WEIGHT_UPDATE_REQUEST__INIT;
  req.session_id = r->undo_session;
  req.update_id = r->undo_update;
  req.reason = UNDO_REASON;
  ProtobufCMessage *m = NULL;
  int rc = call(c, i, wtx__v1__weight_transfer__abort_weight_update__method, &req.base, &m,
                c->retries > SETTLE_RETRIES ? c->retries : SETTLE_RETRIES);
  if (m != NULL) protobuf_c_message_free_unpacked(m, NULL);
  if (rc != 0 && wtx__rpc_code_transient(c->err_status)) {
    char why[sizeof c->err];
    snprintf(why, sizeof why, "%s", c->err);
    seterr(c, (int)i, c->err_status, "%s (update %llu, undone on the other replicas, is "
           "still to undo here)", why, (unsigned long long)r->undo_update);
    return rc;
  }
  /* Undone, or nothing left to undo (NOT_FOUND: it restarted), or no
   * longer undoable (the worker says why in its log): the next update
   * replaces it everywhere either way. */
  r->undo_update = 0;
  return 0;
}

static int settle_all(wtx_client *c) {
  for (size_t i = 0; i < c->n; i++) {
    int rc = settle(c, i);
    if (rc != 0) return rc;
  }
  return 0;
}

int wtx__client_finish(wtx_client *c, const char *version, char *published,
                       size_t publen) {
  /* Phase 1: every replica prepares; a failure anywhere leaves every
   * replica unpublished (the caller aborts them all). Phase 2: publish. */
  int rc = wtx__client_prepare(c, version);
  return rc != 0 ? rc : wtx__client_commit(c, version, published, publen);
}

/* text cut to fit len (with its NUL) at a character boundary: the schema
 * bounds the abort reason and wants UTF-8, so a long one is cut, not
 * refused, and never mid-character. */
static char *cut_utf8(const char *text, char *buf, size_t len) {
  size_t n = strlen(text);
  if (n >= len) {
    n = len - 1;
    while (n > 0 && ((unsigned char)text[n] & 0xC0) == 0x80) n--;
  }
  memcpy(buf, text, n);
  buf[n] = '\0';
  return buf;
}

/* AbortWeightUpdate on every replica: of our sessions, or (any) of
 * whatever session is current. Best effort: every replica is tried. */
static int abort_all(wtx_client *c, const char *reason, int any, int *aborted) {
  int first = 0;
  for (size_t i = 0; i < c->n; i++) {
    if (aborted != NULL) aborted[i] = -1;
    if (!any && c->r[i].session_id[0] == '\0') continue;
    Wtx__V1__AbortWeightUpdateRequest req = WTX__V1__ABORT_WEIGHT_UPDATE_REQUEST__INIT;
    req.session_id = any ? (char *)"" : c->r[i].session_id;
    char why[WTX_MAX_REASON_BYTES + 1];
    req.reason = cut_utf8(reason ? reason : "", why, sizeof why);
    ProtobufCMessage *m = NULL;
    int rc = call(c, i, wtx__v1__weight_transfer__abort_weight_update__method, &req.base, &m, 0);
    if (m != NULL) {
      if (aborted != NULL) aborted[i] = ((Wtx__V1__AbortWeightUpdateResponse *)m)->aborted;
      protobuf_c_message_free_unpacked(m, NULL);
    }
    if (rc != 0 && first == 0) first = rc;
  }
  return first;
}

static int grpc_abort(wtx_client *c, const char *reason) {
  return abort_all(c, reason, 0, NULL);
}

int wtx_client_abort_any(wtx_client *c, const char *reason, int *aborted) {
  if (!c->reach->services) return control_unsupported(c, "AbortWeightUpdate");
  return abort_all(c, reason, 1, aborted);
}

const char *wtx_session_state_name(int state) {
  const ProtobufCEnumValue *v =
      protobuf_c_enum_descriptor_get_value(&wtx__v1__session_state__descriptor, state);
  /* "SESSION_STATE_READY" -> "READY" */
  return v != NULL && state != 0 ? v->name + strlen("SESSION_STATE_") : "UNSPECIFIED";
}

/* Appends the page of parameters in resp to info (names malloc'd). */
static int copy_params(const Wtx__V1__GetWeightInfoResponse *resp, wtx_weight_info *info) {
  wtx_param_info *grown =
      realloc(info->params, (info->n_params + resp->n_params + 1) * sizeof *grown);
  if (grown == NULL) return WTX_ENOMEM;
  info->params = grown;
  for (size_t i = 0; i < resp->n_params; i++) {
    const Wtx__V1__ParamInfo *p = resp->params[i];
    wtx_param_info *q = &info->params[info->n_params];
    char why[64];
    const Wtx__V1__ParamMeta *pm = p->meta;
    char *name = strdup(pm != NULL ? pm->name : "");
    if (name == NULL) return WTX_ENOMEM;
    info->n_params++;
    /* A malformed entry keeps its name and reports 0 bytes rather than
     * failing the whole listing. */
    if (pm == NULL || wtx_tensor_meta_set(&q->meta, name, pm->dtype, pm->shape,
                                          pm->n_shape, why, sizeof why) != 0)
      q->meta = (wtx_tensor_meta){.name = name};
    q->xxh3 = p->xxh3_64;
    q->has_xxh3 = p->has_xxh3_64;
  }
  return 0;
}

/* The summary fields of r into out. */
static void copy_summary(const Wtx__V1__GetWeightInfoResponse *r, wtx_weight_info *out) {
  snprintf(out->version, sizeof out->version, "%s", r->weight_version);
  snprintf(out->backend, sizeof out->backend, "%s", r->backend);
  out->generation = r->generation;
  out->state = (wtx_session_state)r->state;
  out->num_params = r->num_params;
  out->total_bytes = r->total_bytes;
  out->paused = r->paused;
  out->active_target = r->active_target;
  out->draft_num_params = r->draft_num_params;
  out->draft_total_bytes = r->draft_total_bytes;
  if (r->shard != NULL) {
    out->tp_rank = r->shard->tp_rank;
    out->tp_size = r->shard->tp_size;
    out->n_shard_rules = r->shard->n_rules;
  }
}

int wtx_client_weight_info(wtx_client *c, size_t i, int include_params,
                           wtx_weight_info *out) {
  memset(out, 0, sizeof *out);
  if (!c->reach->services) return control_unsupported(c, "GetWeightInfo");
  if (i >= c->n) return WTX_EINVAL;
  Wtx__V1__GetWeightInfoRequest req = WTX__V1__GET_WEIGHT_INFO_REQUEST__INIT;
  req.include_params = include_params;
  /* The listing comes in pages; the summary is the first page's. A version
   * published between pages starts the listing again (a few times). */
  for (int page = 0, restarts = 0;; page++) {
    ProtobufCMessage *m = NULL;
    int rc = call(c, i, wtx__v1__weight_transfer__get_weight_info__method, &req.base, &m,
                  c->retries);
    if (rc != 0) return rc;
    Wtx__V1__GetWeightInfoResponse *r = (Wtx__V1__GetWeightInfoResponse *)m;
    if (page > 0 && (r->generation != out->generation ||
                     strcmp(r->weight_version, out->version) != 0) && restarts++ < 3) {
      wtx_weight_info_free(out);
      page = -1;
      req.params_offset = 0;
      protobuf_c_message_free_unpacked(m, NULL);
      continue;
    }
    if (page == 0) copy_summary(r, out);
    if (page == 0) snprintf(c->r[i].serves, sizeof c->r[i].serves, "%s", r->weight_version);
    rc = r->n_params > 0 ? copy_params(r, out) : 0;
    req.params_offset = r->next_params_offset;
    protobuf_c_message_free_unpacked(m, NULL);
    if (rc != 0 || req.params_offset == 0) return rc;
  }
}

void wtx_weight_info_free(wtx_weight_info *info) {
  for (size_t i = 0; info->params != NULL && i < info->n_params; i++)
    free((char *)info->params[i].meta.name);
  free(info->params);
  info->params = NULL;
  info->n_params = 0;
}

int wtx_client_world_size(wtx_client *c, size_t i, uint32_t *world_size) {
  if (!c->reach->services) return control_unsupported(c, "GetWorldSize");
  Wtx__V1__GetWorldSizeRequest req = WTX__V1__GET_WORLD_SIZE_REQUEST__INIT;
  ProtobufCMessage *m = NULL;
  int rc = i < c->n ? call(c, i, wtx__v1__weight_transfer__get_world_size__method, &req.base,
                           &m, c->retries)
                     : WTX_EINVAL;
  if (rc == 0) {
    *world_size = ((Wtx__V1__GetWorldSizeResponse *)m)->world_size;
    protobuf_c_message_free_unpacked(m, NULL);
  }
  return rc;
}

int wtx_client_set_version(wtx_client *c, const char *version, char *previous,
                           size_t prevlen) {
  if (!c->reach->services) return control_unsupported(c, "UpdateWeightVersion");
  if (previous != NULL && prevlen > 0) previous[0] = '\0';
  size_t n = version != NULL ? strlen(version) : 0;
  if (n == 0 || n > WTX_MAX_VERSION_BYTES) {
    seterr(c, -1, 3 /* INVALID_ARGUMENT */, "version: %zu bytes, must be 1..%d", n,
           WTX_MAX_VERSION_BYTES);
    return WTX_EINVAL;
  }
  Wtx__V1__UpdateWeightVersionRequest req = WTX__V1__UPDATE_WEIGHT_VERSION_REQUEST__INIT;
  req.weight_version = (char *)version;
  label_arg a = {"previous_version", previous, prevlen, 0};
  /* No fill: every replica gets the same request. */
  fanout f = {.method = wtx__v1__weight_transfer__update_weight_version__method,
              .fill = NULL, .take = take_label, .req = &req.base, .c = c,
              .arg = &a, .retries = 0};
  return each_replica(&f);
}

/* The published checksum of name in info, or 0 with *found 0 (absent, or
 * published without a checksum). */
static uint64_t published_sum(const wtx_weight_info *info, const char *name,
                              size_t hint, int *found) {
  for (size_t k = 0; k < info->n_params; k++) {
    const wtx_param_info *p = &info->params[(hint + k) % info->n_params];
    if (strcmp(p->meta.name, name) == 0) {
      *found = p->has_xxh3;
      return p->xxh3;
    }
  }
  *found = 0;
  return 0;
}

int wtx_client_verify(wtx_client *c, wtx_source *source, const uint64_t *xxh3) {
  if (!c->reach->services) return control_unsupported(c, "GetWeightInfo");
  const wtx_tensor_meta *metas;
  size_t n;
  int rc = wtx_source_metadata(source, &metas, &n);
  for (size_t i = 0; rc == 0 && i < c->n; i++) {
    wtx_weight_info info;
    rc = wtx_client_weight_info(c, i, 1, &info);
    if (rc == 0 && info.n_params != n) {
      seterr(c, (int)i, 0, "worker %zu (%s) holds %zu parameters, the trainer "
             "sent %zu", i, wtx_client_target(c, i), info.n_params, n);
      rc = WTX_ECHECKSUM;
    }
    /* The worker lists parameters in its own order: match by name. */
    for (size_t j = 0; rc == 0 && j < n; j++) {
      int found;
      uint64_t got = published_sum(&info, metas[j].name, j, &found);
      if (!found || got != xxh3[j]) {
        seterr(c, (int)i, 0, "worker %zu (%s): '%s' xxh3 %016llx, the trainer "
               "sent %016llx", i, wtx_client_target(c, i), metas[j].name,
               (unsigned long long)got, (unsigned long long)xxh3[j]);
        rc = WTX_ECHECKSUM;
      }
    }
    wtx_weight_info_free(&info);
  }
  return rc;
}

/* ---- a caller's control plane (control.c): one endpoint, vLLM's calls ---- */

static int control_init_start(wtx_client *c, size_t i, const Wtx__V1__InitInfo *info) {
  int rc = i == 0 ? wtx__control_begin(c->ctl, 0, &info->base) : WTX_EINVAL;
  return rc != 0 ? control_failed(c, "init_weight_transfer_engine", rc, wtx_strerror(rc)) : 0;
}

/* A control plane answers init with nothing: an empty response (no data
 * address: one endpoint, nothing chains after it). */
static int control_init_wait(wtx_client *c, size_t i,
                             Wtx__V1__InitWeightTransferEngineResponse **out) {
  if (i != 0) return WTX_EINVAL;
  char why[1024];
  int rc = wtx__control_end(c->ctl, why, sizeof why);
  if (rc != 0) return control_failed(c, "init_weight_transfer_engine", rc, why);
  if (out == NULL) return 0;
  static const uint8_t empty[1];
  *out = (Wtx__V1__InitWeightTransferEngineResponse *)protobuf_c_message_unpack(
      &wtx__v1__init_weight_transfer_engine_response__descriptor, NULL, 0, empty);
  return *out != NULL ? 0 : WTX_ENOMEM;
}

/* vLLM's start answers at once; its result waits for start_end. */
static void control_start_begin(wtx_client *c, int target, size_t params) {
  (void)params;
  char why[1024];
  int rc = wtx__control_start(c->ctl, target, why, sizeof why);
  c->r[0].begun = rc != 0 ? control_failed(c, "start_weight_update", rc, why) : 0;
}

static int control_start_end(wtx_client *c) { return c->r[0].begun; }

static int control_update_start(wtx_client *c, const Wtx__V1__UpdateInfo *ui) {
  int rc = wtx__control_begin(c->ctl, 1, &ui->base);
  return rc != 0 ? control_failed(c, "update_weights", rc, wtx_strerror(rc)) : 0;
}

static int control_update_wait(wtx_client *c) {
  char why[1024];
  int rc = wtx__control_end(c->ctl, why, sizeof why);
  return rc != 0 ? control_failed(c, "update_weights", rc, why) : 0;
}

static int control_refused(wtx_client *c) { return wtx__control_failed(c->ctl); }

/* vLLM's calls carry no table: params every time. */
static uint64_t control_table(const wtx_client *c) {
  (void)c;
  return 0;
}

/* vLLM's finish prepares and publishes in one call. */
static int control_prepare(wtx_client *c, const char *version) {
  (void)c;
  (void)version;
  return 0;
}

static int control_commit(wtx_client *c, const char *version, char *published, size_t publen) {
  char why[1024];
  int rc = wtx__control_finish(c->ctl, version, why, sizeof why);
  if (rc != 0) return control_failed(c, "finish_weight_update", rc, why);
  /* Its answer is empty: what it serves is the version this finish named
   * ("" when the engine numbered it, not known here). */
  snprintf(c->r[0].serves, sizeof c->r[0].serves, "%s", version ? version : "");
  if (published != NULL) snprintf(published, publen, "%s", c->r[0].serves);
  return 0;
}

static int control_abort(wtx_client *c, const char *reason) {
  wtx__control_abort(c->ctl, reason);
  return 0;
}

static const char *control_target(const wtx_client *c, size_t i) {
  (void)c;
  return i == 0 ? CONTROL_TARGET : NULL;
}

static void control_release(wtx_client *c) { wtx__control_destroy(c->ctl); }

static const reach via_grpc = {
    .init_start = grpc_init_start,
    .init_wait = grpc_init_wait,
    .start_begin = grpc_start_begin,
    .start_end = grpc_start_end,
    .update_start = grpc_update_start,
    .update_wait = grpc_update_wait,
    .refused = grpc_refused,
    .table = grpc_table,
    .prepare = grpc_prepare,
    .commit = grpc_commit,
    .abort = grpc_abort,
    .target = grpc_target,
    .release = grpc_release,
    .services = 1,
};

static const reach via_control = {
    .init_start = control_init_start,
    .init_wait = control_init_wait,
    .start_begin = control_start_begin,
    .start_end = control_start_end,
    .update_start = control_update_start,
    .update_wait = control_update_wait,
    .refused = control_refused,
    .table = control_table,
    .prepare = control_prepare,
    .commit = control_commit,
    .abort = control_abort,
    .target = control_target,
    .release = control_release,
    .services = 0,
};

/* ---- fanout.h: every call through the client's reach ---- */

int wtx__client_init_start(wtx_client *c, size_t i, const Wtx__V1__InitInfo *info) {
  return c->reach->init_start(c, i, info);
}

int wtx__client_init_wait(wtx_client *c, size_t i,
                          Wtx__V1__InitWeightTransferEngineResponse **resp) {
  if (resp != NULL) *resp = NULL;
  return c->reach->init_wait(c, i, resp);
}

void wtx__client_start_begin(wtx_client *c, int target, size_t params) {
  c->reach->start_begin(c, target, params);
}

int wtx__client_start_end(wtx_client *c) { return c->reach->start_end(c); }

int wtx__client_update_start(wtx_client *c, const Wtx__V1__UpdateInfo *ui) {
  return wtx__client_update_start_batch(c, &ui, 1);
}

int wtx__client_update_start_batch(wtx_client *c, const Wtx__V1__UpdateInfo *const *ui,
                                   size_t n) {
  count_update(c, ui, n);
  if (n == 1) return c->reach->update_start(c, ui[0]);
  return wtx__client_batches(c) ? grpc_update_send(c, ui[0], ui + 1, n - 1, 0) : WTX_ENOTSUP;
}

int wtx__client_update_wait(wtx_client *c) { return c->reach->update_wait(c); }

/* How often a wait that a stop may end looks at it, and how long the
 * calls still get once it fired: a worker's refusal, racing the failure
 * it caused elsewhere, is the better error. */
enum { STOP_POLL_MS = 20, STOP_GRACE_MS = 200 };

/* 1 when replica i's call in flight ends within ms (or none is). */
static int ended_within(wtx_client *c, size_t i, int ms) {
  replica *r = &c->r[i];
  return r->begun != 0 || r->pending == NULL || wtx__rpc_unary_poll_within(r->pending, ms, NULL);
}

int wtx__client_update_wait_stop(wtx_client *c, const wtx_stop *stop) {
  int stopped = 0;
  for (size_t i = 0; c->reach == &via_grpc && i < c->n && !stopped; i++)
    while (!ended_within(c, i, STOP_POLL_MS) && !(stopped = wtx_stop_now(stop))) {
    }
  int64_t until = wtx__clock_ms() + STOP_GRACE_MS;
  for (size_t i = 0; stopped && i < c->n; i++) {
    int64_t left = until - wtx__clock_ms();
    if (!ended_within(c, i, left > 0 ? (int)left : 0)) wtx__rpc_unary_cancel(c->r[i].pending);
  }
  int rc = c->reach->update_wait(c);
  return rc != 0 && stopped && c->err_status == GRPC_STATUS_CANCELLED ? WTX_ECANCELED : rc;
}
int wtx__client_update_refused(wtx_client *c) { return c->reach->refused(c); }
uint64_t wtx__client_table(const wtx_client *c) { return c->reach->table(c); }
int wtx__client_prepare(wtx_client *c, const char *version) {
  return c->reach->prepare(c, version);
}
int wtx__client_abort(wtx_client *c, const char *reason) { return c->reach->abort(c, reason); }
const char *wtx_client_target(const wtx_client *c, size_t i) { return c->reach->target(c, i); }

/* One client's FinishWeightUpdate on every replica (published: replica 0's
 * label). */
static int commit_one(wtx_client *c, const char *version, char *published, size_t publen) {
  if (published != NULL && publen > 0) published[0] = '\0';
  return c->reach->commit(c, version, published, publen);
}
