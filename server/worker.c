/* wtx_worker: one session behind a gRPC server, with health, reflection,
 * the internal store and the publisher (see wtx/worker.h). */
#include <grpc/grpc_security.h>
#include <microhttpd.h>
#include <netdb.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/clock.h"
#include "common/log.h"
#include "common/safetensors.h"
#include "common/text.h"
#include "cuda/cuda.h"
#include "rpc/services.h"
#include "server/auth.h"
#include "server/publish.h"
#include "server/session.h"
#include "server/vllm.h"

struct wtx_worker {
  wtx__rpc_server *srv;
  wtx__rpc_health *health;
  wtx__publisher *publisher;
  wtx__vllm *vllm; /* the sidecar bridge, --vllm-url */
  wtx__metrics *metrics;
  struct MHD_Daemon *http; /* GET /metrics */
  int metrics_port;
  /* The host's Pause / Resume, called after the bridge's forwarding. */
  void (*host_pause)(void *host, int wait);
  void (*host_resume)(void *host);
  void *host;
  wtx__auth *auth;
  wtx_session session;
  int session_ready;
  wtx_store *own_store; /* NULL with a host model */
  const wtx_worker_transport *transports[16];
  wtx_worker_env env;
  wtx__netallow *allow_upstream;
  char *cuda_device; /* the option's copy, or NULL */
  wtx_shard_rule *shard_rules; /* parsed shard_rules, or NULL */
  int port;
  int drained;
  pthread_mutex_t mu;
};

/* Every WeightTransfer call gets the session as its user data. */
static const Wtx__V1__WeightTransfer_Handlers handlers = {
    .init_weight_transfer_engine = wtx__handle_init,
    .start_weight_update = wtx__handle_start,
    .update_weights = wtx__handle_update,
    .prepare_weight_update = wtx__handle_prepare,
    .finish_weight_update = wtx__handle_finish,
    .abort_weight_update = wtx__handle_abort,
    .update_weight_version = wtx__handle_version,
    .get_weight_info = wtx__handle_info,
    .get_world_size = wtx__handle_world,
    .pause = wtx__handle_pause,
    .resume = wtx__handle_resume,
};

static int on_commit(void *user, wtx_target target, char *err, size_t errlen) {
  wtx_worker *w = user;
  if (target == WTX_TARGET_MAIN && w->publisher != NULL)
    wtx__publisher_notify(w->publisher);
  if (target != WTX_TARGET_MAIN || w->vllm == NULL) return 0;
  int rc = wtx__vllm_publish(w->vllm, err, errlen);
  wtx__metrics_bridge(w->metrics, rc == 0, wtx__clock_unix_s());
  return rc;
}

/* GET /metrics: the Prometheus text; anything else 404 / 405. */
static enum MHD_Result on_http(void *cls, struct MHD_Connection *conn, const char *url,
                               const char *method, const char *version, const char *upload,
                               size_t *upload_size, void **state) {
  (void)version, (void)upload, (void)upload_size, (void)state;
  wtx_worker *w = cls;
  unsigned status = MHD_HTTP_OK;
  char *body = NULL;
  if (strcmp(method, "GET") != 0) {
    status = MHD_HTTP_METHOD_NOT_ALLOWED;
  } else if (strcmp(url, "/metrics") != 0) {
    status = MHD_HTTP_NOT_FOUND;
  } else {
    wtx__metrics_now now = {.state = wtx__session_state(&w->session)};
    wtx_store_view v;
    if (w->own_store != NULL && wtx_store_acquire(w->own_store, WTX_TARGET_MAIN, &v) == 0) {
      now.generation = v.generation;
      now.bytes = v.total_bytes;
      wtx_store_release(w->own_store, &v);
    }
    if ((body = wtx__metrics_render(w->metrics, &now)) == NULL)
      status = MHD_HTTP_INTERNAL_SERVER_ERROR;
  }
  struct MHD_Response *r =
      body != NULL ? MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_FREE)
                   : MHD_create_response_from_buffer(0, (void *)"", MHD_RESPMEM_PERSISTENT);
  if (r == NULL) {
    free(body);
    return MHD_NO;
  }
  if (body != NULL)
    MHD_add_response_header(r, "Content-Type", "text/plain; version=0.0.4; charset=utf-8");
  enum MHD_Result ok = MHD_queue_response(conn, status, r);
  MHD_destroy_response(r);
  return ok;
}

