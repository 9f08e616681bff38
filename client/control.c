/* A control plane of the caller's (see control.h). */
#include "client/control.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wtx/error.h"

struct wtx__control {
  const wtx_control_ops *ops;
  void *self;
  pthread_t th;
  int running;     /* th started and not yet joined */
  atomic_int done; /* th has returned */
  int is_update;
  int rc;
  uint8_t *msg;
  size_t len;
  char err[1024];
};

int wtx__control_create(const wtx_control_ops *ops, void *self, wtx__control **out) {
  if (ops == NULL || ops->init == NULL || ops->start == NULL || ops->update == NULL ||
      ops->finish == NULL)
    return WTX_EINVAL;
  wtx__control *ctl = calloc(1, sizeof *ctl);
  if (ctl == NULL) return WTX_ENOMEM;
  ctl->ops = ops;
  ctl->self = self;
  atomic_init(&ctl->done, 0);
  *out = ctl;
  return 0;
}

void wtx__control_destroy(wtx__control *ctl) {
  if (ctl == NULL) return;
  if (ctl->running) pthread_join(ctl->th, NULL);
  free(ctl->msg);
  free(ctl);
}

static void *call(void *arg) {
  wtx__control *ctl = arg;
  ctl->err[0] = '\0';
  ctl->rc = ctl->is_update
                ? ctl->ops->update(ctl->self, ctl->msg, ctl->len, ctl->err, sizeof ctl->err)
                : ctl->ops->init(ctl->self, ctl->msg, ctl->len, ctl->err, sizeof ctl->err);
  atomic_store(&ctl->done, 1);
  return NULL;
}

int wtx__control_begin(wtx__control *ctl, int is_update, const ProtobufCMessage *msg) {
  if (ctl->running) return WTX_ESTATE;
  size_t len = protobuf_c_message_get_packed_size(msg);
  uint8_t *buf = malloc(len ? len : 1);
  if (buf == NULL) return WTX_ENOMEM;
  protobuf_c_message_pack(msg, buf);
  free(ctl->msg);
  ctl->msg = buf;
  ctl->len = len;
  ctl->is_update = is_update;
  atomic_store(&ctl->done, 0);
  if (pthread_create(&ctl->th, NULL, call, ctl) != 0) return WTX_ENOMEM;
  ctl->running = 1;
  return 0;
}

/* rc, with err saying why: the caller's message, else the code's. */
static int said(int rc, const char *why, char *err, size_t errlen) {
  if (rc != 0) snprintf(err, errlen, "%s", why[0] ? why : wtx_strerror(rc));
  return rc;
}

int wtx__control_end(wtx__control *ctl, char *err, size_t errlen) {
  if (!ctl->running) return WTX_ESTATE;
  pthread_join(ctl->th, NULL);
  ctl->running = 0;
  return said(ctl->rc, ctl->err, err, errlen);
}

int wtx__control_failed(wtx__control *ctl) {
  return ctl->running && atomic_load(&ctl->done) && ctl->rc != 0;
}

int wtx__control_start(wtx__control *ctl, int target, char *err, size_t errlen) {
  char why[1024] = "";
  return said(ctl->ops->start(ctl->self, target, why, sizeof why), why, err, errlen);
}

int wtx__control_finish(wtx__control *ctl, const char *version, char *err, size_t errlen) {
  char why[1024] = "";
  return said(ctl->ops->finish(ctl->self, version, why, sizeof why), why, err, errlen);
}

void wtx__control_abort(wtx__control *ctl, const char *reason) {
  if (ctl->running) { /* a call still runs: wait for it (it ends with the stream) */
    pthread_join(ctl->th, NULL);
    ctl->running = 0;
  }
  if (ctl->ops->abort != NULL) ctl->ops->abort(ctl->self, reason);
}
