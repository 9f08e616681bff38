/* grpc.health.v1.Health over wtx__rpc (see services.h). */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.grpc-c.h"
#include "rpc/services.h"

#define STATUS(x) GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__##x

struct wtx__rpc_health {
  wtx__rpc_server *srv;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int serving;
  int closed;
  uint64_t changes; /* bumped on every set, so watchers see each change */
};

/* 1 when name is "" or a service of the server. */
static int known(const wtx__rpc_health *h, const char *name) {
  if (name[0] == '\0') return 1;
  for (size_t i = 0; i < wtx__rpc_server_service_count(h->srv); i++)
    if (strcmp(wtx__rpc_server_service(h->srv, i)->full_name, name) == 0)
      return 1;
  return 0;
}

static grpc_status_code check(wtx__rpc_ctx *ctx,
                              const Grpc__Health__V1__HealthCheckRequest *req,
                              Grpc__Health__V1__HealthCheckResponse *resp) {
  wtx__rpc_health *h = wtx__rpc_ctx_user(ctx);
  if (!known(h, req->service))
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_NOT_FOUND,
                              "service '%s' is not served here", req->service);
  resp->status = wtx__rpc_health_serving(h) ? STATUS(SERVING) : STATUS(NOT_SERVING);
  return GRPC_STATUS_OK;
}

static grpc_status_code watch(wtx__rpc_ctx *ctx) {
  wtx__rpc_health *h = wtx__rpc_ctx_user(ctx);
  Grpc__Health__V1__HealthCheckRequest *req = NULL;
  int rc = grpc__health__v1__health__watch__read(ctx, &req);
  if (rc != 1)
    return wtx__rpc_ctx_errorf(ctx, GRPC_STATUS_INVALID_ARGUMENT,
                              "Watch: request message missing");
  int is_known = known(h, req->service);
  protobuf_c_message_free_unpacked(&req->base, NULL);
  Grpc__Health__V1__HealthCheckResponse resp =
      GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
  pthread_mutex_lock(&h->mu);
  for (;;) {
    uint64_t seen = h->changes;
    int closed = h->closed;
    resp.status = !is_known ? STATUS(SERVICE_UNKNOWN)
                  : h->serving ? STATUS(SERVING)
                               : STATUS(NOT_SERVING);
    pthread_mutex_unlock(&h->mu);
    /* A write fails once the client has gone: the watch ends there. */
    if (grpc__health__v1__health__watch__write(ctx, &resp) != 0 || closed)
      return GRPC_STATUS_OK;
    pthread_mutex_lock(&h->mu);
    while (h->changes == seen && !h->closed) pthread_cond_wait(&h->cv, &h->mu);
  }
}

static const Grpc__Health__V1__Health_Handlers handlers = {
    .check = check,
    .watch = watch,
};

int wtx__rpc_health_create(wtx__rpc_server *srv, wtx__rpc_health **out) {
  *out = NULL;
  wtx__rpc_health *h = calloc(1, sizeof *h);
  if (h == NULL) return WTX_ENOMEM;
  h->srv = srv;
  pthread_mutex_init(&h->mu, NULL);
  pthread_cond_init(&h->cv, NULL);
  int rc = wtx__rpc_server_add_service(srv, &grpc__health__v1__health__grpc,
                                      &handlers, h);
  if (rc != 0) {
    wtx__rpc_health_destroy(h);
    return rc;
  }
  *out = h;
  return 0;
}

void wtx__rpc_health_set(wtx__rpc_health *h, int serving) {
  pthread_mutex_lock(&h->mu);
  if (!h->closed && h->serving != (serving != 0)) {
    h->serving = serving != 0;
    h->changes++;
    pthread_cond_broadcast(&h->cv);
  }
  pthread_mutex_unlock(&h->mu);
}

int wtx__rpc_health_serving(wtx__rpc_health *h) {
  pthread_mutex_lock(&h->mu);
  int s = h->serving;
  pthread_mutex_unlock(&h->mu);
  return s;
}

void wtx__rpc_health_close(wtx__rpc_health *h) {
  pthread_mutex_lock(&h->mu);
  h->serving = 0;
  h->closed = 1;
  h->changes++;
  pthread_cond_broadcast(&h->cv);
  pthread_mutex_unlock(&h->mu);
}

void wtx__rpc_health_destroy(wtx__rpc_health *h) {
  if (h == NULL) return;
  pthread_mutex_destroy(&h->mu);
  pthread_cond_destroy(&h->cv);
  free(h);
}
