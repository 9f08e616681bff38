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
  return wtx_init_case_name(init_case) != NULL &&
         protobuf_c_message_descriptor_get_field(&wtx__v1__update_info__descriptor,
                                                 (unsigned)update_case) != NULL;
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

const char *wtx_init_case_name(int init_case) {
  const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field(
      &wtx__v1__init_info__descriptor, (unsigned)init_case);
  /* Only oneof members name a backend (the shared fields are no members). */
  return f != NULL && (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) ? f->name : NULL;
}

static int resolve_checksum(int checksum, int default_checksum, int *out) {
  switch (checksum) {
    case WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_UNSPECIFIED:
      *out = default_checksum;
      return 0;
    case WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_NONE:
    case WTX__V1__CHECKSUM_ALGORITHM__CHECKSUM_ALGORITHM_XXH3_64:
      *out = checksum;
      return 0;
    default:
      return WTX_EINVAL;
  }
}

int wtx_wire_params_from_init(const Wtx__V1__InitInfo *init,
                              int default_checksum, wtx_wire_params *out,
                              char *err, size_t errlen) {
  const Wtx__V1__PackingParams *pk = init->packing;
  memset(out, 0, sizeof *out);
  out->packed = pk != NULL ? pk->packed : 1;
  out->buffer_size = pk != NULL && pk->buffer_size_bytes != 0
                         ? pk->buffer_size_bytes
                         : WTX_DEFAULT_BUFFER_SIZE;
  out->num_buffers = pk != NULL && pk->num_buffers != 0
                         ? pk->num_buffers
                         : WTX_DEFAULT_NUM_BUFFERS;
  out->timeout_ms = init->timeout_ms != 0 ? init->timeout_ms : WTX_DEFAULT_TIMEOUT_MS;
  if (out->buffer_size < WTX_MIN_BUFFER_SIZE || out->buffer_size > WTX_MAX_BUFFER_SIZE) {
    snprintf(err, errlen, "packing.buffer_size_bytes: %llu is outside %llu .. 2^40",
             (unsigned long long)out->buffer_size,
             (unsigned long long)WTX_MIN_BUFFER_SIZE);
    return WTX_EINVAL;
  }
  if (out->timeout_ms > WTX_MAX_TIMEOUT_MS) {
    snprintf(err, errlen, "timeout_ms: %u is above %d (one hour)", out->timeout_ms,
             WTX_MAX_TIMEOUT_MS);
    return WTX_EINVAL;
  }
  if (out->num_buffers > WTX_MAX_BUFFERS) {
    snprintf(err, errlen, "packing.num_buffers: %u is outside 1 .. %d",
             out->num_buffers, WTX_MAX_BUFFERS);
    return WTX_EINVAL;
  }
  if (resolve_checksum(init->checksum, default_checksum, &out->checksum) != 0) {
    snprintf(err, errlen, "checksum: unknown algorithm %d", init->checksum);
    return WTX_EINVAL;
  }
  return 0;
}

void wtx_wire_params_to_init(const wtx_wire_params *wire,
                             Wtx__V1__PackingParams *pk,
                             Wtx__V1__InitInfo *init) {
  wtx__v1__packing_params__init(pk);
  pk->packed = wire->packed;
  pk->buffer_size_bytes = wire->buffer_size;
  pk->num_buffers = wire->num_buffers;
  init->packing = pk;
  init->checksum = (Wtx__V1__ChecksumAlgorithm)wire->checksum;
  init->timeout_ms = wire->timeout_ms;
}
