/* wtx sync client: typed fan-out over every replica (see client.h). */
#include "client/client.h"

#include <grpc/grpc_security.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "wtx/v1/weight_transfer.grpc-c.h"

typedef struct replica {
  wtx_rpc_channel *ch;
  char session_id[64];
  uint64_t update_id;
  wtx_rpc_pending *pending;
} replica;

struct wtx_client {
  replica *r;
  size_t n;
  int64_t timeout_ms;
  int retries;
  char *auth; /* "Bearer ..." */
  char err[1400];
  int err_replica;
  int err_status;
};

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
                       const wtx_rpc_status *st) {
  seterr(c, (int)i, st->code, "worker %zu (%s): %s: %s: %s", i,
         wtx_rpc_channel_target(c->r[i].ch), method, wtx_rpc_code_name(st->code),
         st->message[0] ? st->message : wtx_strerror(rc));
  return rc;
}

static wtx_rpc_call_options call_opts(const wtx_client *c, wtx_rpc_metadata *md) {
  wtx_rpc_call_options o = WTX_RPC_CALL_OPTIONS_INIT;
  o.timeout_ms = c->timeout_ms;
  if (c->auth != NULL) {
    md->key = "authorization";
    md->value = c->auth;
    o.metadata = md;
    o.n_metadata = 1;
  }
  return o;
}

int wtx_client_create(const char *const *targets, size_t n,
                      const wtx_client_options *opts, wtx_client **out) {
  *out = NULL;
  if (n == 0) return WTX_EINVAL;
  wtx_client_options o = WTX_CLIENT_OPTIONS_INIT;
  if (opts != NULL) o = *opts;
  wtx_client *c = calloc(1, sizeof *c);
  if (c == NULL || (c->r = calloc(n, sizeof *c->r)) == NULL) {
    free(c);
    return WTX_ENOMEM;
  }
  c->timeout_ms = o.timeout_ms > 0 ? o.timeout_ms : 300000;
  c->retries = o.retries > 0 ? o.retries : 0;
  c->err_replica = -1;
  if (o.token != NULL) {
    c->auth = malloc(strlen(o.token) + 8);
    if (c->auth == NULL) {
      wtx_client_destroy(c);
      return WTX_ENOMEM;
    }
    sprintf(c->auth, "Bearer %s", o.token);
  }
  grpc_channel_credentials *creds = NULL;
  if (o.tls_ca_pem != NULL) {
    grpc_ssl_pem_key_cert_pair pair = {o.tls_key_pem, o.tls_cert_pem};
    creds = grpc_ssl_credentials_create(
        o.tls_ca_pem, o.tls_cert_pem && o.tls_key_pem ? &pair : NULL, NULL, NULL);
  }
  wtx_rpc_channel_options co = WTX_RPC_CHANNEL_OPTIONS_INIT;
  co.credentials = creds;
  co.max_message_bytes = 64 << 20;
  int rc = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    rc = wtx_rpc_channel_create(targets[i], &co, &c->r[i].ch);
    if (rc == 0) c->n++;
  }
  if (creds != NULL) grpc_channel_credentials_release(creds);
  if (rc != 0) {
    wtx_client_destroy(c);
    return rc;
  }
  *out = c;
  return 0;
}

void wtx_client_destroy(wtx_client *c) {
  if (c == NULL) return;
  for (size_t i = 0; i < c->n; i++) {
    if (c->r[i].pending != NULL) {
      wtx_rpc_unary_cancel(c->r[i].pending);
      ProtobufCMessage *m = NULL;
      wtx_rpc_unary_wait(c->r[i].pending, &m, NULL);
      if (m != NULL) protobuf_c_message_free_unpacked(m, NULL);
    }
    wtx_rpc_channel_destroy(c->r[i].ch);
  }
  free(c->r);
  free(c->auth);
  free(c);
}

size_t wtx_client_size(const wtx_client *c) { return c->n; }

const char *wtx_client_target(const wtx_client *c, size_t i) {
  return i < c->n ? wtx_rpc_channel_target(c->r[i].ch) : NULL;
}

const char *wtx_client_last_error(const wtx_client *c) { return c->err; }
int wtx_client_last_replica(const wtx_client *c) { return c->err_replica; }
int wtx_client_last_status(const wtx_client *c) { return c->err_status; }

