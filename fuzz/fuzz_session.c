/* libFuzzer target: the worker's real session (server/session.c), started
 * through wtx_worker_start with its gRPC server, handlers and in-memory
 * store, driven by sequences of WeightTransfer calls over a loopback
 * channel. An input is a series of calls, each a byte, two bytes of
 * length and the request's bytes (decoded as a client would send them; an
 * undecodable one is skipped). The byte's low 4 bits pick the method; its
 * high bits put this run's session id, its update id, and the one shm
 * region that exists (64 KiB of a known pattern) in the request, so
 * sequences get past the session checks and move real bytes. Only shm is
 * served and every wait is short. After each input the worker must still
 * answer, and every published tensor with a checksum must hash to it. */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include <xxhash.h>

#include "rpc/rpc.h"
#include "common/log.h"
#include "wtx/v1/weight_transfer.grpc-c.h"
#include "wtx/worker.h"

#define REGION "/wtx-fuzz-session"
#define REGION_BYTES 65536

static wtx_worker *worker;
static wtx__rpc_channel *channel;
static char session[64];
static uint64_t update;

static void start(void) {
  if (getenv("WTX_FUZZ_LOG") == NULL) wtx__log_set_level(WTX__LOG_OFF); /* a run to read */
  int fd = shm_open(REGION, O_RDWR | O_CREAT, 0600);
  if (fd < 0 || ftruncate(fd, REGION_BYTES) != 0) abort();
  uint8_t *p = mmap(NULL, REGION_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) abort();
  for (size_t i = 0; i < REGION_BYTES; i++) p[i] = (uint8_t)(i * 131 + 7);
  munmap(p, REGION_BYTES);
  close(fd);
  static const char *const shm_only[] = {"shm"};
  wtx_worker_options o = WTX_WORKER_OPTIONS_INIT;
  o.listen = "127.0.0.1:0";
  o.backends = shm_only;
  o.n_backends = 1;
  o.watchdog_ms = 2000;
  o.max_model_bytes = UINT64_C(64) << 20;
  char err[512];
  if (wtx_worker_start(&o, &worker, err, sizeof err) != 0) abort();
  char target[64];
  snprintf(target, sizeof target, "127.0.0.1:%d", wtx_worker_port(worker));
  if (wtx__rpc_channel_create(target, NULL, &channel) != 0) abort();
}

/* Sets the string field name of m to value, when m has one. */
static void put_string(ProtobufCMessage *m, const char *name, const char *value) {
  const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field_by_name(
      m->descriptor, name);
  if (f == NULL || f->type != PROTOBUF_C_TYPE_STRING || f->label == PROTOBUF_C_LABEL_REPEATED)
    return;
  char **slot = (char **)((uint8_t *)m + f->offset);
  char *copy = strdup(value);
  if (copy == NULL) return;
  if (*slot != NULL && *slot != (char *)f->default_value) free(*slot);
  *slot = copy;
}

/* The run's ids and the region, where op's high bits ask for them; the
 * waits of an InitInfo held short. */
static void steer(ProtobufCMessage *m, uint8_t op) {
  if (op & 0x10) put_string(m, "session_id", session);
  const ProtobufCFieldDescriptor *f =
      protobuf_c_message_descriptor_get_field_by_name(m->descriptor, "update_id");
  if ((op & 0x20) && f != NULL && f->type == PROTOBUF_C_TYPE_UINT64)
    *(uint64_t *)((uint8_t *)m + f->offset) = update;
  if (m->descriptor == &wtx__v1__init_weight_transfer_engine_request__descriptor) {
    Wtx__V1__InitWeightTransferEngineRequest *r = (void *)m;
    if (r->init_info != NULL) r->init_info->timeout_ms = 200;
  }
  if (m->descriptor == &wtx__v1__update_weights_request__descriptor && (op & 0x40)) {
    Wtx__V1__UpdateWeightsRequest *r = (void *)m;
    if (r->update_info != NULL && r->update_info->shm != NULL)
      put_string(&r->update_info->shm->base, "region", REGION);
  }
}

/* What a call's answer tells the next calls. */
static void learn(const ProtobufCMessage *resp) {
  if (resp->descriptor == &wtx__v1__init_weight_transfer_engine_response__descriptor) {
    const char *id = ((const Wtx__V1__InitWeightTransferEngineResponse *)resp)->session_id;
    snprintf(session, sizeof session, "%s", id);
  } else if (resp->descriptor == &wtx__v1__start_weight_update_response__descriptor) {
    update = ((const Wtx__V1__StartWeightUpdateResponse *)resp)->update_id;
  }
}

static void call(uint8_t op, const uint8_t *body, size_t len) {
  const wtx__rpc_service *svc = &wtx__v1__weight_transfer__grpc;
  const wtx__rpc_method *m = &svc->methods[(op & 0x0f) % svc->n_methods];
  ProtobufCMessage *req = protobuf_c_message_unpack(m->input, NULL, len, body);
  if (req == NULL) return;
  steer(req, op);
  wtx__rpc_call_options o = WTX__RPC_CALL_OPTIONS_INIT;
  o.timeout_ms = 2000;
  ProtobufCMessage *resp = NULL;
  wtx__rpc_status st;
  if (wtx__rpc_unary(channel, m, req, &resp, &o, &st) == 0 && resp != NULL) learn(resp);
  if (resp != NULL) protobuf_c_message_free_unpacked(resp, NULL);
  protobuf_c_message_free_unpacked(req, NULL);
}

/* The worker still answers, and what it publishes is whole. */
static void check(void) {
  Wtx__V1__GetWeightInfoRequest req = WTX__V1__GET_WEIGHT_INFO_REQUEST__INIT;
  Wtx__V1__GetWeightInfoResponse *resp = NULL;
  wtx__rpc_status st;
  if (wtx__v1__weight_transfer__get_weight_info__call(channel, &req, &resp, NULL, &st) != 0)
    abort();
  protobuf_c_message_free_unpacked(&resp->base, NULL);
  wtx_store_view v;
  for (int t = WTX_TARGET_MAIN; t <= WTX_TARGET_DRAFT; t++) {
    if (wtx_store_acquire(wtx_worker_store(worker), (wtx_target)t, &v) != 0) continue;
    for (size_t i = 0; i < v.n_params; i++)
      if (v.params[i].has_xxh3 &&
          XXH3_64bits(v.params[i].data, v.params[i].meta.nbytes) != v.params[i].xxh3)
        abort();
    wtx_store_release(wtx_worker_store(worker), &v);
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static int started;
  if (!started++) start();
  while (size >= 3) {
    uint8_t op = data[0];
    size_t len = (size_t)data[1] | (size_t)data[2] << 8;
    data += 3, size -= 3;
    if (len > size) len = size;
    call(op, data, len);
    data += len, size -= len;
  }
  check();
  return 0;
}