/* The metrics and their HTTP server, when the options ask for them. */
static int open_metrics(wtx_worker *w, const char *listen, char *err, size_t errlen) {
  if (listen == NULL || listen[0] == '\0') return 0;
  char host[256], port[32];
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_NUMERICSERV}, *ai = NULL;
  if (wtx__split_hostport(listen, host, sizeof host, port, sizeof port) != 0 ||
      getaddrinfo(host, port, &hints, &ai) != 0) {
    snprintf(err, errlen, "metrics_listen: '%s' is not host:port", listen);
    return WTX_EINVAL;
  }
  int rc = wtx__metrics_create(&w->metrics);
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD |
                   (ai->ai_family == AF_INET6 ? MHD_USE_IPv6 : 0);
  if (rc == 0)
    w->http = MHD_start_daemon(flags, 0, NULL, NULL, on_http, w, MHD_OPTION_SOCK_ADDR,
                               ai->ai_addr, MHD_OPTION_END);
  freeaddrinfo(ai);
  if (rc == 0 && w->http == NULL) {
    snprintf(err, errlen, "metrics_listen: cannot serve on %s", listen);
    return WTX_EIO;
  }
  const union MHD_DaemonInfo *info =
      rc == 0 ? MHD_get_daemon_info(w->http, MHD_DAEMON_INFO_BIND_PORT) : NULL;
  w->metrics_port = info != NULL ? info->port : 0;
  return rc;
}

static int serving_version(void *user, char *out, size_t len) {
  wtx_worker *w = user;
  return w->vllm != NULL ? wtx__vllm_serving(w->vllm, out, len) : WTX_ENOTSUP;
}

/* Pause / Resume: forwarded to vLLM (the bridge), then the host's. The
 * state they answer is vLLM's when there is a bridge; a host's callbacks
 * return nothing, so without one the call is taken as done. */
static int on_pause(void *user, int wait, int was) {
  wtx_worker *w = user;
  int paused = w->vllm != NULL ? wtx__vllm_pause(w->vllm, wait, was) : 1;
  if (w->host_pause != NULL) w->host_pause(w->host, wait);
  return paused;
}

static int on_resume(void *user, int was) {
  wtx_worker *w = user;
  int paused = w->vllm != NULL ? wtx__vllm_resume(w->vllm, was) : 0;
  if (w->host_resume != NULL) w->host_resume(w->host);
  return paused;
}

/* The sidecar bridge, when the options ask for one. */
static int open_vllm(wtx_worker *w, const wtx_worker_options *opts, char *err, size_t errlen) {
  if (opts->vllm_url == NULL || opts->vllm_url[0] == '\0') return 0;
  if (w->own_store == NULL) {
    snprintf(err, errlen, "vllm_url: only with the internal store, not a host's model");
    return WTX_EINVAL;
  }
  wtx__vllm_config vc = {opts->vllm_url, opts->vllm_dir, opts->vllm_pause_mode,
                         opts->vllm_disk, opts->vllm_timeout_ms, 2};
  return wtx__vllm_create(w->own_store, &vc, &w->vllm, err, errlen);
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
    wtx__log(WTX__LOG_INFO, "event=model_spec file=%s params=%zu", path, n);
  free(metas);
  wtx_st_close(f);
  return rc;
}

/* The worker transports for opts->backends (default: the built-ins), at
 * most one per InitInfo member. */