/* One unary call on replica i, retried when idempotent and the failure is
 * transient. */
static int call(wtx_client *c, size_t i, const wtx_rpc_method *m,
                const ProtobufCMessage *req, ProtobufCMessage **resp, int idempotent) {
  wtx_rpc_metadata md;
  wtx_rpc_call_options o = call_opts(c, &md);
  wtx_rpc_status st;
  int rc = 0;
  for (int attempt = 0;; attempt++) {
    rc = wtx_rpc_unary(c->r[i].ch, m, req, resp, &o, &st);
    int transient = st.code == GRPC_STATUS_UNAVAILABLE ||
                    st.code == GRPC_STATUS_DEADLINE_EXCEEDED;
    if (rc == 0 || !idempotent || !transient || attempt >= c->retries) break;
    struct timespec ts = {0, (100L << attempt) * 1000000L};
    if (ts.tv_nsec >= 1000000000L) ts = (struct timespec){(100L << attempt) / 1000, 0};
    nanosleep(&ts, NULL);
  }
  if (rc != 0) call_failed(c, i, m->name, rc, &st);
  return rc;
}

int wtx_client_init_start(wtx_client *c, size_t i, const Wtx__V1__InitInfo *info) {
  if (i >= c->n || c->r[i].pending != NULL) return WTX_EINVAL;
  Wtx__V1__InitWeightTransferEngineRequest req =
      WTX__V1__INIT_WEIGHT_TRANSFER_ENGINE_REQUEST__INIT;
  req.init_info = (Wtx__V1__InitInfo *)info;
  wtx_rpc_metadata md;
  wtx_rpc_call_options o = call_opts(c, &md);
  c->r[i].session_id[0] = '\0';
  int rc = wtx_rpc_unary_start(c->r[i].ch, wtx__v1__weight_transfer__init_weight_transfer_engine__method,
                               &req.base, &o, &c->r[i].pending);
  if (rc != 0)
    seterr(c, (int)i, 0, "worker %zu (%s): InitWeightTransferEngine: cannot start "
           "the call: %s", i, wtx_rpc_channel_target(c->r[i].ch), wtx_strerror(rc));
  return rc;
}

