/* Backend registries and the handshake's shared wire parameters. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "transport/transport.h"

#define MAX_BACKENDS 16

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

/* One registry per side: backends by name, duplicates refused. */
typedef struct registry {
  const void *items[MAX_BACKENDS];
  const char *names[MAX_BACKENDS];
  size_t n;
} registry;

static registry workers, trainers;

static int reg_add(registry *r, const void *item, const char *name) {
  int rc = 0;
  pthread_mutex_lock(&mu);
  for (size_t i = 0; i < r->n; i++)
    if (strcmp(r->names[i], name) == 0) rc = WTX_EEXIST;
  if (rc == 0 && r->n == MAX_BACKENDS) rc = WTX_ENOMEM;
  if (rc == 0) {
    r->items[r->n] = item;
    r->names[r->n++] = name;
  }
  pthread_mutex_unlock(&mu);
  return rc;
}

static const void *reg_find(registry *r, const char *name) {
  const void *t = NULL;
  pthread_mutex_lock(&mu);
  for (size_t i = 0; i < r->n && t == NULL; i++)
    if (strcmp(r->names[i], name) == 0) t = r->items[i];
  pthread_mutex_unlock(&mu);
  return t;
}

static void reg_names(registry *r, char *buf, size_t len) {
  size_t off = 0;
  if (len > 0) buf[0] = '\0';
  pthread_mutex_lock(&mu);
  for (size_t i = 0; i < r->n && off < len; i++)
    off += (size_t)snprintf(buf + off, len - off, "%s%s", i ? ", " : "",
                            r->names[i]);
  pthread_mutex_unlock(&mu);
}

/* The oneof cases must name members of the schema's oneofs. */
static int cases_valid(int init_case, int update_case) {
  return wtx_init_case_name(init_case) != NULL && wtx_update_case_name(update_case) != NULL;
}

int wtx_worker_transport_register(const wtx_worker_transport *t) {
  if (t == NULL || t->name == NULL || t->init == NULL || t->receive == NULL ||
      t->destroy == NULL || !cases_valid(t->init_case, t->update_case))
    return WTX_EINVAL;
  return reg_add(&workers, t, t->name);
}

const wtx_worker_transport *wtx_worker_transport_find(const char *name) {
  return reg_find(&workers, name);
}

void wtx_worker_transport_names(char *buf, size_t len) {
  reg_names(&workers, buf, len);
}

int wtx_trainer_transport_register(const wtx_trainer_transport *t) {
  if (t == NULL || t->name == NULL || t->create == NULL ||
      t->init_info == NULL || t->buffer == NULL || t->prepare == NULL ||
      t->destroy == NULL || !cases_valid(t->init_case, t->update_case))
    return WTX_EINVAL;
  return reg_add(&trainers, t, t->name);
}

const wtx_trainer_transport *wtx_trainer_transport_find(const char *name) {
  return reg_find(&trainers, name);
}

void wtx_trainer_transport_names(char *buf, size_t len) {
  reg_names(&trainers, buf, len);
}

const char *const wtx_builtin_backends[] = {"shm", "tcp", "nccl", "cuda_ipc"};
const size_t wtx_n_builtin_backends =
    sizeof wtx_builtin_backends / sizeof wtx_builtin_backends[0];

static pthread_once_t builtin_once = PTHREAD_ONCE_INIT;

static void register_builtin(void) {
  wtx_worker_transport_register(&wtx_shm_worker_transport);
  wtx_trainer_transport_register(&wtx_shm_trainer_transport);
  wtx_worker_transport_register(&wtx_tcp_worker_transport);
  wtx_trainer_transport_register(&wtx_tcp_trainer_transport);
  wtx_worker_transport_register(&wtx_nccl_worker_transport);
  wtx_trainer_transport_register(&wtx_nccl_trainer_transport);
  wtx_worker_transport_register(&wtx_cuda_ipc_worker_transport);
  wtx_trainer_transport_register(&wtx_cuda_ipc_trainer_transport);
}

void wtx_transports_register_builtin(void) {
  pthread_once(&builtin_once, register_builtin);
}