static int resolve_backends(wtx_worker *w, const wtx_worker_options *opts,
                            size_t *n_out, char *err, size_t errlen) {
  const char *const *names = opts->backends ? opts->backends : wtx_builtin_backends;
  size_t n = opts->backends ? opts->n_backends : wtx_n_builtin_backends;
  if (n == 0 || n > sizeof w->transports / sizeof w->transports[0]) {
    snprintf(err, errlen, "backends: %zu named, must be 1..%zu", n,
             sizeof w->transports / sizeof w->transports[0]);
    return WTX_EINVAL;
  }
  for (size_t i = 0; i < n; i++) {
    const wtx_worker_transport *t = wtx_worker_transport_find(names[i]);
    if (t == NULL) {
      char known[256];
      wtx_worker_transport_names(known, sizeof known);
      snprintf(err, errlen, "backends: '%s' is not registered (registered: %s)",
               names[i], known);
      return WTX_EINVAL;
    }
    for (size_t j = 0; j < i; j++)
      if (w->transports[j]->init_case == t->init_case) {
        snprintf(err, errlen, "backends: '%s' and '%s' both serve init_info.%s",
                 w->transports[j]->name, t->name, wtx_init_case_name(t->init_case));
        return WTX_EINVAL;
      }
    w->transports[i] = t;
  }
  *n_out = n;
  return 0;
}

/* The model (internal store unless the host brings one), its layout and
 * its publisher. */
static int open_model(wtx_worker *w, const wtx_worker_options *opts,
                      wtx__session_config *cfg, char *err, size_t errlen) {
  cfg->model_ops = opts->model_ops;
  cfg->model = opts->model;
  if (opts->model_ops == NULL) {
    int rc = wtx_store_create(&w->own_store);
    if (rc != 0) return rc;
    cfg->model_ops = &wtx_store_model_ops;
    cfg->model = cfg->store = w->own_store;
  } else if (opts->model_spec != NULL || opts->publish_dir != NULL) {
    snprintf(err, errlen, "model_spec and publish_dir need the internal store, "
             "not a host model");
    return WTX_EINVAL;
  } else if (opts->model_ops->version == 0 || opts->model_ops->version > WTX_MODEL_OPS_VERSION) {
    snprintf(err, errlen, "model_ops.version: %u, this library knows 1..%u "
             "(WTX_MODEL_OPS_VERSION)", opts->model_ops->version, WTX_MODEL_OPS_VERSION);
    return WTX_EINVAL;
  }
  /* A host region is made only for a model that reads it in place. */
  w->env.host_adopt = wtx__model_adopts_host(cfg->model_ops);
  int rc = opts->model_spec ? declare_spec(w->own_store, opts->model_spec, err, errlen) : 0;
  if (rc != 0 || opts->publish_dir == NULL) return rc;
  int keep = opts->publish_keep > 0 ? opts->publish_keep : WTX_DEFAULT_PUBLISH_KEEP;
  rc = wtx__publisher_create(w->own_store, opts->publish_dir, keep, &w->publisher);
  if (rc == WTX_ENOENT)
    snprintf(err, errlen, "publish_dir: %s is not a writable directory",
             opts->publish_dir);
  return rc;
}

/* TLS server credentials from opts (NULL for plaintext); an error when
 * they are asked for but incomplete or do not build. */
static int server_credentials(const wtx_worker_options *opts,
                              grpc_server_credentials **out, char *err, size_t errlen) {
  *out = NULL;
  if (opts->tls_cert_pem == NULL && opts->tls_key_pem == NULL) {
    if (opts->tls_client_ca_pem == NULL) return 0;
    snprintf(err, errlen, "tls_client_ca: mutual TLS needs tls_cert and tls_key too");
    return WTX_EINVAL;
  }
  if (opts->tls_cert_pem == NULL || opts->tls_key_pem == NULL) {
    snprintf(err, errlen, "tls_cert and tls_key go together");
    return WTX_EINVAL;
  }
  grpc_ssl_pem_key_cert_pair pair = {opts->tls_key_pem, opts->tls_cert_pem};
  *out = grpc_ssl_server_credentials_create_ex(
      opts->tls_client_ca_pem, &pair, 1,
      opts->tls_client_ca_pem ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                              : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
      NULL);
  if (*out == NULL) {
    snprintf(err, errlen, "tls: the certificate, key or client CA do not build "
             "TLS credentials");
    return WTX_EINVAL;
  }
  return 0;
}