int wtx_client_init_wait(wtx_client *c, size_t i,
                         Wtx__V1__InitWeightTransferEngineResponse **resp_out) {
  if (resp_out != NULL) *resp_out = NULL;
  if (i >= c->n || c->r[i].pending == NULL) return WTX_EINVAL;
  ProtobufCMessage *m = NULL;
  wtx_rpc_status st;
  int rc = wtx_rpc_unary_wait(c->r[i].pending, &m, &st);
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

int wtx_client_init_one(wtx_client *c, size_t i, const Wtx__V1__InitInfo *info,
                        Wtx__V1__InitWeightTransferEngineResponse **resp_out) {
  int rc = wtx_client_init_start(c, i, info);
  return rc != 0 ? rc : wtx_client_init_wait(c, i, resp_out);
}

int wtx_client_start(wtx_client *c, int target) {
  for (size_t i = 0; i < c->n; i++) {
    Wtx__V1__StartWeightUpdateRequest req = WTX__V1__START_WEIGHT_UPDATE_REQUEST__INIT;
    req.session_id = c->r[i].session_id;
    req.target = (Wtx__V1__UpdateTarget)target;
    ProtobufCMessage *m = NULL;
    int rc = call(c, i, wtx__v1__weight_transfer__start_weight_update__method, &req.base, &m, 0);
    if (rc != 0) return rc;
    c->r[i].update_id = ((Wtx__V1__StartWeightUpdateResponse *)m)->update_id;
    protobuf_c_message_free_unpacked(m, NULL);
  }
  return 0;
}

int wtx_client_update_start(wtx_client *c, const Wtx__V1__UpdateInfo *ui) {
  wtx_rpc_metadata md;
  wtx_rpc_call_options o = call_opts(c, &md);
  int first = 0;
  for (size_t i = 0; i < c->n; i++) {
    if (c->r[i].pending != NULL) return WTX_ESTATE;
    Wtx__V1__UpdateWeightsRequest req = WTX__V1__UPDATE_WEIGHTS_REQUEST__INIT;
    req.session_id = c->r[i].session_id;
    req.update_id = c->r[i].update_id;
    req.update_info = (Wtx__V1__UpdateInfo *)ui;
    int rc = wtx_rpc_unary_start(c->r[i].ch, wtx__v1__weight_transfer__update_weights__method, &req.base,
                                 &o, &c->r[i].pending);
    if (rc != 0 && first == 0) {
      first = rc;
      seterr(c, (int)i, 0, "worker %zu (%s): UpdateWeights: cannot start the "
             "call: %s", i, wtx_rpc_channel_target(c->r[i].ch), wtx_strerror(rc));
    }
  }
  return first;
}

/* A failure that only follows from another one (a broken stream, a
 * cancelled call) says less than a refusal: it ranks after it. */
static int consequential(int code) {
  return code == GRPC_STATUS_UNAVAILABLE || code == GRPC_STATUS_CANCELLED ||
         code == GRPC_STATUS_DEADLINE_EXCEEDED || code == GRPC_STATUS_ABORTED;
}

int wtx_client_update_wait(wtx_client *c) {
  int first = 0;
  size_t cause = 0, failed = 0;
  char cause_msg[sizeof c->err] = "", others[300] = "";
  int cause_code = 0;
  /* Every started call is waited for, even after a failure; the error
   * reported is the most telling one (a refusal over a broken stream), and
   * the other failing replicas are listed after it. */
  for (size_t i = 0; i < c->n; i++) {
    if (c->r[i].pending == NULL) continue;
    ProtobufCMessage *m = NULL;
    wtx_rpc_status st;
    int rc = wtx_rpc_unary_wait(c->r[i].pending, &m, &st);
    c->r[i].pending = NULL;
    if (m != NULL) protobuf_c_message_free_unpacked(m, NULL);
    if (rc == 0) continue;
    failed++;
    if (first == 0 || (consequential(cause_code) && !consequential(st.code))) {
      if (first != 0) {
        size_t o = strlen(others);
        snprintf(others + o, sizeof others - o, "%s%zu", o ? ", " : "", cause);
      }
      first = rc;
      cause = i;
      cause_code = st.code;
      call_failed(c, i, "UpdateWeights", rc, &st);
      snprintf(cause_msg, sizeof cause_msg, "%s", c->err);
    } else {
      size_t o = strlen(others);
      snprintf(others + o, sizeof others - o, "%s%zu", o ? ", " : "", i);
    }
  }
  if (first != 0) {
    seterr(c, (int)cause, cause_code, "%s%s%s%s", cause_msg,
           failed > 1 ? " (also failed: worker " : "", failed > 1 ? others : "",
           failed > 1 ? ")" : "");
  }
  return first;
}

int wtx_client_finish(wtx_client *c, const char *version, char **published) {
  if (published != NULL) *published = NULL;
  for (size_t i = 0; i < c->n; i++) {
    Wtx__V1__FinishWeightUpdateRequest req = WTX__V1__FINISH_WEIGHT_UPDATE_REQUEST__INIT;
    req.session_id = c->r[i].session_id;
    req.update_id = c->r[i].update_id;
    req.weight_version = (char *)(version ? version : "");
    ProtobufCMessage *m = NULL;
    int rc = call(c, i, wtx__v1__weight_transfer__finish_weight_update__method, &req.base, &m, 0);
    if (rc != 0) return rc;
    if (i == 0 && published != NULL)
      *published = strdup(((Wtx__V1__FinishWeightUpdateResponse *)m)->weight_version);
    protobuf_c_message_free_unpacked(m, NULL);
  }
  return 0;
}

/* AbortWeightUpdate on every replica: of our sessions, or (any) of
 * whatever session is current. */
static int abort_all(wtx_client *c, const char *reason, int any, int *aborted) {
  int first = 0;
  for (size_t i = 0; i < c->n; i++) {
    if (aborted != NULL) aborted[i] = -1;
    if (!any && c->r[i].session_id[0] == '\0') continue;
    Wtx__V1__AbortWeightUpdateRequest req = WTX__V1__ABORT_WEIGHT_UPDATE_REQUEST__INIT;
    req.session_id = any ? (char *)"" : c->r[i].session_id;
    req.reason = (char *)(reason ? reason : "");
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

int wtx_client_abort(wtx_client *c, const char *reason) {
  return abort_all(c, reason, 0, NULL);
}

int wtx_client_abort_any(wtx_client *c, const char *reason, int *aborted) {
  return abort_all(c, reason, 1, aborted);
}

int wtx_client_weight_info(wtx_client *c, size_t i, int include_params,
                           Wtx__V1__GetWeightInfoResponse **resp) {
  Wtx__V1__GetWeightInfoRequest req = WTX__V1__GET_WEIGHT_INFO_REQUEST__INIT;
  req.include_params = include_params;
  ProtobufCMessage *m = NULL;
  int rc = i < c->n ? call(c, i, wtx__v1__weight_transfer__get_weight_info__method, &req.base, &m, 1) : WTX_EINVAL;
  *resp = (Wtx__V1__GetWeightInfoResponse *)m;
  return rc;
}

int wtx_client_world_size(wtx_client *c, size_t i, uint32_t *world_size) {
  Wtx__V1__GetWorldSizeRequest req = WTX__V1__GET_WORLD_SIZE_REQUEST__INIT;
  ProtobufCMessage *m = NULL;
  int rc = i < c->n ? call(c, i, wtx__v1__weight_transfer__get_world_size__method, &req.base, &m, 1) : WTX_EINVAL;
  if (rc == 0) {
    *world_size = ((Wtx__V1__GetWorldSizeResponse *)m)->world_size;
    protobuf_c_message_free_unpacked(m, NULL);
  }
  return rc;
}

int wtx_client_set_version(wtx_client *c, const char *version, char **previous) {
  if (previous != NULL) *previous = NULL;
  for (size_t i = 0; i < c->n; i++) {
    Wtx__V1__UpdateWeightVersionRequest req = WTX__V1__UPDATE_WEIGHT_VERSION_REQUEST__INIT;
    req.weight_version = (char *)version;
    ProtobufCMessage *m = NULL;
    int rc = call(c, i, wtx__v1__weight_transfer__update_weight_version__method, &req.base, &m, 0);
    if (rc != 0) return rc;
    if (i == 0 && previous != NULL)
      *previous = strdup(((Wtx__V1__UpdateWeightVersionResponse *)m)->previous_version);
    protobuf_c_message_free_unpacked(m, NULL);
  }
  return 0;
}

int wtx_client_verify(wtx_client *c, wtx_source *source, const uint64_t *xxh3) {
  const wtx_tensor_meta *metas;
  size_t n;
  int rc = wtx_source_metadata(source, &metas, &n);
  for (size_t i = 0; rc == 0 && i < c->n; i++) {
    Wtx__V1__GetWeightInfoResponse *resp = NULL;
    rc = wtx_client_weight_info(c, i, 1, &resp);
    if (rc != 0) return rc;
    if (resp->n_params != n) {
      seterr(c, (int)i, 0, "worker %zu (%s) holds %zu parameters, the trainer "
             "sent %zu", i, wtx_client_target(c, i), resp->n_params, n);
      rc = WTX_ECHECKSUM;
    }
    /* The worker lists parameters in its own order: match by name. */
    for (size_t j = 0; rc == 0 && j < n; j++) {
      const Wtx__V1__ParamInfo *p = NULL;
      for (size_t k = 0; k < resp->n_params && p == NULL; k++) {
        size_t q = (j + k) % resp->n_params;
        if (strcmp(resp->params[q]->meta->name, metas[j].name) == 0) p = resp->params[q];
      }
      if (p == NULL || p->xxh3_64 != xxh3[j]) {
        seterr(c, (int)i, 0, "worker %zu (%s): '%s' xxh3 %016llx, the trainer "
               "sent %016llx", i, wtx_client_target(c, i), metas[j].name,
               p ? (unsigned long long)p->xxh3_64 : 0ULL,
               (unsigned long long)xxh3[j]);
        rc = WTX_ECHECKSUM;
      }
    }
    protobuf_c_message_free_unpacked(&resp->base, NULL);
  }
  return rc;
}
