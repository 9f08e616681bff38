/* Backend registries and the handshake's wire parameters. */
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

int wtx_worker_transport_register(const wtx_worker_transport *t) {
  if (t == NULL || t->name == NULL || t->init == NULL || t->receive == NULL ||
      t->destroy == NULL)
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
      t->destroy == NULL)
    return WTX_EINVAL;
  return reg_add(&trainers, t, t->name);
}

const wtx_trainer_transport *wtx_trainer_transport_find(const char *name) {
  return reg_find(&trainers, name);
}

void wtx_trainer_transport_names(char *buf, size_t len) {
  reg_names(&trainers, buf, len);
}

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

/* The fields every backend's init message shares, found by its oneof. */
typedef struct init_fields {
  const char *name;
  const Wtx__V1__PackingParams *packing;
  int checksum;
  uint32_t timeout_ms;
  int gpu;
} init_fields;

static int init_fields_of(const Wtx__V1__InitInfo *init, init_fields *f) {
#define WTX__FIELDS(msg, n, g) \
  *f = (init_fields){n, msg->packing, msg->checksum, msg->timeout_ms, g}
  switch (init->backend_case) {
    case WTX__V1__INIT_INFO__BACKEND_NCCL:
      WTX__FIELDS(init->nccl, "nccl", 1);
      return 0;
    case WTX__V1__INIT_INFO__BACKEND_CUDA_IPC:
      WTX__FIELDS(init->cuda_ipc, "cuda_ipc", 1);
      return 0;
    case WTX__V1__INIT_INFO__BACKEND_TCP:
      WTX__FIELDS(init->tcp, "tcp", 0);
      return 0;
    case WTX__V1__INIT_INFO__BACKEND_SHM:
      WTX__FIELDS(init->shm, "shm", 0);
      return 0;
    default:
      return WTX_EINVAL;
  }
#undef WTX__FIELDS
}

const char *wtx_init_backend_name(const Wtx__V1__InitInfo *init) {
  init_fields f;
  return init_fields_of(init, &f) == 0 ? f.name : NULL;
}

int wtx_wire_params_from_init(const Wtx__V1__InitInfo *init,
                              wtx_wire_params *out, char *err, size_t errlen) {
  init_fields f;
  if (init_fields_of(init, &f) != 0) {
    snprintf(err, errlen, "init_info.backend: no backend set");
    return WTX_EINVAL;
  }
  const Wtx__V1__PackingParams *pk = f.packing;
  int checksum = f.checksum;
  uint32_t timeout_ms = f.timeout_ms;
  int gpu = f.gpu;
  memset(out, 0, sizeof *out);
  out->packed = pk != NULL ? pk->packed : 1;
  out->buffer_size = pk != NULL && pk->buffer_size_bytes != 0
                         ? pk->buffer_size_bytes
                         : WTX_DEFAULT_BUFFER_SIZE;
  out->num_buffers = pk != NULL && pk->num_buffers != 0
                         ? pk->num_buffers
                         : WTX_DEFAULT_NUM_BUFFERS;
  out->timeout_ms = timeout_ms != 0 ? timeout_ms : WTX_DEFAULT_TIMEOUT_MS;
  if (out->buffer_size < 1024 || out->buffer_size > (UINT64_C(1) << 40)) {
    snprintf(err, errlen,
             "packing.buffer_size_bytes: %llu is outside 1024 .. 2^40",
             (unsigned long long)out->buffer_size);
    return WTX_EINVAL;
  }
  if (out->num_buffers > 64) {
    snprintf(err, errlen, "packing.num_buffers: %u is outside 1 .. 64",
             out->num_buffers);
    return WTX_EINVAL;
  }
  switch (checksum) {
    case WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_UNSPECIFIED:
      out->checksum = gpu ? WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE
                          : WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64;
      break;
    case WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE:
    case WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64:
      out->checksum = checksum;
      break;
    default:
      snprintf(err, errlen, "checksum: unknown algorithm %d", checksum);
      return WTX_EINVAL;
  }
  return 0;
}

void wtx_wire_params_packing(const wtx_wire_params *wire,
                             Wtx__V1__PackingParams *out) {
  wtx__v1__packing_params__init(out);
  out->packed = wire->packed;
  out->buffer_size_bytes = wire->buffer_size;
  out->num_buffers = wire->num_buffers;
}