/* The gRPC server with WeightTransfer, health and (unless off)
 * reflection, behind the token check, listening. */
static int open_server(wtx_worker *w, const wtx_worker_options *opts, char *err,
                       size_t errlen) {
  wtx__rpc_server_options so = WTX__RPC_SERVER_OPTIONS_INIT;
  so.max_receive_message_bytes = opts->max_message_bytes > 0
                                     ? opts->max_message_bytes
                                     : WTX_DEFAULT_MAX_MESSAGE_BYTES;
  so.max_calls = opts->max_calls > 0 ? opts->max_calls : WTX_DEFAULT_MAX_CALLS;
  so.authorize = wtx__auth_check;
  so.auth_data = w->auth;
  int rc = server_credentials(opts, &so.credentials, err, errlen);
  if (rc == 0) rc = wtx__rpc_server_create(&so, &w->srv);
  if (rc == 0)
    rc = wtx__rpc_server_add_service(w->srv, &wtx__v1__weight_transfer__grpc,
                                    &handlers, &w->session);
  if (rc == 0) rc = wtx__rpc_health_create(w->srv, &w->health);
  if (rc == 0 && opts->reflection != WTX_REFLECTION_OFF)
    rc = wtx__rpc_server_add_reflection(w->srv);
  if (rc == 0 && (rc = wtx__rpc_server_start(w->srv, opts->listen, &w->port)) != 0)
    snprintf(err, errlen, "listen: cannot bind %s", opts->listen);
  if (rc == 0) wtx__rpc_health_set(w->health, 1);
  if (so.credentials != NULL) grpc_server_credentials_release(so.credentials);
  return rc;
}

/* Checks and keeps the GPU backends' device (a typo fails at start, not at
 * the first GPU init). */
static int cuda_device(wtx_worker *w, const char *ordinal, char *err, size_t errlen) {
  int device;
  int rc = wtx__cuda_device(ordinal, &device, err, errlen);
  if (rc != 0 || ordinal == NULL) return rc;
  w->cuda_device = strdup(ordinal);
  w->env.cuda_device = w->cuda_device;
  return w->cuda_device != NULL ? 0 : WTX_ENOMEM;
}

/* Parses and checks the shard rules of a tensor-parallel rank. */
static int open_shard(wtx_worker *w, const wtx_worker_options *opts, wtx__session_config *cfg,
                      char *err, size_t errlen) {
  if (opts->shard_rules == NULL) return 0;
  if (opts->model_spec != NULL || opts->vllm_url != NULL) {
    snprintf(err, errlen, "shard rules: not with %s, which describes whole tensors",
             opts->model_spec != NULL ? "a model spec" : "a vLLM sidecar");
    return WTX_EINVAL;
  }
  size_t n = 0;
  int rc = wtx_shard_rules_parse(opts->shard_rules, &w->shard_rules, &n, err, errlen);
  char why[512];
  if (rc == 0 && (rc = wtx_shard_rules_check(w->shard_rules, n, opts->tp_rank, opts->tp_size,
                                             why, sizeof why)) != 0)
    snprintf(err, errlen, "shard rules: %s", why);
  cfg->shard_rules = w->shard_rules;
  cfg->n_shard_rules = n;
  cfg->tp_rank = opts->tp_rank;
  cfg->tp_size = opts->tp_size;
  return rc;
}

int wtx_worker_start(const wtx_worker_options *opts, wtx_worker **out, char *err,
                     size_t errlen) {
  *out = NULL;
  if (errlen > 0) err[0] = '\0';
  if (opts == NULL || opts->listen == NULL) {
    snprintf(err, errlen, "listen: missing (host:port)");
    return WTX_EINVAL;
  }
  wtx_transports_register_builtin();
  wtx_worker *w = calloc(1, sizeof *w);
  if (w == NULL) return WTX_ENOMEM;
  pthread_mutex_init(&w->mu, NULL);
  wtx__session_config cfg = {
      .world_size = opts->world_size,
      .watchdog_ms = opts->watchdog_ms,
      .max_model_bytes = opts->max_model_bytes,
      .max_params = opts->max_params,
      .on_pause = on_pause,
      .on_resume = on_resume,
      .host = w,
      .on_commit = on_commit,
      .on_commit_user = w,
      .serving_version = serving_version,
      .transports = w->transports,
      .env = &w->env,
  };
  int rc = resolve_backends(w, opts, &cfg.n_transports, err, errlen);
  if (rc == 0) rc = wtx__auth_create(opts->token_file, opts->reflection, &w->auth, err, errlen);
  if (rc == 0) rc = wtx__netallow_parse(opts->allow_upstream, &w->allow_upstream, err, errlen);
  w->env.allow_upstream = w->allow_upstream;
  w->env.relay_port = opts->relay_port;
  w->env.max_model_bytes = opts->max_model_bytes;
  if (rc == 0) rc = cuda_device(w, opts->cuda_device, err, errlen);
  if (rc == 0) rc = open_shard(w, opts, &cfg, err, errlen);
  w->host_pause = opts->on_pause;
  w->host_resume = opts->on_resume;
  w->host = opts->host;
  if (rc == 0) rc = open_model(w, opts, &cfg, err, errlen);
  if (rc == 0) rc = open_vllm(w, opts, err, errlen);
  if (rc == 0) rc = open_metrics(w, opts->metrics_listen, err, errlen);
  cfg.metrics = w->metrics;
  if (rc == 0 && (rc = wtx__session_init(&w->session, &cfg)) == 0) w->session_ready = 1;
  if (rc == 0) rc = open_server(w, opts, err, errlen);
  if (rc != 0) goto fail;
  *out = w;
  return 0;
fail:
  if (errlen > 0 && err[0] == '\0') snprintf(err, errlen, "%s", wtx_strerror(rc));
  wtx_worker_destroy(w);
  return rc;
}

int wtx_worker_port(const wtx_worker *w) { return w->port; }

int wtx_worker_metrics_port(const wtx_worker *w) { return w->metrics_port; }

wtx_store *wtx_worker_store(wtx_worker *w) { return w->own_store; }

int wtx_worker_watchdog(wtx_worker *w) { return wtx__session_watchdog(&w->session); }

int wtx_worker_paused(const wtx_worker *w) { return atomic_load(&w->session.paused); }

void wtx_worker_set_serving(wtx_worker *w, int serving) {
  pthread_mutex_lock(&w->mu);
  if (!w->drained) wtx__rpc_health_set(w->health, serving);
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
  if (w->health != NULL) wtx__rpc_health_close(w->health);
  if (w->session_ready) wtx__session_drain(&w->session);
  if (w->srv != NULL) wtx__rpc_server_shutdown(w->srv, grace_ms);
}

void wtx_worker_destroy(wtx_worker *w) {
  if (w == NULL) return;
  wtx_worker_drain(w, 0);
  wtx__rpc_server_destroy(w->srv);
  wtx__rpc_health_destroy(w->health);
  wtx__publisher_destroy(w->publisher);
  wtx__vllm_destroy(w->vllm);
  if (w->http != NULL) MHD_stop_daemon(w->http);
  wtx__metrics_destroy(w->metrics);
  if (w->session_ready) wtx__session_destroy(&w->session);
  wtx_store_destroy(w->own_store);
  wtx__auth_destroy(w->auth);
  wtx__netallow_destroy(w->allow_upstream);
  free(w->cuda_device);
  free(w->shard_rules);
  pthread_mutex_destroy(&w->mu);
  free(w);
}
